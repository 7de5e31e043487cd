"""hist1d_batch_l2_batch_dots: hist1d, batch_l2 and batch_dot against k directions from one pass."""

import pytest
import torch

from cockpit_fast import ops, reference
from conftest import (
    BATCH_SIZES,
    DEVICES,
    DTYPES,
    LAYOUTS,
    PARAM_SHAPES,
    assert_close_to_reference,
    assert_rejects,
    bad_grads,
    random_grad,
    random_param,
    requires_cuda,
    same_on_one_and_two_threads,
    values_near_edges,
)


def random_directions(k, param_shape, dtype=torch.float32, device="cpu", seed=1):
    """k directions (k, *param_shape), each a fresh random parameter."""
    if k == 0:
        return torch.empty((0, *param_shape), dtype=dtype, device=device)
    return torch.stack([random_param(param_shape, dtype, device, seed=seed + i) for i in range(k)])


def separate_ops(g, directions, bins, rng, hist_scale, scale):
    """What the fused op replaces: hist1d, batch_l2 and one batch_dot per direction."""
    l2 = ops.batch_l2(g, scale)
    dots = [ops.batch_dot(g, d, scale) for d in directions]
    return ops.hist1d(g, bins, rng, hist_scale), l2, torch.stack(dots, 1) if dots else l2.new_zeros(g.shape[0], 0)


def assert_dots_close_to_float64(dots, g, directions, scale, dtype):
    """Dot products cancel: the tolerance is relative to the sum of |products|, as in test_batch_dot."""
    expected = reference.hist1d_batch_l2_batch_dots(g.double(), directions.double(), scale=scale)[2]
    magnitude = reference.hist1d_batch_l2_batch_dots(g.double().abs(), directions.double().abs(), scale=scale)[2]
    tolerance = (1e-12 if dtype == torch.float64 else 1e-5) * magnitude
    assert ((dots.double() - expected).abs() <= tolerance + 1e-12).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_shape", PARAM_SHAPES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
