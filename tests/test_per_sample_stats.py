"""per_sample_stats: one fused pass giving max, min, mean, M2, max|x| and sum |x|^p per sample."""

import math

import pytest
import torch

from cockpit_fast import ops, reference, stats
from conftest import (
    BATCH_SIZES,
    DEVICES,
    DTYPES,
    LAYOUTS,
    PARAM_SHAPES,
    assert_rejects,
    bad_grads,
    random_grad,
    requires_cuda,
    same_on_one_and_two_threads,
)

P_VALUES = [1.0, 2.0, 3.5, 0.5]


def assert_stats_close(actual, expected, dtype):
    """Everything to the accumulation's rounding (the scaling rounds the extremes too)."""
    assert actual.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    actual, expected = actual.double(), expected.double()
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    for column in (stats.MAX, stats.MIN, stats.MAX_ABS):
        torch.testing.assert_close(actual[:, column], expected[:, column], rtol=rtol, atol=0)
    torch.testing.assert_close(actual[:, stats.M2], expected[:, stats.M2], rtol=rtol, atol=1e-9)
    torch.testing.assert_close(actual[:, stats.P0:], expected[:, stats.P0:], rtol=rtol, atol=1e-9)
    # The mean cancels: bound its error by the mean of |x| (column P0 is sum |x|, p = 1).
    mean_abs = expected[:, stats.P0] / max(1, expected.shape[1])
    assert ((actual[:, stats.MEAN] - expected[:, stats.MEAN]).abs() <= rtol * mean_abs + 1e-12).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_shape", PARAM_SHAPES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_reference(device, dtype, param_shape, n, layout):
    g = random_grad(n, param_shape, dtype, device, layout, seed=n)
    result = ops.per_sample_stats(g, float(n), P_VALUES)
    assert result.shape == (n, stats.P0 + len(P_VALUES))
    assert_stats_close(result, reference.per_sample_stats(g.double(), float(n), P_VALUES), dtype)
    # Extremes involve no sums: the same precision's reference gives them exactly.
    same_precision = reference.per_sample_stats(g, float(n), P_VALUES)
    extremes = [stats.MAX, stats.MIN, stats.MAX_ABS]
    assert torch.equal(result[:, extremes], same_precision[:, extremes])


