"""factored_hist1d_batch_l2_batch_dots: hist1d_batch_l2_batch_dots of G[n] = left[n]^T right[n],
never formed, against the float64 reference of the formed chunk."""

import pytest
import torch

from cockpit_fast import ops, reference
from conftest import (
    DEVICES,
    DTYPES,
    LAYOUTS,
    assert_rejects,
    random_grad,
    random_param,
    requires_cuda,
    same_on_one_and_two_threads,
    values_near_edges,
)

NAME = "factored_hist1d_batch_l2_batch_dots"
# (N, T, p, q): a Linear layer's factors; T = 1 (one position); p * q past the CPU kernel's
# 256 KiB scratch (several row blocks of p, the last one short); a single row of q past the
# scratch; many samples of tiny gradients; rows that end inside a tile's lanes.
FACTOR_SHAPES = [(5, 7, 37, 61), (3, 1, 13, 17), (2, 3, 300, 700), (2, 2, 3, 70001), (70, 2, 4, 5), (4, 5, 1, 4099)]
# Where a count may differ from the float64 histogram of the exact G: values within this many bin
# widths of an edge (the GEMM rounds G in the input dtype, as the formed chunk is rounded).
EDGE_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 2e-1}
# Sums against float64, relative: the rounding of G itself in the input dtype dominates.
SUM_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def random_factors(n, t, p, q, dtype=torch.float32, device="cpu", layout="contiguous", seed=0):
    """left (N, T, p), right (N, T, q) with G ~ 1.5 / N, as a mean-reduced loss makes it."""
    left = random_grad(n, (t, p), dtype, device, layout, seed=seed, spread=1.5 / (max(n, 1) * t**0.5))
    right = random_grad(n, (t, q), dtype, device, layout, seed=seed + 1)
    return left, right


def random_directions(k, p, q, dtype=torch.float32, device="cpu", seed=7):
    if k == 0:
        return torch.empty((0, p, q), dtype=dtype, device=device)
    return torch.stack([random_param((p, q), dtype, device, seed=seed + i) for i in range(k)])


def formed(left, right):
    """The chunk of per-sample gradients, exact in float64: (N, p, q)."""
    return torch.bmm(left.double().transpose(1, 2), right.double())


def assert_matches_float64(result, left, right, directions, bins, rng, hist_scale, scale, dtype):
    counts, l2, dots = result
    n, k = left.shape[0], directions.shape[0]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert counts.dtype == torch.int64 and counts.shape == (bins,)
    assert l2.dtype == acc and l2.shape == (n,) and dots.dtype == acc and dots.shape == (n, k)
    g = formed(left.cpu(), right.cpu())
    counts, l2, dots = counts.cpu(), l2.cpu(), dots.cpu()
    exact = reference.hist1d(g, bins, rng, hist_scale)
    assert counts.sum() == g.numel()
    near = values_near_edges(hist_scale * g, *rng, bins, tol=EDGE_TOL[dtype])
    assert (counts - exact).abs().sum() <= 2 * near, ((counts - exact).abs().sum(), near)
    x = scale * g.flatten(1)
    torch.testing.assert_close(l2.double(), (x**2).sum(1), rtol=SUM_RTOL[dtype], atol=1e-12)
    d = directions.cpu().double().reshape(k, x.shape[1])
    magnitude = torch.einsum("nd,kd->nk", x.abs(), d.abs())
    assert ((dots.double() - torch.einsum("nd,kd->nk", x, d)).abs() <= SUM_RTOL[dtype] * magnitude + 1e-12).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FACTOR_SHAPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lo, hi", [(-2.0, 2.5), (-2.0, 2.0)], ids=["divided", "power_of_two"])
