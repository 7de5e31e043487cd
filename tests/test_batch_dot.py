"""batch_dot: scaled dot products of every per-sample gradient with one direction."""

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
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_shape", PARAM_SHAPES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_reference(device, dtype, param_shape, n, layout):
    g = random_grad(n, param_shape, dtype, device, layout, seed=n)
    direction = random_param(param_shape, dtype, device)
    dots = ops.batch_dot(g, direction, float(n))
    assert dots.shape == (n,)
    # Dot products cancel: compare with a tolerance relative to the sum of |products|.
    expected = reference.batch_dot(g.double(), direction.double(), float(n))
    magnitude = reference.batch_dot(g.double().abs(), direction.double().abs(), float(n))
    assert dots.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tolerance = (1e-12 if dtype == torch.float64 else 1e-5) * magnitude
    assert ((dots.double() - expected).abs() <= tolerance + 1e-12).all()


# More samples than a CUDA grid has rows of blocks (65535): row groups must cover them all.
@pytest.mark.parametrize("device", DEVICES)
def test_more_samples_than_grid_rows(device):
    g, direction = random_grad(70001, (3,), device=device), random_param((3,), device=device)
    expected = reference.batch_dot(g.double(), direction.double())
    magnitude = reference.batch_dot(g.double().abs(), direction.double().abs())
    assert ((ops.batch_dot(g, direction).double() - expected).abs() <= 1e-5 * magnitude + 1e-12).all()


@pytest.mark.parametrize("device", DEVICES)
def test_dot_with_itself_is_the_squared_norm(device):
    g = random_grad(1, (123, 9), device=device)
    assert_close_to_reference(ops.batch_dot(g, g[0], 2.0), 0.5 * ops.batch_l2(g, 2.0).double(), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0)])
def test_empty_input(device, shape):
    g, direction = torch.empty(shape, device=device), torch.empty(shape[1:], device=device)
    assert torch.equal(ops.batch_dot(g, direction), torch.zeros(shape[0], device=device))
    assert torch.equal(reference.batch_dot(g, direction), torch.zeros(shape[0], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_values_propagate(device):
    g, direction = random_grad(3, (40,), device=device), random_param((40,), device=device)
    g[0, 1], g[2, 3] = float("nan"), float("inf")
    dots = ops.batch_dot(g, direction)
    assert dots[0].isnan() and dots[2].isinf() and dots[1].isfinite()


def test_same_result_on_any_thread_count():
    g, direction = random_grad(50, (9000,)), random_param((9000,))
    one, two = same_on_one_and_two_threads(lambda: ops.batch_dot(g, direction, 3.0))
    assert torch.equal(one, two)


def test_rejects_bad_input():
    for g, message in bad_grads():
        assert_rejects("batch_dot", lambda m: m.batch_dot(g, torch.ones(4)), message)
    g = torch.ones(2, 3, 4)
    assert_rejects("batch_dot", lambda m: m.batch_dot(g, torch.ones(12)), "direction must have shape")
    assert_rejects("batch_dot", lambda m: m.batch_dot(g, torch.ones(3, 4, dtype=torch.float16)), "direction is")
    assert_rejects("batch_dot", lambda m: m.batch_dot(g, torch.ones(3, 4), float("inf")), "scale must be finite")


@requires_cuda
def test_rejects_tensors_on_different_devices():
    # Either order: with g on the CPU the dispatcher still picks the CUDA kernel.
    for g_device, direction_device in (("cuda", "cpu"), ("cpu", "cuda")):
        g, direction = torch.ones(2, 4, device=g_device), torch.ones(4, device=direction_device)
        assert_rejects("batch_dot", lambda m: m.batch_dot(g, direction), "is on")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g, direction = random_grad(6, (5, 4), device=device), random_param((5, 4), device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.batch_dot.default, (g, direction, 6.0))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g, direction = random_grad(64, (256, 33), dtype), random_param((256, 33), dtype)
    cpu = ops.batch_dot(g, direction, 64.0)
    torch.testing.assert_close(ops.batch_dot(g.cuda(), direction.cuda(), 64.0).cpu(), cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_applies_to_each_product_not_the_sum(device, dtype):
    # <scale * g, d>: here the unscaled products overflow, underflow, or meet a zero scale.
    cases = [(1e30, 1e30, 1e-30, 1e30), (1e30, 1e30, 0.0, 0.0), (1e-30, 1e-30, 1e30, 1e-30)]
    for g_value, d_value, scale, expected in cases:
        g = torch.full((2, 3), g_value, dtype=dtype, device=device)
        d = torch.full((3,), d_value, dtype=dtype, device=device)
        result = ops.batch_dot(g, d, scale).double().cpu()
        torch.testing.assert_close(result, torch.full((2,), 3 * expected, dtype=torch.float64), rtol=1e-5, atol=0)
