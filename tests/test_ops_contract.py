"""What every op promises beyond its own numbers: torch.compile, the reference fallback, and
64-bit indexing of tensors past 2^31 elements."""

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cockpit_fast import _limits, ops, reference, stats
from conftest import DEVICES, assert_rejects, random_grad, random_param


def all_ops(g, param):
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g, 4.0)
    outer = param.flatten()[:, None] * param.flatten()[None, :]
    return (
        l2,
        sgs,
        ops.batch_l2(g, 4.0),
        ops.sum_grad_squared(g, 4.0),
        ops.hist1d(g, 30, (-1.0, 1.0), 4.0),
        ops.hist2d(g, param, (6, 7), ((-1.0, 1.0), (-2.0, 2.0)), 4.0),
        ops.batch_dot(g, param, 4.0),
        ops.per_sample_stats(g, 4.0, [1.0, 2.0]),
        *ops.hist1d_batch_l2_batch_dots(g, torch.stack([param, -param]), 30, (-1.0, 1.0), 4.0, 2.0),
        *ops.factored_hist1d_batch_l2_batch_dots(g.flatten(1)[:, None], g.flatten(1)[:, None], torch.stack([outer, -outer]), 30, (-1.0, 1.0), 4.0, 2.0),
    )


def test_every_op_compiles_with_fullgraph():
    g, param = random_grad(4, (9, 5)), random_param((9, 5))
    compiled = torch.compile(all_ops, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(g, param), all_ops(g, param)):
        assert torch.equal(got, expected)


def test_reference_fallback_is_visible_and_agrees():
    """With COCKPIT_FAST_REFERENCE=1 the wrappers say so once and give the same numbers."""
    script = textwrap.dedent(
        """
        import warnings, torch, cockpit_fast
        from cockpit_fast import ops
        assert not cockpit_fast.has_extension()
        g = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = ops.hist1d(g, 10, (-1.0, 1.0), 5.0)
            ops.batch_l2(g)
        assert len(caught) == 1 and "reference" in str(caught[0].message), caught
        torch.save({"hist": first, "stats": ops.per_sample_stats(g, 2.0, [1.5])}, "fallback.pt")
        """
    )
    env = dict(os.environ, COCKPIT_FAST_REFERENCE="1")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=os.environ.get("PYTEST_TMP", "."))
    saved = torch.load(os.path.join(os.environ.get("PYTEST_TMP", "."), "fallback.pt"))
    os.remove(os.path.join(os.environ.get("PYTEST_TMP", "."), "fallback.pt"))
    g = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(saved["hist"], ops.hist1d(g, 10, (-1.0, 1.0), 5.0))
    torch.testing.assert_close(saved["stats"], ops.per_sample_stats(g, 2.0, [1.5]))


@pytest.mark.large
@pytest.mark.parametrize("device", DEVICES)
def test_tensors_past_two_to_the_31_elements(device):
    """Two rows of 1025 * 2^20 float16 values, 2^31 + 2^21 in all: any 32-bit index would wrap.

    The rows repeat one random block, so the exact answer follows from the block's own.
    """
    block = torch.randn(2**20, generator=torch.Generator().manual_seed(0)).half()
    repeats = 2 * 1025
    g = block.to(device).repeat(repeats).view(2, -1)
    old = g[1, -1].clone().cpu()
    g[1, -1] = 50.0  # only visible past the 2^31-th element: a wrapped index would miss it

    block_counts = reference.hist1d(block[None], 64, (-4.0, 4.0))
    moved = reference.hist1d(old.reshape(1, 1), 64, (-4.0, 4.0))
    expected_counts = repeats * block_counts - moved
    expected_counts[-1] += 1  # 50 is clamped into the last bin
    assert torch.equal(ops.hist1d(g, 64, (-4.0, 4.0)).cpu(), expected_counts)

    block_l2 = float(block.double().pow(2).sum())
    expected_l2 = torch.tensor([1025 * block_l2, 1025 * block_l2 - float(old) ** 2 + 2500.0], dtype=torch.float64)
    torch.testing.assert_close(ops.batch_l2(g).double().cpu(), expected_l2, rtol=1e-5, atol=0)
    fused_counts, fused_l2, _ = ops.hist1d_batch_l2_batch_dots(g, g[:0], 64, (-4.0, 4.0))
    assert torch.equal(fused_counts.cpu(), expected_counts)
    torch.testing.assert_close(fused_l2.double().cpu(), expected_l2, rtol=1e-5, atol=0)
    row_stats = ops.per_sample_stats(g, 1.0, [2.0]).cpu()
    assert row_stats[1, stats.MAX] == 50.0 and row_stats[0, stats.MAX] == float(block.max())
    torch.testing.assert_close(row_stats[:, stats.P0].double(), expected_l2, rtol=1e-5, atol=0)


