"""batch_l2, sum_grad_squared and the fused batch_l2_and_sum_grad_squared."""

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
    scale = float(n)
    expected_l2 = reference.batch_l2(g.double(), scale)
    expected_sgs = reference.sum_grad_squared(g.double(), scale)

    assert_close_to_reference(ops.batch_l2(g, scale), expected_l2, dtype)
    assert_close_to_reference(ops.sum_grad_squared(g, scale), expected_sgs, dtype)
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g, scale)
    assert l2.shape == (n,) and sgs.shape == param_shape
    assert_close_to_reference(l2, expected_l2, dtype)
    assert_close_to_reference(sgs, expected_sgs, dtype)


# More samples than a CUDA grid has rows of blocks (65535): row groups must cover them all.
@pytest.mark.parametrize("device", DEVICES)
def test_more_samples_than_grid_rows(device):
    g = random_grad(70001, (3,), device=device)
    assert_close_to_reference(ops.batch_l2(g), reference.batch_l2(g.double()), torch.float32)
    assert_close_to_reference(ops.sum_grad_squared(g), reference.sum_grad_squared(g.double()), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_separate_ops_exactly(device):
    g = random_grad(33, (300, 7), device=device)
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g, 3.0)
    assert torch.equal(l2, ops.batch_l2(g, 3.0))
    assert torch.equal(sgs, ops.sum_grad_squared(g, 3.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0), (0,)])
def test_empty_input(device, shape):
    g = torch.empty(shape, device=device)
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g)
    assert torch.equal(l2, torch.zeros(shape[0], device=device))
    assert torch.equal(sgs, torch.zeros(shape[1:], device=device))
    assert torch.equal(ops.batch_l2(g), l2) and torch.equal(ops.sum_grad_squared(g), sgs)
    ref_l2, ref_sgs = reference.batch_l2_and_sum_grad_squared(g)
    assert torch.equal(ref_l2, l2) and torch.equal(ref_sgs, sgs)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_values_propagate(device):
    g = random_grad(4, (10,), device=device)
    g[1, 3] = float("nan")
    g[2, 5] = float("inf")
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g)
    expected_l2, expected_sgs = reference.batch_l2_and_sum_grad_squared(g.double())
    torch.testing.assert_close(l2.double(), expected_l2, equal_nan=True)
    torch.testing.assert_close(sgs.double(), expected_sgs, equal_nan=True)
    assert l2[1].isnan() and l2[2].isinf() and sgs[3].isnan() and sgs[5].isinf()


def test_same_result_on_any_thread_count():
    g = random_grad(130, (1500, 3))
    one, two = same_on_one_and_two_threads(lambda: ops.batch_l2_and_sum_grad_squared(g, 2.0))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("name", ["batch_l2", "sum_grad_squared", "batch_l2_and_sum_grad_squared"])
def test_rejects_bad_input(name):
    for g, message in bad_grads():
        assert_rejects(name, lambda m: getattr(m, name)(g), message)
    assert_rejects(name, lambda m: getattr(m, name)(torch.ones(2, 3), float("inf")), "scale must be finite")


@pytest.mark.parametrize("name", ["batch_l2", "sum_grad_squared", "batch_l2_and_sum_grad_squared"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(name, device):
    g = random_grad(6, (5, 4), device=device)
    torch.library.opcheck(getattr(torch.ops.cockpit_fast, name).default, (g, 6.0))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    g = random_grad(64, (256, 33), dtype)
    for cpu, cuda in zip(ops.batch_l2_and_sum_grad_squared(g, 64.0), ops.batch_l2_and_sum_grad_squared(g.cuda(), 64.0)):
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-5, atol=0)
