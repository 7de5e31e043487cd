"""outer_hist2d: 2D histograms over (per-sample outer product element, parameter element)."""

import pytest
import torch

from cockpit_fast import ops, reference
from conftest import (
    BINNABLE_IN_FLOAT32_ONLY_MESSAGE,
    FLOAT32_UNBINNABLE_RANGES,
    BATCH_SIZES,
    DEVICES,
    DTYPES,
    LAYOUTS,
    assert_rejects,
    random_grad,
    random_param,
    requires_cuda,
    same_on_one_and_two_threads,
)
from test_outer_hist1d import FACTOR_SIZES, factors

BINS, RANGE = (11, 13), ((-1.0, 1.5), (-2.0, 2.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", FACTOR_SIZES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(device, dtype, sizes, n, layout):
    delta, inputs = factors(n, *sizes, dtype, device, layout, seed=n)
    param = random_param(sizes, dtype, device)
    counts = ops.outer_hist2d(delta, inputs, param, BINS, RANGE, float(n))
    assert counts.dtype == torch.int64 and counts.shape == BINS
    assert torch.equal(counts, reference.outer_hist2d(delta, inputs, param, BINS, RANGE, float(n)))
    # Against float64: every pair counted; a pair moves only where x sits at an edge's rounding.
    exact = reference.outer_hist2d(delta.double(), inputs.double(), param.double(), BINS, RANGE, float(n))
    assert counts.sum() == n * sizes[0] * sizes[1]
    if dtype in (torch.float32, torch.float64):
        assert torch.equal(counts.sum(0), exact.sum(0))  # the parameter axis sees exact values
        assert (counts - exact).abs().sum() <= max(2, 1e-3 * counts.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_counts_as_hist2d_of_the_materialised_outer_products(dtype):
    delta, inputs = factors(32, 40, 300, dtype, seed=3)
    param = random_param((40, 300), dtype)
    grad_batch = torch.einsum("no,ni->noi", delta, inputs)
    for bins, rng in [((40, 50), ((-1.0, 1.0), (-2.0, 2.0))), ((300, 200), ((-0.1, 0.1), (-3.0, 3.0)))]:
        expected = ops.hist2d(grad_batch, param, bins, rng, scale=32)
        assert torch.equal(ops.outer_hist2d(delta, inputs, param, bins, rng, scale=32), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", [ops, reference], ids=["op", "reference"])
def test_counts_are_exact_past_float32(device, implementation):
    # 4097^2 = 2^24 + 8193 pairs in one cell, a count float32 would round to an even one.
    delta, inputs = torch.ones(1, 4097, device=device), torch.zeros(1, 4097, device=device)
    param = torch.zeros(4097, 4097, device=device)
    counts = implementation.outer_hist2d(delta, inputs, param, (40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
    assert counts.dtype == torch.int64 and counts.max() == 4097**2 and counts.sum() == 4097**2


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_infinite_values(device):
    delta, inputs = factors(3, 9, 30, device=device, seed=5)
    param = random_param((9, 30), device=device)
    delta[0, 0] = float("nan")
    inputs[1, 2] = float("inf")
    delta[2, 3] = 0.0
    inputs[2, 4] = float("inf")  # 0 * inf is NaN
    param[5, 7] = float("nan")
    param[6, 8] = -float("inf")
    counts = ops.outer_hist2d(delta, inputs, param, BINS, RANGE, 3.0)
    assert torch.equal(counts, reference.outer_hist2d(delta, inputs, param, BINS, RANGE, 3.0))
    assert counts.sum() == 3 * 9 * 30 - 30 - 1 - 3  # NaN row, 0 * inf, NaN parameter per sample


@pytest.mark.parametrize("device", DEVICES)
def test_large_histogram(device):
    # More cells than fit in shared memory / the interleaved CPU copies.
    delta, inputs = factors(5, 20, 100, device=device)
    param = random_param((20, 100), device=device)
    bins, rng = (200, 150), ((-0.1, 0.1), (-3.0, 3.0))
    assert torch.equal(
        ops.outer_hist2d(delta, inputs, param, bins, rng), reference.outer_hist2d(delta, inputs, param, bins, rng)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, p, q", [(0, 4, 5), (3, 0, 5), (3, 4, 0)])
def test_empty_input(device, n, p, q):
    delta, inputs, param = torch.randn(n, p, device=device), torch.randn(n, q, device=device), torch.randn(p, q, device=device)
    assert torch.equal(ops.outer_hist2d(delta, inputs, param, (3, 4)), torch.zeros(3, 4, dtype=torch.int64, device=device))
    assert torch.equal(reference.outer_hist2d(delta, inputs, param, (3, 4)), torch.zeros(3, 4, dtype=torch.int64, device=device))


def test_same_counts_on_any_thread_count():
    delta, inputs = factors(50, 30, 400, seed=9)
    param = random_param((30, 400))
    one, two = same_on_one_and_two_threads(lambda: ops.outer_hist2d(delta, inputs, param, BINS, RANGE, 50.0))
    assert torch.equal(one, two)


def test_rejects_bad_input():
    left, right, param = torch.ones(3, 4), torch.ones(3, 5), torch.ones(4, 5)
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(torch.ones(3), right, param), "left must be a 2-d")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, torch.ones(2, 5), param), "same number of samples")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, torch.ones(5, 4)), r"param must have shape \(left.shape\[1\], right.shape\[1\]\)")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, param.double()), "left is .* but param is ")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, param, (0, 3)), "x bins must be a positive integer")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, param, (3, 3), ((-1, 1), (2, 2))), "y range needs lo < hi")
    assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, param, (3, 3), RANGE, float("inf")), "scale must be finite")
    for rng, _why in FLOAT32_UNBINNABLE_RANGES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ld, rd, pd = left.to(dtype), right.to(dtype), param.to(dtype)
            assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(ld, rd, pd, (40, 50), (rng, (-2.0, 2.0))), "x range .*" + BINNABLE_IN_FLOAT32_ONLY_MESSAGE)
        ld, rd, pd = left.double(), right.double(), param.double()
        assert torch.equal(ops.outer_hist2d(ld, rd, pd, (40, 50), (rng, rng)), reference.outer_hist2d(ld, rd, pd, (40, 50), (rng, rng)))


@requires_cuda
def test_rejects_tensors_on_different_devices():
    # Any one tensor elsewhere: with left on the CPU the dispatcher still picks the CUDA kernel.
    for devices in (("cuda", "cuda", "cpu"), ("cpu", "cpu", "cuda"), ("cpu", "cuda", "cuda")):
        left, right, param = (torch.ones(shape, device=d) for shape, d in zip([(3, 4), (3, 5), (4, 5)], devices))
        assert_rejects("outer_hist2d", lambda m: m.outer_hist2d(left, right, param), " is on")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    delta, inputs = factors(6, 5, 7, device=device)
    param = random_param((5, 7), device=device)
    torch.library.opcheck(
        torch.ops.cockpit_fast.outer_hist2d.default, (delta, inputs, param, 4, 6, -1.0, 1.0, -2.0, 2.0, 6.0)
    )


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    delta, inputs = factors(128, 256, 78, dtype)
    param = random_param((256, 78), dtype)
    expected = ops.outer_hist2d(delta, inputs, param, (40, 50), RANGE, 128.0)
    actual = ops.outer_hist2d(delta.cuda(), inputs.cuda(), param.cuda(), (40, 50), RANGE, 128.0)
    assert torch.equal(actual.cpu(), expected)