def test_matches_float64_reference(device, dtype, shape, layout, lo, hi):
    n, t, p, q = shape
    left, right = random_factors(n, t, p, q, dtype, device, layout, seed=n)
    directions = random_directions(2, p, q, dtype, device)
    bins, hist_scale, scale = 31, float(n), 0.5 * n
    result = ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, bins, (lo, hi), hist_scale, scale)
    assert_matches_float64(result, left, right, directions, bins, (lo, hi), hist_scale, scale, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_any_number_of_directions(device, k):
    left, right = random_factors(3, 4, 150, 700, device=device)  # two row blocks of p
    directions = random_directions(k, 150, 700, device=device)
    result = ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, 40, (-1.0, 1.0), 3.0, 2.0)
    assert_matches_float64(result, left, right, directions, 40, (-1.0, 1.0), 3.0, 2.0, torch.float32)
    # The formed route, as the reference twin and CUDA run it: counts equal but at an edge.
    twin = reference.factored_hist1d_batch_l2_batch_dots(left, right, directions, 40, (-1.0, 1.0), 3.0, 2.0)
    near = values_near_edges(3.0 * formed(left.cpu(), right.cpu()), -1.0, 1.0, 40, tol=1e-4)
    assert (twin[0].cpu() - result[0].cpu()).abs().sum() <= 2 * near
    torch.testing.assert_close(twin[1], result[1], rtol=1e-5, atol=0)
    assert twin[2].shape == (3, k)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    # Factors stored (N, p, T) and (N, q, T) as autograd may hand them over, directions transposed.
    left = random_grad(6, (33, 5), device=device, spread=0.1).transpose(1, 2)
    right = random_grad(6, (70, 5), device=device, seed=3).transpose(1, 2)
    directions = random_directions(3, 70, 33, device=device).transpose(1, 2)
    assert not (left.is_contiguous() or right.is_contiguous() or directions.is_contiguous())
    result = ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, 10, (-1.0, 1.0), 6.0, 6.0)
    assert_matches_float64(result, left, right, directions, 10, (-1.0, 1.0), 6.0, 6.0, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 3, 4, 5), (3, 0, 4, 5), (3, 2, 0, 5), (3, 2, 4, 0)])
@pytest.mark.parametrize("k", [0, 2])
def test_empty_input(device, shape, k):
    # No samples, no positions (G = 0: every value in the bin of 0), no rows, no columns.
    n, t, p, q = shape
    left, right = torch.zeros(n, t, p, device=device), torch.zeros(n, t, q, device=device)
    directions = torch.ones(k, p, q, device=device)
    expected = torch.zeros(12, dtype=torch.int64)
    expected[6] = n * p * q
    for module in (ops, reference):
        counts, l2, dots = module.factored_hist1d_batch_l2_batch_dots(left, right, directions, 12)
        assert torch.equal(counts.cpu(), expected)
        assert torch.equal(l2.cpu(), torch.zeros(n)) and torch.equal(dots.cpu(), torch.zeros(n, k))


def test_nan_is_not_counted_and_spoils_its_sample():
    left, right = random_factors(3, 2, 5, 6)
    left[1, 0, 2] = float("nan")  # row 2 of G[1] is NaN
    counts, l2, dots = ops.factored_hist1d_batch_l2_batch_dots(left, right, random_directions(2, 5, 6), 10)
    assert counts.sum() == 3 * 30 - 6
    assert l2[1].isnan() and dots[1].isnan().all() and l2[[0, 2]].isfinite().all() and dots[[0, 2]].isfinite().all()


def test_same_result_on_any_thread_count():
    left, right = random_factors(9, 3, 200, 800)
    directions = random_directions(3, 200, 800)
    one, two = same_on_one_and_two_threads(
        lambda: ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, 77, (-1.0, 1.0), 9.0, 2.0)
    )
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_inputs_that_require_grad():
    left, right = random_factors(2, 3, 4, 5)
    left.requires_grad_()
    result = ops.factored_hist1d_batch_l2_batch_dots(left, right, random_directions(1, 4, 5), 10)
    assert not any(r.requires_grad for r in result)