def every_op_with_scale(g, param, scale, bins=6, lo=-1.0, hi=1.0):
    """Every op on (g, param) and on the factors (g, g) with ``scale``: 1D histograms of ``5 * bins``
    bins over (lo, hi), 2D ones of (bins, bins + 1) over (lo, hi) and (2 lo, 2 hi); p values 1 and hi."""
    xy_range = ((lo, hi), (2 * lo, 2 * hi))
    return {
        "batch_l2": lambda m: m.batch_l2(g, scale),
        "sum_grad_squared": lambda m: m.sum_grad_squared(g, scale),
        "batch_l2_and_sum_grad_squared": lambda m: m.batch_l2_and_sum_grad_squared(g, scale),
        "hist1d": lambda m: m.hist1d(g, 5 * bins, (lo, hi), scale),
        "hist2d": lambda m: m.hist2d(g, param, (bins, bins + 1), xy_range, scale),
        "batch_dot": lambda m: m.batch_dot(g, param, scale),
        "per_sample_stats": lambda m: m.per_sample_stats(g, scale, [1.0, hi]),
        "outer_hist1d": lambda m: m.outer_hist1d(g, g, 5 * bins, (lo, hi), scale),
        "outer_hist2d": lambda m: m.outer_hist2d(g, g, param.expand(2, 2).contiguous(), (bins, bins + 1), xy_range, scale),
        "hist1d_batch_l2_batch_dots": lambda m: m.hist1d_batch_l2_batch_dots(g, param[None], 5 * bins, (lo, hi), scale, scale),
        "factored_hist1d_batch_l2_batch_dots": lambda m: m.factored_hist1d_batch_l2_batch_dots(
            g[:, None], g[:, None], param.expand(2, 2)[None], 5 * bins, (lo, hi), scale, scale
        ),
    }


