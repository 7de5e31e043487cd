"""hist1d: clamped 1D histograms of scaled per-sample gradient values."""

import weakref

import pytest
import torch

from cockpit_fast import ops, reference
from conftest import (
    BATCH_SIZES,
    BINNABLE_IN_FLOAT32_ONLY_MESSAGE,
    DEVICES,
    DTYPES,
    FLOAT32_UNBINNABLE_RANGES,
    LAYOUTS,
    PARAM_SHAPES,
    assert_rejects,
    bad_grads,
    cockpit_module,
    random_grad,
    requires_cuda,
    same_on_one_and_two_threads,
    values_near_edges,
)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_shape", PARAM_SHAPES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
# A span of 4.5 bins by division; a power-of-two span (4) by multiplying with its inverse.
@pytest.mark.parametrize("lo, hi", [(-2.0, 2.5), (-2.0, 2.0)], ids=["divided", "power_of_two"])
def test_matches_reference(device, dtype, param_shape, n, layout, lo, hi):
    # Spread so that many values fall outside the range and are clamped into the outer bins.
    g = random_grad(n, param_shape, dtype, device, layout, seed=n, spread=1.5 / n)
    bins, scale = 31, float(n)
    counts = ops.hist1d(g, bins, (lo, hi), scale)
    assert counts.dtype == torch.int64 and counts.shape == (bins,)
    # Same arithmetic as the reference in the same precision: identical counts.
    assert torch.equal(counts, reference.hist1d(g, bins, (lo, hi), scale))
    # Against float64: every value counted, bins differ only for values at an edge's rounding.
    exact = reference.hist1d(g.double(), bins, (lo, hi), scale)
    assert counts.sum() == g.numel()
    near = values_near_edges(scale * g.double(), lo, hi, bins, tol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4)
    assert (counts - exact).abs().sum() <= 2 * near

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_counts_as_cockpit_grad_hist_1d(dtype):
    grad_hist = cockpit_module("cockpit.quantities.grad_hist")
    quantity = grad_hist.GradHist1d(track_schedule=lambda step: True, bins=60, range=(-1.5, 1.5))
    g = random_grad(32, (20, 30), dtype, spread=0.05)
    expected, _edges = quantity._compute_histogram(g)
    assert torch.equal(ops.hist1d(g, 60, (-1.5, 1.5), scale=32), expected.long())

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lo, hi", [(-2.0, 2.5), (-2.0, 2.0)], ids=["divided", "power_of_two"])
def test_values_on_bin_edges(device, dtype, lo, hi):
    bins = 40
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    middles = (edges[1:] + edges[:-1]) / 2
    g = torch.cat([edges, middles, edges[5:9]]).reshape(5, 17).to(device)
    counts = ops.hist1d(g, bins, (lo, hi))
    assert torch.equal(counts, reference.hist1d(g, bins, (lo, hi)))
    assert counts[-1] >= 2  # hi itself lands in the closed last bin

@pytest.mark.parametrize("device", DEVICES)
def test_nan_is_not_counted_and_infinities_are_clamped(device):
    g = random_grad(3, (50,), device=device, spread=0.1)
    g[0, :4] = float("nan")
    g[1, :3] = float("inf")
    g[2, :2] = -float("inf")
    counts = ops.hist1d(g, 10, (-1.0, 1.0))
    assert counts.sum() == g.numel() - 4
    assert counts[-1] >= 3 and counts[0] >= 2
    assert torch.equal(counts, reference.hist1d(g, 10, (-1.0, 1.0)))

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", [ops, reference], ids=["op", "reference"])
def test_counts_are_exact_past_float32(device, implementation):
    # float32 rounds 2^24 + 1 to 2^24: the counts are int64 from the kernel to the caller.
    g = torch.zeros(1, 2**24 + 1, device=device)
    counts = implementation.hist1d(g, 100, (-2.0, 2.0))
    assert counts.dtype == torch.int64 and counts[50] == 2**24 + 1 and counts.sum() == 2**24 + 1

@pytest.mark.parametrize("device", DEVICES)
def test_concentrated_and_large_histograms(device):
    # Every value in one bin; and more bins than fit in shared memory / the interleaved CPU copies.
    g = torch.full((64, 1000), 0.3, device=device)
    assert ops.hist1d(g, 100, (-1.0, 1.0))[65] == g.numel()
    spread = random_grad(16, (3000,), device=device)
    assert torch.equal(ops.hist1d(spread, 20000, (-3.0, 3.0)), reference.hist1d(spread, 20000, (-3.0, 3.0)))

# The CUDA kernels keep as many int32 copies of bins + 1 slots in 48 KiB of shared memory as fit:
# two copies up to 6143 bins, one up to 12287, none (global atomics) from 12288.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bins", [6143, 6144, 12287, 12288])
def test_shared_memory_boundaries(device, bins):
    g = random_grad(8, (3001,), device=device, spread=2.0)
    assert torch.equal(ops.hist1d(g, bins, (-3.0, 3.0)), reference.hist1d(g, bins, (-3.0, 3.0)))

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (0,)])
def test_empty_input(device, shape):
    g = torch.empty(shape, device=device)
    assert torch.equal(ops.hist1d(g, 12), torch.zeros(12, dtype=torch.int64, device=device))
    assert torch.equal(reference.hist1d(g, 12), torch.zeros(12, dtype=torch.int64, device=device))

def test_same_counts_on_any_thread_count():
    g = random_grad(100, (4000,), spread=0.7)
    one, two = same_on_one_and_two_threads(lambda: ops.hist1d(g, 77, (-1.0, 1.0)))
    assert torch.equal(one, two)

def test_rejects_bad_input():
    for g, message in bad_grads():
        assert_rejects("hist1d", lambda m: m.hist1d(g), message)
    g = torch.ones(2, 3)
    for bins in (0, -3):
        assert_rejects("hist1d", lambda m: m.hist1d(g, bins), "bins must be a positive integer")
    for rng in [(1.0, 1.0), (2.0, -2.0)]:
        assert_rejects("hist1d", lambda m: m.hist1d(g, 10, rng), "lo < hi")
    for rng in [(float("-inf"), 1.0), (0.0, float("nan"))]:
        assert_rejects("hist1d", lambda m: m.hist1d(g, 10, rng), "must be finite")
    assert_rejects("hist1d", lambda m: m.hist1d(g, 10, (-1.0, 1.0), float("nan")), "scale must be finite")
    for rng, _why in FLOAT32_UNBINNABLE_RANGES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert_rejects("hist1d", lambda m: m.hist1d(g.to(dtype), 100, rng), BINNABLE_IN_FLOAT32_ONLY_MESSAGE)
        # float64 computes the bins in double, where these ranges are fine.
        assert torch.equal(ops.hist1d(g.double(), 100, rng), reference.hist1d(g.double(), 100, rng))

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = random_grad(6, (5, 4), device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.hist1d.default, (g, 20, -1.0, 1.0, 6.0))

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g = random_grad(128, (256, 78), dtype, spread=0.02)
    assert torch.equal(ops.hist1d(g.cuda(), 100, (-2.0, 2.0), 128.0).cpu(), ops.hist1d(g, 100, (-2.0, 2.0), 128.0))
