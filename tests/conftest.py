"""Shared fixtures for the op tests: devices, dtypes, shapes, layouts and fresh random data."""

import math
import os

import pytest
import torch

import cockpit_fast

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Per-sample shapes of real layers: Linear weight, conv weight, bias, a single value, and a long
# row that crosses the kernels' tile and chunk boundaries (1024, 2048, 4096 values).
PARAM_SHAPES = [(37, 61), (8, 3, 3, 3), (17,), (1,), (4099,)]
BATCH_SIZES = [1, 5, 70]  # 70 crosses the CPU kernels' 64-row groups
LAYOUTS = ["contiguous", "non_contiguous", "offset"]
"""How test gradients sit in memory: dense; every other element (a non-unit stride); dense but
one element into their storage (not 16-byte aligned: the CUDA kernels' vector loads must not
assume it)."""

# Relative tolerance of sums against the float64 reference: accumulation is float32 or float64;
# the inputs themselves are exact in float64, so only the accumulation rounds.
SUM_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-5, torch.bfloat16: 1e-5}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="session")
def _extension_is_what_we_test():
    """The op tests are about the fused kernels: running them on the reference would prove nothing."""
    if os.environ.get("COCKPIT_FAST_REFERENCE", "") in ("", "0"):
        assert cockpit_fast.has_extension(), "cockpit_fast._C is not built: run `python setup.py build_ext --inplace`"


def random_grad(n, param_shape, dtype=torch.float32, device="cpu", layout="contiguous", seed=0, spread=1.0):
    """Fresh per-sample gradients (N, *param_shape): normal values, never zeros, optionally strided."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, *param_shape)
    if layout == "contiguous":
        return (spread * torch.randn(shape, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype)
    if layout == "offset":
        flat = torch.randn(math.prod(shape) + 1, generator=gen, dtype=torch.float64)
        g = (spread * flat).to(device=device, dtype=dtype)[1:].view(shape)
        assert g.is_contiguous() and g.storage_offset() == 1
        return g
    # Every other element of a wider tensor: a non-unit innermost stride.
    wide = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen, dtype=torch.float64)
    g = (spread * wide).to(device=device, dtype=dtype)[..., ::2]
    assert g.numel() <= 1 or not g.is_contiguous()
    return g


def random_param(param_shape, dtype=torch.float32, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(param_shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def assert_close_to_reference(actual, expected, dtype):
    """``actual`` (accumulation dtype) against a float64 reference, to the dtype's rounding."""
    assert actual.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=SUM_RTOL[dtype], atol=1e-9)


def assert_rejects(op_name, call, match):
    """``call(module)`` must raise ValueError naming the op, through the fused op and the reference."""
    from cockpit_fast import ops, reference

    for module in (ops, reference):
        with pytest.raises(ValueError, match=f"cockpit_fast.{op_name}: .*{match}"):
            call(module)


def bad_grads():
    """Per-sample gradients every op must reject: (tensor, what the message says)."""
    return [
        (torch.tensor(1.5), "leading batch dimension"),
        (torch.ones(3, 4, dtype=torch.int64), "must be float16, bfloat16, float32 or float64"),
        (torch.ones(3, 4, dtype=torch.complex64), "must be float16, bfloat16, float32 or float64"),
    ]


FLOAT32_UNBINNABLE_RANGES = [
    ((-1e38, 1e38), "span * bins overflows float32"),
    ((-1e39, 1e39), "the bounds overflow float32"),
    ((1.0, 1.0 + 1e-12), "the bounds round to one float32"),
]
"""Ranges valid in double whose bins float32 arithmetic cannot compute: rejected for every dtype
but float64 (bin indices would be garbage, and out-of-bounds counter writes)."""

BINNABLE_IN_FLOAT32_ONLY_MESSAGE = "overflows or rounds to nothing in float32"


def same_on_one_and_two_threads(call):
    """Runs call() on 1 and on 2 threads; returns both results."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(2)
        two = call()
    finally:
        torch.set_num_threads(threads)
    return one, two


def values_near_edges(values, lo, hi, bins, tol=1e-4):
    """How many float64 values lie within ``tol`` bin widths of a bin edge of [lo, hi]."""
    position = (values.double().clamp(lo, hi) - lo) * bins / (hi - lo)
    return int(((position - position.round()).abs() < tol).sum())


def cockpit_module(name):
    """A module of Cockpit 1.0.2, the package we must agree with (a test dependency)."""
    return pytest.importorskip(name)