def test_rejects_bad_input():
    left, right, directions = torch.ones(2, 3, 4), torch.ones(2, 3, 5), torch.ones(1, 4, 5)
    call = lambda *args: lambda m: m.factored_hist1d_batch_l2_batch_dots(*args)  # noqa: E731
    assert_rejects(NAME, call(None, right, directions), "left must be a tensor, got NoneType")
    assert_rejects(NAME, call(left[0], right, directions), r"left must be a 3-d \(N, T, features\) tensor")
    assert_rejects(NAME, call(left, right.long(), directions), "right must be float16, bfloat16, float32 or float64")
    assert_rejects(NAME, call(left, right.double(), directions), "left is torch.float32 but right is torch.float64")
    assert_rejects(NAME, call(left, right[:, :2], directions), r"must have the same \(N, T\)")
    assert_rejects(NAME, call(left, right, None), "directions must be a tensor")
    assert_rejects(NAME, call(left, right, directions.double()), "but directions is torch.float64")
    for bad in (torch.ones(4, 5), torch.ones(1, 5, 4), torch.ones(1, 20)):
        assert_rejects(NAME, call(left, right, bad), r"directions must have shape \(k, left.shape\[2\], right.shape\[2\]\) = \(k, 4, 5\)")
    assert_rejects(NAME, call(left, right, directions, 0), "bins must be a positive integer")
    assert_rejects(NAME, call(left, right, directions, 10, (1.0, 1.0)), "lo < hi")
    assert_rejects(NAME, call(left, right, directions, 10, (-1.0, 1.0), float("inf")), "hist_scale must be finite in float32")
    assert_rejects(NAME, call(left, right, directions, 10, (-1.0, 1.0), 1.0, 1e39), "scale must be finite in float32")


def test_direct_calls_check_their_arguments():
    op = torch.ops.cockpit_fast.factored_hist1d_batch_l2_batch_dots
    left, right = torch.ones(2, 3, 4), torch.ones(2, 3, 5)
    with pytest.raises(ValueError, match=r"directions must have shape \(k, left.shape\[2\], right.shape\[2\]\) = \(k, 4, 5\)"):
        op(left, right, torch.ones(1, 5, 4), 10, -1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"must have the same \(N, T\)"):
        op(left, right[:1], torch.ones(1, 4, 5), 10, -1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="hist_scale must be finite in float32"):
        op(left, right, torch.ones(1, 4, 5), 10, -1.0, 1.0, 1e39, 1.0)
    with pytest.raises(ValueError, match="range needs lo < hi"):
        op(left, right, torch.ones(1, 4, 5), 10, 1.0, -1.0, 1.0, 1.0)


@pytest.mark.parametrize("k", [0, 2])
def test_opcheck(k):
    left, right = random_factors(6, 3, 5, 4)
    torch.library.opcheck(
        torch.ops.cockpit_fast.factored_hist1d_batch_l2_batch_dots.default,
        (left, right, random_directions(k, 5, 4), 20, -1.0, 1.0, 6.0, 2.0),
    )


@requires_cuda
def test_cuda_forms_the_chunk_and_matches_cpu():
    left, right = random_factors(32, 8, 128, 96)
    directions = random_directions(2, 128, 96)
    cpu = ops.factored_hist1d_batch_l2_batch_dots(left, right, directions, 100, (-2.0, 2.0), 32.0, 2.0)
    cuda = ops.factored_hist1d_batch_l2_batch_dots(left.cuda(), right.cuda(), directions.cuda(), 100, (-2.0, 2.0), 32.0, 2.0)
    near = values_near_edges(32.0 * formed(left, right), -2.0, 2.0, 100, tol=1e-4)
    assert (cuda[0].cpu() - cpu[0]).abs().sum() <= 2 * near
    torch.testing.assert_close(cuda[1].cpu(), cpu[1], rtol=1e-4, atol=0)
    torch.testing.assert_close(cuda[2].cpu(), cpu[2], rtol=1e-3, atol=1e-4)