@pytest.mark.parametrize("route", ["extension", "reference"])
def test_every_op_compiles_with_dynamic_numbers_and_shapes(route, monkeypatch):
    """torch.compile(dynamic=True) makes the numbers and the batch size symbolic: the argument
    checks specialise the numbers they compare, and every wrapper traces whole and gives its eager
    result, for two batch sizes and two sets of numbers."""
    if route == "reference":
        monkeypatch.setattr(ops, "_OPS", None)
        monkeypatch.setattr(ops, "_warned", True)  # the fallback's warning has its own test
    for name in every_op_with_scale(None, None, 1.0):
        # Forget earlier compilations: the route is a constant of compiled code, and every op
        # recompiles for new numbers.
        torch._dynamo.reset()

        def op(g, param, scale, bins, lo, hi, name=name):
            return every_op_with_scale(g, param, scale, bins, lo, hi)[name](ops)

        compiled = torch.compile(op, fullgraph=True, dynamic=True, backend="aot_eager")
        for n, numbers in ((4, (2.0, 6, -1.0, 1.0)), (7, (3.5, 4, -0.5, 1.5))):
            g, param = random_grad(n, (2,), seed=n), random_param((2,))
            expected = torch.utils._pytree.tree_leaves(op(g, param, *numbers))
            got = torch.utils._pytree.tree_leaves(compiled(g, param, *numbers))
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (name, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_scale_beyond_float32_is_rejected_where_values_are_scaled_in_float32(dtype):
    g, param = random_grad(3, (2,), dtype), random_param((2,), dtype)
    for name, call in every_op_with_scale(g[:, :2].reshape(3, 2), param, 1e39).items():
        assert_rejects(name, call, "scale must be finite in float32")
    # float64 scales in float64, where 1e39 is fine.
    g64, param64 = g.double()[:, :2].reshape(3, 2), param.double()
    for name, call in every_op_with_scale(g64, param64, 1e39).items():
        call(ops)


def bad_arguments():
    """(op, call(module), what the message says): one bad argument each, every kind of argument."""
    g, param = torch.ones(3, 2), torch.ones(2)
    square = torch.ones(2, 2)
    cases = []
    for name in ("batch_l2", "sum_grad_squared", "batch_l2_and_sum_grad_squared"):
        cases += [
            (name, lambda m, name=name: getattr(m, name)(None), "g must be a tensor, got NoneType"),
            (name, lambda m, name=name: getattr(m, name)([[1.0]]), "g must be a tensor, got list"),
            (name, lambda m, name=name: getattr(m, name)(g, "2"), "scale must be a real number, got '2'"),
            (name, lambda m, name=name: getattr(m, name)(g, True), "scale must be a real number, got True"),
            (name, lambda m, name=name: getattr(m, name)(g, None), "scale must be a real number, got None"),
            (name, lambda m, name=name: getattr(m, name)(g, torch.ones(2)), "scale must be a real number"),
        ]
    for bins in (True, 10.0, torch.tensor(10.0), torch.tensor(True), torch.tensor([10]), "10", None):
        cases.append(("hist1d", lambda m, bins=bins: m.hist1d(g, bins), "bins must be a positive integer"))
        cases.append(("outer_hist1d", lambda m, bins=bins: m.outer_hist1d(g, g, bins), "bins must be a positive integer"))
        cases.append(("hist2d", lambda m, bins=bins: m.hist2d(g, param, (4, bins)), "y bins must be a positive integer"))
    cases += [
        ("hist1d", lambda m: m.hist1d(g, 2**63), r"at most 16777216 histogram cells, got 9223372036854775808"),
        ("hist1d", lambda m: m.hist1d(g, 10, (1.0,)), r"range must be a pair \(lo, hi\), got \(1.0,\)"),
        ("hist1d", lambda m: m.hist1d(g, 10, (0.0, 1.0, 2.0)), r"range must be a pair \(lo, hi\)"),
        ("hist1d", lambda m: m.hist1d(g, 10, None), r"range must be a pair \(lo, hi\), got None"),
        ("hist1d", lambda m: m.hist1d(g, 10, ("0", 1.0)), "range's lo must be a real number, got '0'"),
        ("hist1d", lambda m: m.hist1d(g, 10, (0.0, False)), "range's hi must be a real number, got False"),
        ("hist2d", lambda m: m.hist2d(g, None), "param must be a tensor, got NoneType"),
        ("hist2d", lambda m: m.hist2d(g, param, 10), r"bins must be a pair \(xbins, ybins\), got 10"),
        ("hist2d", lambda m: m.hist2d(g, param, (10,)), r"bins must be a pair \(xbins, ybins\)"),
        ("hist2d", lambda m: m.hist2d(g, param, (2**62, 2**62)), "at most 16777216 histogram cells"),
        ("hist2d", lambda m: m.hist2d(g, param, (4, 4), (0.0, 1.0)), r"x range must be a pair \(lo, hi\), got 0.0"),
        ("hist2d", lambda m: m.hist2d(g, param, (4, 4), ((0.0, 1.0),)), r"range must be a pair \(\(xlo, xhi\), \(ylo, yhi\)\)"),
        ("batch_dot", lambda m: m.batch_dot(g, None), "direction must be a tensor, got NoneType"),
        ("batch_dot", lambda m: m.batch_dot(None, param), "g must be a tensor, got NoneType"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, None), "directions must be a tensor, got NoneType"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, param), r"directions must have shape \(k, \*g.shape\[1:\]\) = \(k, 2\), got \(2,\)"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, param[None], True), "bins must be a positive integer, got True"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, param[None], 10, (0.0,)), r"range must be a pair \(lo, hi\)"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, param[None], 10, (0.0, 1.0), None), "hist_scale must be a real number, got None"),
        ("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, param[None], 10, (0.0, 1.0), 1.0, "2"), "scale must be a real number, got '2'"),
        ("factored_hist1d_batch_l2_batch_dots", lambda m: m.factored_hist1d_batch_l2_batch_dots(None, g[None], square[None]), "left must be a tensor, got NoneType"),
        ("factored_hist1d_batch_l2_batch_dots", lambda m: m.factored_hist1d_batch_l2_batch_dots(g, g, square[None]), r"left must be a 3-d \(N, T, features\) tensor"),
        ("factored_hist1d_batch_l2_batch_dots", lambda m: m.factored_hist1d_batch_l2_batch_dots(g[None], g[None], square), r"directions must have shape \(k, left.shape\[2\], right.shape\[2\]\) = \(k, 2, 2\)"),
        ("factored_hist1d_batch_l2_batch_dots", lambda m: m.factored_hist1d_batch_l2_batch_dots(g[None], g[None], square[None], False), "bins must be a positive integer, got False"),
        ("factored_hist1d_batch_l2_batch_dots", lambda m: m.factored_hist1d_batch_l2_batch_dots(g[None], g[None], square[None], 10, (0.0, 1.0), "2"), "hist_scale must be a real number"),
        ("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, None), "p_values must be a tuple or list of numbers, got None"),
        ("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, 2.0), "p_values must be a tuple or list of numbers"),
        ("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [True]), "a p value must be a real number, got True"),
        ("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, ["2"]), "a p value must be a real number"),
        ("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [1.0] * 9), "at most 8 p values per call, got 9"),
        ("per_sample_stats", lambda m: m.per_sample_stats(None), "g must be a tensor, got NoneType"),
        ("outer_hist1d", lambda m: m.outer_hist1d(None, g), "left must be a tensor, got NoneType"),
        ("outer_hist1d", lambda m: m.outer_hist1d(g, None), "right must be a tensor, got NoneType"),
        ("outer_hist1d", lambda m: m.outer_hist1d(g, g, 10, [0.0]), r"range must be a pair \(lo, hi\)"),
        ("outer_hist2d", lambda m: m.outer_hist2d(g, g, None), "param must be a tensor, got NoneType"),
        ("outer_hist2d", lambda m: m.outer_hist2d(g, g, square, (3, 4, 5)), r"bins must be a pair \(xbins, ybins\)"),
        ("outer_hist2d", lambda m: m.outer_hist2d(g, g, square, (3, 4), ((0.0, 1.0), None)), r"y range must be a pair \(lo, hi\), got None"),
    ]
    return cases


def raised(call, module):
    with pytest.raises(ValueError) as error:
        call(module)
    return type(error.value), str(error.value)


def test_a_bad_argument_gets_the_same_error_from_the_extension_and_the_reference(monkeypatch):
    """Through the fused op, through the wrappers on the reference route (as without the extension
    or with COCKPIT_FAST_REFERENCE=1) and through the twin itself: one ValueError, one message."""
    cases = bad_arguments()
    extension = [raised(call, ops) for _, call, _ in cases]
    monkeypatch.setattr(ops, "_OPS", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallback = [raised(call, ops) for _, call, _ in cases]
    twin = [raised(call, reference) for _, call, _ in cases]
    for (name, _, match), *errors in zip(cases, extension, fallback, twin):
        assert errors[0] == errors[1] == errors[2], errors
        assert re.search(f"cockpit_fast.{name}: .*{match}", errors[0][1]), (errors[0][1], match)


def test_integers_and_numbers_of_every_accepted_kind():
    """Counts: Python and NumPy integers, 0-d integer tensors; numbers: also floats of any kind,
    0-d real tensors; pairs: tuples or lists. Each gives what the plain Python value gives."""
    g, param = random_grad(3, (4, 5)), random_param((4, 5))
    for module in (ops, reference):
        expected = module.hist1d(g, 10, (-1.0, 1.0), 2.0)
        for bins in (np.int64(10), np.int32(10), torch.tensor(10), torch.tensor(10, dtype=torch.uint8)):
            assert torch.equal(module.hist1d(g, bins, (-1.0, 1.0), 2.0), expected)
        for rng in ([-1, 1], (np.float32(-1.0), torch.tensor(1.0)), (torch.tensor(-1), np.int8(1))):
            assert torch.equal(module.hist1d(g, 10, rng, 2.0), expected)
        for scale in (2, np.float16(2.0), np.int64(2), torch.tensor(2.0, dtype=torch.float64)):
            assert torch.equal(module.hist1d(g, 10, (-1.0, 1.0), scale), expected)
        expected = module.hist2d(g, param, (3, 4), ((-1.0, 1.0), (-2.0, 2.0)))
        assert torch.equal(module.hist2d(g, param, [np.int64(3), torch.tensor(4)], [[-1, 1], (-2, 2)]), expected)
        expected = module.per_sample_stats(g, 1.0, [1.0, 2.0])
        assert torch.equal(module.per_sample_stats(g, 1.0, (np.float64(1.0), torch.tensor(2))), expected)


# float32's largest value written with fewer digits, above it but rounding to it; and the
# midpoint between it and 2^128, the first value that rounds to infinity.
ROUNDS_TO_FLOAT32_MAX = 3.4028235e38
ROUNDS_TO_FLOAT32_INF = float.fromhex("0x1.ffffffp127")


def test_scale_and_p_are_rounded_to_float32_as_the_kernels_round_them():
    g = torch.ones(2, 3)
    direct = torch.ops.cockpit_fast
    for module in (ops, reference):
        assert module.batch_l2(g, ROUNDS_TO_FLOAT32_MAX)[0] == math.inf  # squares overflow; accepted
        module.per_sample_stats(g, 1.0, [ROUNDS_TO_FLOAT32_MAX])
    direct.batch_l2(g, ROUNDS_TO_FLOAT32_MAX)
    direct.per_sample_stats(g, 1.0, [ROUNDS_TO_FLOAT32_MAX])
    assert_rejects("batch_l2", lambda m: m.batch_l2(g, ROUNDS_TO_FLOAT32_INF), "scale must be finite in float32")
    assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [ROUNDS_TO_FLOAT32_INF]), "finite and > 0 in float32")
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        direct.batch_l2(g, ROUNDS_TO_FLOAT32_INF)
    with pytest.raises(ValueError, match="finite and > 0 in float32"):
        direct.per_sample_stats(g, 1.0, [ROUNDS_TO_FLOAT32_INF])


def test_the_compiled_checks_use_the_limits_written_in_python():
    """cockpit_fast/_limits.py is compiled into the C++ checks: calls that bypass the wrappers
    meet the same limits."""
    direct, g = torch.ops.cockpit_fast, torch.ones(2, 3)
    assert direct.per_sample_stats(g, 1.0, [1.0] * _limits.MAX_P_VALUES).shape == (2, 5 + _limits.MAX_P_VALUES)
    with pytest.raises(ValueError, match=f"at most {_limits.MAX_P_VALUES} p values per call"):
        direct.per_sample_stats(g, 1.0, [1.0] * (_limits.MAX_P_VALUES + 1))
    assert direct.hist1d(torch.zeros(0, 1), _limits.MAX_BINS, -1.0, 1.0, 1.0).shape == (_limits.MAX_BINS,)
    with pytest.raises(ValueError, match=f"at most {_limits.MAX_BINS} histogram cells"):
        direct.hist1d(g, _limits.MAX_BINS + 1, -1.0, 1.0, 1.0)


def direct_calls_with_bad_values():
    """torch.ops calls with the schema's types but bad values: (call(g, param), message)."""
    return [
        (lambda g, p: torch.ops.cockpit_fast.batch_l2(g, math.inf), "scale must be finite"),
        (lambda g, p: torch.ops.cockpit_fast.hist1d(g, 0, -1.0, 1.0, 1.0), "bins must be a positive integer"),
        (lambda g, p: torch.ops.cockpit_fast.hist1d(g, 10, 1.0, -1.0, 1.0), "range needs lo < hi"),
        (lambda g, p: torch.ops.cockpit_fast.hist2d(g, p, 2**13, 2**12, -1.0, 1.0, -1.0, 1.0, 1.0), "at most 16777216 histogram cells"),
        (lambda g, p: torch.ops.cockpit_fast.batch_dot(g, p[:1], 1.0), "direction must have shape"),
        (lambda g, p: torch.ops.cockpit_fast.hist1d_batch_l2_batch_dots(g, p, 10, -1.0, 1.0, 1.0, 1.0), "directions must have shape"),
        (lambda g, p: torch.ops.cockpit_fast.hist1d_batch_l2_batch_dots(g, p[None], 10, -1.0, 1.0, math.inf, 1.0), "hist_scale must be finite"),
        (lambda g, p: torch.ops.cockpit_fast.factored_hist1d_batch_l2_batch_dots(g[:, None], g[:, None], p[None], 10, -1.0, 1.0, 1.0, 1.0), "directions must have shape"),
        (lambda g, p: torch.ops.cockpit_fast.factored_hist1d_batch_l2_batch_dots(g[:, None], g[:1, None], p[None, None], 10, -1.0, 1.0, 1.0, 1.0), r"same \(N, T\)"),
        (lambda g, p: torch.ops.cockpit_fast.per_sample_stats(g, 1.0, [-1.0]), "p values must be finite and > 0"),
        (lambda g, p: torch.ops.cockpit_fast.outer_hist1d(g, g[:1], 10, -1.0, 1.0, 1.0), "same number of samples"),
        (lambda g, p: torch.ops.cockpit_fast.outer_hist2d(g, g, p, 10, 10, -1.0, 1.0, -1.0, 1.0, 1.0), "param must have shape"),
    ]


def test_the_fake_kernels_reject_what_the_kernels_reject():
    g, param = torch.ones(3, 2), torch.ones(2)
    fake_mode = FakeTensorMode()
    fake_g, fake_param = fake_mode.from_tensor(g), fake_mode.from_tensor(param)
    for call, match in direct_calls_with_bad_values():
        with pytest.raises(ValueError, match=match):
            call(g, param)
        with fake_mode, pytest.raises(ValueError, match=match):
            call(fake_g, fake_param)


def test_results_never_require_grad():
    """The ops are statistics with no gradient: results are detached on every route, and the
    ops trace under torch.compile with inputs that require grad."""
    g = random_grad(3, (2,)).requires_grad_()
    param = random_param((2,)).requires_grad_()
    for module in (ops, reference):
        for name, call in every_op_with_scale(g, param, 2.0).items():
            for result in torch.utils._pytree.tree_leaves(call(module)):
                assert not result.requires_grad and result.grad_fn is None, (module.__name__, name)
    compiled = torch.compile(all_ops, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(g, param), all_ops(g, param)):
        assert not got.requires_grad and torch.equal(got, expected)
    torch.library.opcheck(torch.ops.cockpit_fast.batch_l2.default, (g, 2.0))
    torch.library.opcheck(torch.ops.cockpit_fast.hist2d.default, (g, param, 3, 4, -1.0, 1.0, -1.0, 1.0, 2.0))
    torch.library.opcheck(torch.ops.cockpit_fast.outer_hist2d.default, (g, g, param.expand(2, 2), 3, 4, -1.0, 1.0, -1.0, 1.0, 2.0))
    torch.library.opcheck(torch.ops.cockpit_fast.hist1d_batch_l2_batch_dots.default, (g, param[None], 10, -1.0, 1.0, 2.0, 2.0))
    torch.library.opcheck(torch.ops.cockpit_fast.factored_hist1d_batch_l2_batch_dots.default, (g[:, None], g[:, None], param.expand(2, 2)[None], 10, -1.0, 1.0, 2.0, 2.0))
