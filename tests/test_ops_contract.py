"""What every op promises beyond its own numbers: torch.compile, the reference fallback, and
64-bit indexing of tensors past 2^31 elements."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cockpit_fast import ops, reference, stats
from conftest import assert_rejects, random_grad, random_param


def all_ops(g, param):
    l2, sgs = ops.batch_l2_and_sum_grad_squared(g, 4.0)
    return (
        l2,
        sgs,
        ops.batch_l2(g, 4.0),
        ops.sum_grad_squared(g, 4.0),
        ops.hist1d(g, 30, (-1.0, 1.0), 4.0),
        ops.hist2d(g, param, (6, 7), ((-1.0, 1.0), (-2.0, 2.0)), 4.0),
        ops.batch_dot(g, param, 4.0),
        ops.per_sample_stats(g, 4.0, [1.0, 2.0]),
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
def test_tensors_past_two_to_the_31_elements():
    """Two rows of 1025 * 2^20 float16 values, 2^31 + 2^21 in all: any 32-bit index would wrap.

    The rows repeat one random block, so the exact answer follows from the block's own.
    """
    block = torch.randn(2**20, generator=torch.Generator().manual_seed(0)).half()
    repeats = 2 * 1025
    g = block.repeat(repeats).view(2, -1)
    old = g[1, -1].clone()
    g[1, -1] = 50.0  # only visible past the 2^31-th element: a wrapped index would miss it

    block_counts = reference.hist1d(block[None], 64, (-4.0, 4.0))
    moved = reference.hist1d(old.reshape(1, 1), 64, (-4.0, 4.0))
    expected_counts = repeats * block_counts - moved
    expected_counts[-1] += 1  # 50 is clamped into the last bin
    assert torch.equal(ops.hist1d(g, 64, (-4.0, 4.0)), expected_counts)

    block_l2 = float(block.double().pow(2).sum())
    expected_l2 = torch.tensor([1025 * block_l2, 1025 * block_l2 - float(old) ** 2 + 2500.0], dtype=torch.float64)
    torch.testing.assert_close(ops.batch_l2(g).double(), expected_l2, rtol=1e-5, atol=0)
    row_stats = ops.per_sample_stats(g, 1.0, [2.0])
    assert row_stats[1, stats.MAX] == 50.0 and row_stats[0, stats.MAX] == float(block.max())
    torch.testing.assert_close(row_stats[:, stats.P0].double(), expected_l2, rtol=1e-5, atol=0)


def every_op_with_scale(g, param, scale):
    """Every op on (g, param) and on the factors (g, param) with ``scale``."""
    return {
        "batch_l2": lambda m: m.batch_l2(g, scale),
        "sum_grad_squared": lambda m: m.sum_grad_squared(g, scale),
        "batch_l2_and_sum_grad_squared": lambda m: m.batch_l2_and_sum_grad_squared(g, scale),
        "hist1d": lambda m: m.hist1d(g, 30, (-1.0, 1.0), scale),
        "hist2d": lambda m: m.hist2d(g, param, (6, 7), ((-1.0, 1.0), (-2.0, 2.0)), scale),
        "batch_dot": lambda m: m.batch_dot(g, param, scale),
        "per_sample_stats": lambda m: m.per_sample_stats(g, scale, [1.0]),
        "outer_hist1d": lambda m: m.outer_hist1d(g, g, 30, (-1.0, 1.0), scale),
        "outer_hist2d": lambda m: m.outer_hist2d(g, g, param.expand(2, 2).contiguous(), (6, 7), ((-1.0, 1.0), (-2.0, 2.0)), scale),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_scale_beyond_float32_is_rejected_where_values_are_scaled_in_float32(dtype):
    g, param = random_grad(3, (2,), dtype), random_param((2,), dtype)
    for name, call in every_op_with_scale(g[:, :2].reshape(3, 2), param, 1e39).items():
        assert_rejects(name, call, "scale must be finite in float32")
    # float64 scales in float64, where 1e39 is fine.
    g64, param64 = g.double()[:, :2].reshape(3, 2), param.double()
    for name, call in every_op_with_scale(g64, param64, 1e39).items():
        call(ops)