# A span of 4.5 bins by division; a power-of-two span (4) by multiplying with its inverse.
@pytest.mark.parametrize("lo, hi", [(-2.0, 2.5), (-2.0, 2.0)], ids=["divided", "power_of_two"])
def test_matches_separate_ops_and_float64_reference(device, dtype, param_shape, n, layout, lo, hi):
    # As Cockpit calls it: values ~ 1 / N, binned at scale N (many clamped into the outer bins),
    # summed at another scale.
    g = random_grad(n, param_shape, dtype, device, layout, seed=n, spread=1.5 / n)
    directions = random_directions(2, param_shape, dtype, device)
    bins, hist_scale, scale = 31, float(n), 0.5 * n
    counts, l2, dots = ops.hist1d_batch_l2_batch_dots(g, directions, bins, (lo, hi), hist_scale, scale)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert counts.dtype == torch.int64 and counts.shape == (bins,)
    assert l2.dtype == acc and l2.shape == (n,) and dots.dtype == acc and dots.shape == (n, 2)

    separate_counts, separate_l2, separate_dots = separate_ops(g, directions, bins, (lo, hi), hist_scale, scale)
    # The histogram's arithmetic is hist1d's on every backend: identical counts.
    assert torch.equal(counts, separate_counts)
    if device == "cpu":  # the same tiles and lanes as batch_l2 and batch_dot: the same bits
        assert torch.equal(l2, separate_l2) and torch.equal(dots, separate_dots)

    # Against float64: every value counted, bins differ only for values at an edge's rounding.
    exact = reference.hist1d(g.double(), bins, (lo, hi), hist_scale)
    assert counts.sum() == g.numel()
    near = values_near_edges(hist_scale * g.double(), lo, hi, bins, tol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4)
    assert (counts - exact).abs().sum() <= 2 * near
    assert_close_to_reference(l2, reference.batch_l2(g.double(), scale), dtype)
    assert_dots_close_to_float64(dots, g, directions, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_any_number_of_directions(device, k):
    # Rows of 4099 values: three batch_dot tiles, the last one of 3 values (the lanes' tail).
    g = random_grad(9, (4099,), device=device, spread=0.5)
    directions = random_directions(k, (4099,), device=device)
    counts, l2, dots = ops.hist1d_batch_l2_batch_dots(g, directions, 40, (-1.0, 1.0), 3.0, 2.0)
    assert dots.shape == (9, k) and dots.dtype == torch.float32
    expected = separate_ops(g, directions, 40, (-1.0, 1.0), 3.0, 2.0)
    assert torch.equal(counts, expected[0])
    if device == "cpu":
        assert torch.equal(l2, expected[1]) and torch.equal(dots, expected[2])
    assert_close_to_reference(l2, reference.batch_l2(g.double(), 2.0), torch.float32)
    assert_dots_close_to_float64(dots, g, directions, 2.0, torch.float32)
    twin = reference.hist1d_batch_l2_batch_dots(g, directions, 40, (-1.0, 1.0), 3.0, 2.0)
    assert torch.equal(twin[0], counts) and twin[2].shape == (9, k)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_directions(device):
    g = random_grad(6, (33, 70), device=device)
    directions = random_directions(3, (70, 33), device=device).transpose(1, 2)
    assert not directions.is_contiguous()
    _, _, dots = ops.hist1d_batch_l2_batch_dots(g, directions, 10, (-1.0, 1.0), 1.0, 6.0)
    expected = torch.stack([ops.batch_dot(g, d, 6.0) for d in directions], 1)
    if device == "cpu":
        assert torch.equal(dots, expected)
    torch.testing.assert_close(dots, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lo, hi", [(-2.0, 2.5), (-2.0, 2.0)], ids=["divided", "power_of_two"])
def test_values_on_bin_edges(device, dtype, lo, hi):
    bins = 40
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    middles = (edges[1:] + edges[:-1]) / 2
    g = torch.cat([edges, middles, edges[5:9]]).reshape(5, 17).to(device)
    counts, _, _ = ops.hist1d_batch_l2_batch_dots(g, g[:1], bins, (lo, hi))
    assert torch.equal(counts, reference.hist1d(g, bins, (lo, hi)))
    assert counts[-1] >= 2  # hi itself lands in the closed last bin


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_values(device):
    # NaN is not counted and makes its sample's sums NaN; +-inf lands in the outer bins.
    g = random_grad(4, (50,), device=device, spread=0.1)
    g[0, :4] = float("nan")
    g[1, :3] = float("inf")
    g[2, :2] = -float("inf")
    directions = random_directions(2, (50,), device=device).abs()  # positive: inf * d does not cancel
    counts, l2, dots = ops.hist1d_batch_l2_batch_dots(g, directions, 10, (-1.0, 1.0))
    assert counts.sum() == g.numel() - 4 and counts[-1] >= 3 and counts[0] >= 2
    expected = separate_ops(g, directions, 10, (-1.0, 1.0), 1.0, 1.0)
    assert torch.equal(counts, expected[0])
    torch.testing.assert_close(l2, expected[1], equal_nan=True)
    torch.testing.assert_close(dots, expected[2], equal_nan=True)
    assert l2[0].isnan() and l2[1].isinf() and l2[2].isinf() and l2[3].isfinite()
    assert dots[0].isnan().all() and dots[1].isinf().all() and dots[3].isfinite().all()


# More samples than a CUDA grid has rows of blocks (65535): row groups must cover them all.
@pytest.mark.parametrize("device", DEVICES)
def test_more_samples_than_grid_rows(device):
    g, directions = random_grad(70001, (3,), device=device), random_directions(2, (3,), device=device)
    counts, l2, dots = ops.hist1d_batch_l2_batch_dots(g, directions, 50, (-2.0, 2.0))
    assert torch.equal(counts, ops.hist1d(g, 50, (-2.0, 2.0)))
    assert_close_to_reference(l2, reference.batch_l2(g.double()), torch.float32)
    assert_dots_close_to_float64(dots, g, directions, 1.0, torch.float32)


# Shared-memory histogram copies on CUDA (see test_hist1d.py), and more bins than the CPU's
# interleaved copies take.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bins", [6143, 12288, 20000])
def test_large_histograms(device, bins):
    g = random_grad(8, (3001,), device=device, spread=2.0)
    counts, _, _ = ops.hist1d_batch_l2_batch_dots(g, random_directions(1, (3001,), device=device), bins, (-3.0, 3.0))
    assert torch.equal(counts, reference.hist1d(g, bins, (-3.0, 3.0)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (0,)])
@pytest.mark.parametrize("k", [0, 2])
def test_empty_input(device, shape, k):
    g = torch.empty(shape, device=device)
    directions = torch.empty((k, *shape[1:]), device=device)
    for module in (ops, reference):
        counts, l2, dots = module.hist1d_batch_l2_batch_dots(g, directions, 12)
        assert torch.equal(counts, torch.zeros(12, dtype=torch.int64, device=device))
        assert torch.equal(l2, torch.zeros(shape[0], device=device))
        assert torch.equal(dots, torch.zeros(shape[0], k, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_applies_to_each_value_not_the_sums(device, dtype):
    # <scale * g, d> and |scale * g|^2: the unscaled products and squares overflow.
    g = torch.full((2, 3), 1e30, dtype=dtype, device=device)
    directions = torch.full((1, 3), 1e30, dtype=dtype, device=device)
    _, l2, dots = ops.hist1d_batch_l2_batch_dots(g, directions, 10, (-1.0, 1.0), 1.0, 1e-30)
    torch.testing.assert_close(l2.double().cpu(), torch.full((2,), 3.0, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(dots.double().cpu(), torch.full((2, 1), 3e30, dtype=torch.float64), rtol=1e-5, atol=0)


def test_same_result_on_any_thread_count():
    g, directions = random_grad(50, (9000,), spread=0.7), random_directions(2, (9000,))
    one, two = same_on_one_and_two_threads(lambda: ops.hist1d_batch_l2_batch_dots(g, directions, 77, (-1.0, 1.0), 3.0, 2.0))
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_rejects_bad_input():
    name = "hist1d_batch_l2_batch_dots"
    for g, message in bad_grads():
        assert_rejects(name, lambda m: m.hist1d_batch_l2_batch_dots(g, torch.ones(1, 4)), message)
    g = torch.ones(2, 3, 4)
    fused = lambda directions, *args: lambda m: m.hist1d_batch_l2_batch_dots(g, directions, *args)  # noqa: E731
    assert_rejects(name, fused(None), "directions must be a tensor, got NoneType")
    for directions in (torch.ones(3, 4), torch.ones(12), torch.ones(2, 4, 3), torch.ones(1, 1, 3, 4)):
        assert_rejects(name, fused(directions), r"directions must have shape \(k, \*g.shape\[1:\]\) = \(k, 3, 4\)")
    assert_rejects(name, fused(torch.ones(1, 3, 4, dtype=torch.float64)), "directions is torch.float64")
    directions = torch.ones(2, 3, 4)
    for bins in (0, -3, 2.0):
        assert_rejects(name, fused(directions, bins), "bins must be a positive integer")
    assert_rejects(name, fused(directions, 10, (1.0, 1.0)), "lo < hi")
    assert_rejects(name, fused(directions, 10, (0.0, float("nan"))), "must be finite")
    assert_rejects(name, fused(directions, 10, (-1e38, 1e38)), "overflows or rounds to nothing in float32")
    assert_rejects(name, fused(directions, 10, (-1.0, 1.0), float("inf")), "hist_scale must be finite in float32")
    for module in (ops, reference):  # scale itself, not hist_scale
        with pytest.raises(ValueError, match=f"cockpit_fast.{name}: scale must be finite in float32"):
            fused(directions, 10, (-1.0, 1.0), 1.0, float("nan"))(module)
    assert_rejects(name, fused(directions, 10, (-1.0, 1.0), "2"), "hist_scale must be a real number")


def test_direct_calls_check_their_arguments():
    """torch.ops calls bypass the wrappers: the C++ op repeats the checks."""
    op = torch.ops.cockpit_fast.hist1d_batch_l2_batch_dots
    g = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match=r"directions must have shape \(k, \*g.shape\[1:\]\) = \(k, 3, 4\)"):
        op(g, torch.ones(12), 10, -1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"= \(k,\), got"):
        op(torch.ones(2), torch.ones(2, 1), 10, -1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="directions is"):
        op(g, torch.ones(1, 3, 4, dtype=torch.float16), 10, -1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="hist_scale must be finite in float32"):
        op(g, torch.ones(1, 3, 4), 10, -1.0, 1.0, 1e39, 1.0)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        op(g, torch.ones(1, 3, 4), 10, -1.0, 1.0, 1.0, 1e39)
    with pytest.raises(ValueError, match="range needs lo < hi"):
        op(g, torch.ones(1, 3, 4), 10, 1.0, -1.0, 1.0, 1.0)


@requires_cuda
def test_rejects_tensors_on_different_devices():
    # Either order: with g on the CPU the dispatcher still picks the CUDA kernel.
    for g_device, directions_device in (("cuda", "cpu"), ("cpu", "cuda")):
        g, directions = torch.ones(2, 4, device=g_device), torch.ones(1, 4, device=directions_device)
        assert_rejects("hist1d_batch_l2_batch_dots", lambda m: m.hist1d_batch_l2_batch_dots(g, directions), "is on")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 2])
def test_opcheck(device, k):
    g, directions = random_grad(6, (5, 4), device=device), random_directions(k, (5, 4), device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.hist1d_batch_l2_batch_dots.default, (g, directions, 20, -1.0, 1.0, 6.0, 2.0))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g, directions = random_grad(128, (256, 78), dtype, spread=0.02), random_directions(2, (256, 78), dtype)
    cpu = ops.hist1d_batch_l2_batch_dots(g, directions, 100, (-2.0, 2.0), 128.0, 2.0)
    cuda = ops.hist1d_batch_l2_batch_dots(g.cuda(), directions.cuda(), 100, (-2.0, 2.0), 128.0, 2.0)
    assert torch.equal(cuda[0].cpu(), cpu[0])
    torch.testing.assert_close(cuda[1].cpu(), cpu[1], rtol=1e-5, atol=0)
    torch.testing.assert_close(cuda[2].cpu(), cpu[2], rtol=1e-4, atol=1e-4)