@pytest.mark.parametrize("device", DEVICES)
def test_second_moment_is_accurate_far_from_zero(device):
    # A large common offset: sum-of-squares formulas lose every digit here, Welford/Chan does not.
    g = (1e4 + random_grad(3, (20000,), torch.float64, device)).float()
    m2 = ops.per_sample_stats(g)[:, stats.M2].double()
    expected = reference.per_sample_stats(g.double())[:, stats.M2]
    torch.testing.assert_close(m2, expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_merging_parameters_equals_one_concatenated_parameter(device):
    parts = [random_grad(6, shape, torch.float64, device, seed=i) for i, shape in enumerate([(30, 7), (5,), (0,), (5000,)])]
    merged, count = stats.merge([(ops.per_sample_stats(p, 2.0, [1.0, 3.0]), p[0].numel()) for p in parts])
    whole = torch.cat([p.flatten(1) for p in parts], dim=1)
    assert count == whole.shape[1]
    torch.testing.assert_close(merged, reference.per_sample_stats(whole, 2.0, [1.0, 3.0]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_report_the_identity_of_every_merge(device):
    result = ops.per_sample_stats(torch.empty(3, 0, device=device), 1.0, [2.0])
    identity = torch.tensor([-math.inf, math.inf, 0.0, 0.0, 0.0, 0.0], device=device)
    assert torch.equal(result, identity.expand(3, -1))
    assert torch.equal(reference.per_sample_stats(torch.empty(3, 0, device=device), 1.0, [2.0]), result)
    assert ops.per_sample_stats(torch.empty(0, 4, device=device), 1.0, [2.0]).shape == (0, 6)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates_to_every_column(device):
    g = random_grad(2, (5000,), device=device)
    g[1, 4500] = float("nan")
    result = ops.per_sample_stats(g, 1.0, [1.0])
    assert result[1].isnan().all() and result[0].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_infinite_values_give_the_reference_statistics(device, dtype):
    # Rows long enough to be summarised in pieces (CPU chunks, CUDA threads) and merged, with the
    # infinities in different pieces: a merge must not turn an infinite mean into NaN.
    g = random_grad(5, (9000,), dtype, device)
    g[0, 7] = math.inf
    g[1, 7], g[1, 8500] = math.inf, math.inf
    g[2, 7], g[2, 8500] = math.inf, -math.inf
    g[3, 8999] = -math.inf
    result = ops.per_sample_stats(g, 2.0, [1.0, 2.0])
    expected = reference.per_sample_stats(g.double(), 2.0, [1.0, 2.0])
    torch.testing.assert_close(result.double(), expected, rtol=2e-5, atol=1e-9, equal_nan=True)
    mean = result[:, stats.MEAN].tolist()
    assert mean[0] == mean[1] == math.inf and math.isnan(mean[2]) and mean[3] == -math.inf
    assert result[4].isfinite().all()


def test_merging_keeps_an_infinite_mean():
    finite = random_grad(3, (40,), torch.float64)
    infinite = random_grad(3, (60,), torch.float64)
    infinite[0, 5], infinite[1, 5], infinite[1, 6] = math.inf, math.inf, -math.inf
    parts = [(ops.per_sample_stats(finite), 40), (ops.per_sample_stats(infinite), 60)]
    whole = reference.per_sample_stats(torch.cat([finite, infinite], dim=1))
    for order in (parts, parts[::-1]):  # the infinite mean first is the case Chan's update breaks
        merged, _ = stats.merge(order)
        torch.testing.assert_close(merged, whole, rtol=1e-12, atol=1e-12, equal_nan=True)
        assert merged[0, stats.MEAN] == math.inf and merged[1, stats.MEAN].isnan()


def test_same_result_on_any_thread_count():
    g = random_grad(40, (9000,))
    one, two = same_on_one_and_two_threads(lambda: ops.per_sample_stats(g, 1.0, P_VALUES))
    assert torch.equal(one, two)


def test_rejects_bad_input():
    for g, message in bad_grads():
        assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g), message)
    g = torch.ones(2, 3)
    for p in (0.0, -1.0, float("inf"), float("nan")):
        assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [p]), "p values must be finite and > 0")
    assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [1.0] * 9), "at most 8 p values")
    assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, float("inf")), "scale must be finite")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = random_grad(6, (5, 4), device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.per_sample_stats.default, (g, 6.0, [1.0, 2.5]))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g = random_grad(64, (256, 33), dtype)
    cpu = ops.per_sample_stats(g, 64.0, P_VALUES)
    torch.testing.assert_close(ops.per_sample_stats(g.cuda(), 64.0, P_VALUES).cpu(), cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_of_values_near_the_top_of_the_range(device, dtype):
    # Finite values of both signs whose differences overflow: the mean is finite all the same.
    big = torch.finfo(dtype).max / 1.2
    short = torch.tensor([[big, -big, 0.0], [-big / 3, big * 2 / 3, big * 2 / 3]], dtype=dtype)
    long = torch.cat([torch.full((2, 5000), big, dtype=dtype), torch.full((2, 5000), -big, dtype=dtype)], dim=1)
    for g in (short, long):
        mean = ops.per_sample_stats(g.to(device))[:, stats.MEAN].double().cpu()
        expected = (g.double() / g.shape[1]).sum(1)  # a sum that cannot overflow
        torch.testing.assert_close(mean, expected, rtol=1e-5, atol=big * 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_an_overflowing_sum_beside_an_infinity_keeps_the_mean(device, dtype):
    # Finite values whose sum overflows, next to a true infinity: the mean is that infinity (NaN
    # with both signs), not the NaN of inf - inf. Short rows, rows long enough to be merged from
    # pieces, and the rows split into two parameters merged by stats.merge.
    big = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max / 1.2
    short = torch.tensor(
        [[-big, big, -math.inf], [big, big, -math.inf], [-big, -big, math.inf], [big, -math.inf, math.inf], [big, big, -big]],
        dtype=torch.float64,
    ).to(dtype)
    for g in (short, short.repeat(1, 3000)):
        expected = (g.double() / g.shape[1]).sum(1)  # partial sums that cannot overflow in float64
        assert expected[:3].tolist() == [-math.inf, -math.inf, math.inf] and expected[3].isnan()
        for result in (ops.per_sample_stats(g.to(device)), reference.per_sample_stats(g.double())):
            torch.testing.assert_close(result[:, stats.MEAN].double().cpu(), expected, rtol=1e-5, atol=0, equal_nan=True)
    parts = [(ops.per_sample_stats(short[:, :2].to(device)), 2), (ops.per_sample_stats(short[:, 2:].to(device)), 1)]
    merged, _ = stats.merge(parts)
    torch.testing.assert_close(merged[:, stats.MEAN].double().cpu(), (short.double() / 3).sum(1), rtol=1e-5, atol=0, equal_nan=True)


def test_merging_an_empty_part_is_the_identity():
    empty, full = ops.per_sample_stats(torch.zeros(2, 0)), ops.per_sample_stats(torch.full((2, 3), 1e20))
    for parts in ([(empty, 0), (full, 3)], [(full, 3), (empty, 0)]):
        merged, count = stats.merge(parts)
        assert count == 3 and torch.equal(merged, full)


def test_p_values_are_checked_in_the_precision_of_the_powers():
    g = torch.tensor([[0.0, 1e-39, 1.0]])
    assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [1e-50]), "finite and > 0 in float32")
    assert_rejects("per_sample_stats", lambda m: m.per_sample_stats(g, 1.0, [1e39]), "finite and > 0 in float32")
    # In float64 the same p is a valid (if extreme) exponent: 0^p = 0, every other value ^p = 1.
    result = ops.per_sample_stats(g.double(), 1.0, [1e-50])
    assert result[0, stats.P0] == 2.0
