"""hist2d: 2D histograms over (scaled per-sample gradient value, parameter value)."""

import weakref

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
    PARAM_SHAPES,
    assert_rejects,
    bad_grads,
    cockpit_module,
    random_grad,
    random_param,
    requires_cuda,
    same_on_one_and_two_threads,
    values_near_edges,
)

BINS, RANGE = (13, 17), ((-1.0, 1.5), (-2.0, 2.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_shape", PARAM_SHAPES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(device, dtype, param_shape, n, layout):
    g = random_grad(n, param_shape, dtype, device, layout, seed=n, spread=1.0 / n)
    param = random_param(param_shape, dtype, device)
    scale = float(n)
    counts = ops.hist2d(g, param, BINS, RANGE, scale)
    assert counts.dtype == torch.int64 and counts.shape == BINS
    assert torch.equal(counts, reference.hist2d(g, param, BINS, RANGE, scale))
    # Against float64: every pair counted; cells differ only for values at an edge's rounding.
    exact = reference.hist2d(g.double(), param.double(), BINS, RANGE, scale)
    assert counts.sum() == g.numel()
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    x_near = values_near_edges(scale * g.double(), *RANGE[0], BINS[0], tol)
    y_near = g.shape[0] * values_near_edges(param.double(), *RANGE[1], BINS[1], tol)
    assert (counts - exact).abs().sum() <= 2 * (x_near + y_near)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_counts_as_cockpit_grad_hist_2d(dtype):
    grad_hist = cockpit_module("cockpit.quantities.grad_hist")
    quantity = grad_hist.GradHist2d(track_schedule=lambda step: True, bins=(40, 50), range=((-1, 1), (-2, 2)))
    g = random_grad(32, (20, 30), dtype, spread=0.02)
    param = torch.nn.Parameter(random_param((20, 30), dtype))
    g._param_weakref = weakref.ref(param)  # what BackPACK attaches to grad_batch
    expected, _edges = quantity._compute_histogram(g)
    assert torch.equal(ops.hist2d(g, param.data, (40, 50), ((-1, 1), (-2, 2)), scale=32), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_values_on_bin_edges_and_outside(device):
    bins, rng = (10, 8), ((-1.0, 1.0), (-2.0, 2.0))
    x_edges = torch.linspace(-1.0, 1.0, 11)
    g = torch.stack([x_edges, x_edges.flip(0), 3 * x_edges]).reshape(3, 11).to(device)
    param = torch.linspace(-3.0, 3.0, 11).to(device)
    counts = ops.hist2d(g, param, bins, rng)
    assert torch.equal(counts, reference.hist2d(g, param, bins, rng))
    assert counts.sum() == g.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_either_coordinate_is_not_counted(device):
    g = random_grad(4, (30,), device=device, spread=0.3)
    param = random_param((30,), device=device)
    g[0, 2] = float("nan")
    param[7] = float("nan")  # drops column 7 for all 4 samples
    g[1, 9] = float("inf")
    counts = ops.hist2d(g, param, BINS, RANGE)
    assert counts.sum() == g.numel() - 1 - 4
    assert torch.equal(counts, reference.hist2d(g, param, BINS, RANGE))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", [ops, reference], ids=["op", "reference"])
def test_counts_are_exact_past_float32(device, implementation):
    # 4097^2 = 2^24 + 8193 pairs in one cell, a count float32 would round to an even one.
    g, param = torch.zeros(4097, 4097, device=device), torch.zeros(4097, device=device)
    counts = implementation.hist2d(g, param, (40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
    assert counts.dtype == torch.int64 and counts.max() == 4097**2 and counts.sum() == 4097**2


@pytest.mark.parametrize("device", DEVICES)
def test_concentrated_and_large_histograms(device):
    g = torch.full((50, 400), 0.01, device=device)
    param = torch.full((400,), -0.5, device=device)
    counts = ops.hist2d(g, param, (40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
    assert counts.max() == g.numel() == counts.sum()
    spread_g, spread_p = random_grad(8, (700,), device=device), random_param((700,), device=device)
    big = ((150, 120), ((-3.0, 3.0), (-3.0, 3.0)))  # 18000 cells: beyond shared memory on CUDA
    assert torch.equal(ops.hist2d(spread_g, spread_p, *big), reference.hist2d(spread_g, spread_p, *big))
    # More samples than a CUDA grid has rows of blocks (65535).
    many_g = random_grad(70001, (3,), device=device)
    many_p = random_param((3,), device=device)
    assert torch.equal(ops.hist2d(many_g, many_p), reference.hist2d(many_g, many_p))
    # On CUDA, cells + 1 int32 slots fill 48 KiB of shared memory once at 12287 cells.
    for bins in [(127, 96), (12287, 1), (96, 128)]:
        rng = ((-3.0, 3.0), (-3.0, 3.0))
        assert torch.equal(ops.hist2d(spread_g, spread_p, bins, rng), reference.hist2d(spread_g, spread_p, bins, rng))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0)])
def test_empty_input(device, shape):
    g, param = torch.empty(shape, device=device), torch.empty(shape[1:], device=device)
    assert torch.equal(ops.hist2d(g, param, (3, 4)), torch.zeros(3, 4, dtype=torch.int64, device=device))
    assert torch.equal(reference.hist2d(g, param, (3, 4)), torch.zeros(3, 4, dtype=torch.int64, device=device))


def test_same_counts_on_any_thread_count():
    g, param = random_grad(100, (40, 90), spread=0.5), random_param((40, 90))
    one, two = same_on_one_and_two_threads(lambda: ops.hist2d(g, param))
    assert torch.equal(one, two)


def test_rejects_bad_input():
    param = torch.ones(4)
    for g, message in bad_grads():
        assert_rejects("hist2d", lambda m: m.hist2d(g, param), message)
    g = torch.ones(2, 4)
    assert_rejects("hist2d", lambda m: m.hist2d(g, torch.ones(5)), r"param must have shape g.shape\[1:\]")
    assert_rejects("hist2d", lambda m: m.hist2d(g, torch.ones(2, 4)), "param must have shape")
    assert_rejects("hist2d", lambda m: m.hist2d(g, param.double()), "param is torch.float64|param is Double")
    for bins, axis in [((0, 5), "x "), ((5, -1), "y ")]:
        assert_rejects("hist2d", lambda m: m.hist2d(g, param, bins), f"{axis}bins must be a positive integer")
    assert_rejects("hist2d", lambda m: m.hist2d(g, param, (3, 3), ((1.0, 0.0), (0.0, 1.0))), "x range needs lo < hi")
    assert_rejects("hist2d", lambda m: m.hist2d(g, param, (3, 3), ((0.0, 1.0), (0.0, float("inf")))), "y range bounds must be finite")
    for rng, _why in FLOAT32_UNBINNABLE_RANGES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            gd, pd = g.to(dtype), param.to(dtype)
            assert_rejects("hist2d", lambda m: m.hist2d(gd, pd, (40, 50), (rng, (-2.0, 2.0))), "x range .*" + BINNABLE_IN_FLOAT32_ONLY_MESSAGE)
            assert_rejects("hist2d", lambda m: m.hist2d(gd, pd, (40, 50), ((-1.0, 1.0), rng)), "y range .*" + BINNABLE_IN_FLOAT32_ONLY_MESSAGE)
        gd, pd = g.double(), param.double()
        assert torch.equal(ops.hist2d(gd, pd, (40, 50), (rng, rng)), reference.hist2d(gd, pd, (40, 50), (rng, rng)))


@requires_cuda
def test_rejects_tensors_on_different_devices():
    # Either order: with g on the CPU the dispatcher still picks the CUDA kernel.
    for g_device, param_device in (("cuda", "cpu"), ("cpu", "cuda")):
        g, param = torch.ones(2, 4, device=g_device), torch.ones(4, device=param_device)
        assert_rejects("hist2d", lambda m: m.hist2d(g, param), "is on")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g, param = random_grad(6, (5, 4), device=device), random_param((5, 4), device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.hist2d.default, (g, param, 7, 9, -1.0, 1.0, -2.0, 2.0, 6.0))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g, param = random_grad(128, (256, 78), dtype, spread=0.01), random_param((256, 78), dtype)
    expected = ops.hist2d(g, param, scale=128.0)
    assert torch.equal(ops.hist2d(g.cuda(), param.cuda(), scale=128.0).cpu(), expected)
