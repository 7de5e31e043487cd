"""outer_hist1d: 1D histograms of per-sample outer products, the products never formed."""

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
    requires_cuda,
    same_on_one_and_two_threads,
    values_near_edges,
)

# (p, q): a Linear 256x784-like pair, both orders of the shorter factor, a single feature, and
# a long row crossing the CUDA tile boundary.
FACTOR_SIZES = [(13, 61), (61, 13), (1, 9), (7, 1), (3, 2050)]


def factors(n, p, q, dtype=torch.float32, device="cpu", layout="contiguous", seed=0):
    """A Linear layer's output gradient (N, p), ~1/N as for a mean loss, and input (N, q)."""
    delta = random_grad(n, (p,), dtype, device, layout, seed=seed, spread=0.5 / n)
    inputs = random_grad(n, (q,), dtype, device, layout, seed=seed + 1, spread=2.0)
    return delta, inputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", FACTOR_SIZES)
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(device, dtype, sizes, n, layout):
    delta, inputs = factors(n, *sizes, dtype, device, layout, seed=n)
    bins, lo, hi, scale = 31, -1.0, 1.5, float(n)
    counts = ops.outer_hist1d(delta, inputs, bins, (lo, hi), scale)
    assert counts.dtype == torch.int64 and counts.shape == (bins,)
    # The formed products in the same dtype, binned by the materialised path: identical counts.
    assert torch.equal(counts, reference.outer_hist1d(delta, inputs, bins, (lo, hi), scale))
    # Against float64 products: every value counted, bins differ only at an edge's rounding.
    exact = reference.outer_hist1d(delta.double(), inputs.double(), bins, (lo, hi), scale)
    assert counts.sum() == n * sizes[0] * sizes[1]
    products = scale * delta.double()[:, :, None] * inputs.double()[:, None, :]
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    assert (counts - exact).abs().sum() <= 2 * values_near_edges(products, lo, hi, bins, tol=tol)


# More samples than a CUDA grid has rows of blocks (65535): row groups must cover them all.
@pytest.mark.parametrize("device", DEVICES)
def test_more_samples_than_grid_rows(device):
    delta, inputs = factors(70001, 2, 3, device=device)
    rng = (-1.0, 1.5)
    assert torch.equal(ops.outer_hist1d(delta, inputs, 31, rng, 70001.0), reference.outer_hist1d(delta, inputs, 31, rng, 70001.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_counts_as_hist1d_of_the_materialised_outer_products(dtype):
    # What BackPACK's BatchGrad stores for a 2-d Linear input: grad_batch[n] = delta[n] input[n]^T.
    delta, inputs = factors(64, 40, 300, dtype, seed=3)
    grad_batch = torch.einsum("no,ni->noi", delta, inputs)
    for bins, rng in [(100, (-2.0, 2.0)), (7, (-0.05, 0.02)), (5000, (-3.0, 3.0))]:
        expected = ops.hist1d(grad_batch, bins, rng, scale=64)
        assert torch.equal(ops.outer_hist1d(delta, inputs, bins, rng, scale=64), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [4.0, -4.0])  # products rising and falling along sorted values
def test_products_exactly_on_bin_edges(device, dtype, scale):
    # Dyadic factors: scale * u * v is a multiple of 1/16, exactly, and so is every bin edge of
    # 32 bins over [-1, 1]: most products sit on an edge, where a run ends.
    gen = torch.Generator().manual_seed(21)
    delta = (torch.randint(-4, 5, (7, 40), generator=gen) / 16).to(device=device, dtype=dtype)
    inputs = (torch.randint(-8, 9, (7, 33), generator=gen) / 4).to(device=device, dtype=dtype)
    counts = ops.outer_hist1d(delta, inputs, 32, (-1.0, 1.0), scale)
    assert torch.equal(counts, reference.outer_hist1d(delta, inputs, 32, (-1.0, 1.0), scale))
    assert counts.sum() == 7 * 40 * 33


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 40])  # binned directly, and by runs over the sorted factor
def test_relu_like_zero_rows(device, dtype, rows):
    # Half the output gradient is exactly zero (units a ReLU switched off), some of it -0.0;
    # the other factor holds infinities and NaN, whose products with 0 are NaN and not counted.
    delta, inputs = factors(6, rows, 50, dtype, device, seed=11)
    off = torch.rand(delta.shape, generator=torch.Generator().manual_seed(12)) < 0.5
    delta[off.to(device)] = 0.0
    delta[0, :3] = -0.0
    inputs[1, 0], inputs[2, 1], inputs[3, 2] = float("inf"), -float("inf"), float("nan")
    for scale in (6.0, -1.5):
        counts = ops.outer_hist1d(delta, inputs, 13, (-0.7, 0.4), scale)
        assert torch.equal(counts, reference.outer_hist1d(delta, inputs, 13, (-0.7, 0.4), scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [5, 20])  # the CPU kernel bins few rows directly, many by runs
def test_zero_nan_and_infinite_factors(device, rows):
    delta, inputs = factors(4, rows, 30, device=device, seed=5)
    delta[0, 0] = 0.0  # products 0, or NaN against an infinite input
    delta[1, 1] = float("nan")
    delta[2, 2] = float("inf")
    delta[3, 3] = -float("inf")
    inputs[0, :3] = float("nan")
    inputs[1, 3] = float("inf")
    inputs[2, 4] = 0.0  # inf * 0 is NaN
    inputs[3, 5] = -float("inf")
    inputs[0, 6] = float("inf")
    for scale in (4.0, -2.5, 0.0):
        counts = ops.outer_hist1d(delta, inputs, 20, (-1.0, 1.0), scale)
        assert torch.equal(counts, reference.outer_hist1d(delta, inputs, 20, (-1.0, 1.0), scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [5, 40])
def test_a_sample_whose_sorted_factor_is_all_nan(device, rows):
    # Nothing of that sample is counted; the CPU's run counting must not look into its (empty)
    # sorted factor, whatever sample the same thread sorted before.
    delta, inputs = factors(6, rows, 50, device=device, seed=21)
    inputs[2] = float("nan")
    inputs[5] = float("nan")
    expected = reference.outer_hist1d(delta, inputs, 16, (-1.0, 1.0), 6.0)
    one, two = same_on_one_and_two_threads(lambda: ops.outer_hist1d(delta, inputs, 16, (-1.0, 1.0), 6.0))
    assert torch.equal(one, expected) and torch.equal(two, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_products_on_bin_edges(device, dtype):
    bins, lo, hi = 40, -2.0, 2.0
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    inputs = torch.cat([edges, (edges[1:] + edges[:-1]) / 2]).reshape(1, -1).repeat(3, 1).to(device)
    delta = torch.tensor([[1.0, -1.0], [0.5, 2.0], [1.0, 0.25]], dtype=dtype, device=device)
    counts = ops.outer_hist1d(delta, inputs, bins, (lo, hi))
    assert torch.equal(counts, reference.outer_hist1d(delta, inputs, bins, (lo, hi)))
    assert counts[-1] >= 3  # hi itself lands in the closed last bin


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", [ops, reference], ids=["op", "reference"])
def test_counts_are_exact_past_float32(device, implementation):
    # 4097^2 = 2^24 + 8193 products, all 0, a count float32 would round to an even one.
    delta, inputs = torch.ones(1, 4097, device=device), torch.zeros(1, 4097, device=device)
    for left, right in [(delta, inputs), (inputs, delta)]:  # a zero factor, and zeros sorted
        counts = implementation.outer_hist1d(left, right, 100, (-2.0, 2.0))
        assert counts.dtype == torch.int64 and counts[50] == 4097**2 and counts.sum() == 4097**2


@pytest.mark.parametrize("device", DEVICES)
def test_concentrated_and_large_histograms(device):
    delta = torch.full((8, 20), 0.5, device=device)
    inputs = torch.full((8, 300), 0.6, device=device)
    assert ops.outer_hist1d(delta, inputs, 100, (-1.0, 1.0))[65] == 8 * 20 * 300
    delta, inputs = factors(6, 30, 500, device=device)
    assert torch.equal(
        ops.outer_hist1d(delta, inputs, 20000, (-0.1, 0.1)), reference.outer_hist1d(delta, inputs, 20000, (-0.1, 0.1))
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [((0, 4), (0, 5)), ((3, 0), (3, 5)), ((3, 4), (3, 0))])
def test_empty_input(device, shapes):
    delta, inputs = torch.randn(shapes[0], device=device), torch.randn(shapes[1], device=device)
    assert torch.equal(ops.outer_hist1d(delta, inputs, 12), torch.zeros(12, dtype=torch.int64, device=device))
    assert torch.equal(reference.outer_hist1d(delta, inputs, 12), torch.zeros(12, dtype=torch.int64, device=device))


def test_same_counts_on_any_thread_count():
    delta, inputs = factors(50, 30, 400, seed=9)
    one, two = same_on_one_and_two_threads(lambda: ops.outer_hist1d(delta, inputs, 77, (-0.5, 0.5), 50.0))
    assert torch.equal(one, two)


def test_rejects_bad_input():
    ok = torch.ones(3, 4)
    cases = [
        ((torch.ones(3), ok), "left must be a 2-d"),
        ((ok, torch.ones(3, 4, 5)), "right must be a 2-d"),
        ((torch.ones(3, 4, dtype=torch.int32), ok), "left must be float16, bfloat16, float32 or float64"),
        ((ok, torch.ones(3, 4, dtype=torch.complex64)), "right must be float16"),
        ((ok, torch.ones(3, 4, dtype=torch.float64)), "left is .* but right is "),
        ((ok, torch.ones(2, 4)), "same number of samples"),
    ]
    for (left, right), message in cases:
        assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(left, right), message)
    for bins in (0, -3):
        assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(ok, ok, bins), "bins must be a positive integer")
    assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(ok, ok, 10, (1.0, -1.0)), "lo < hi")
    assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(ok, ok, 10, (0.0, float("inf"))), "must be finite")
    assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(ok, ok, 10, (-1, 1), float("nan")), "scale must be finite")
    for rng, _why in FLOAT32_UNBINNABLE_RANGES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            od = ok.to(dtype)
            assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(od, od, 100, rng), BINNABLE_IN_FLOAT32_ONLY_MESSAGE)
        od = ok.double()
        assert torch.equal(ops.outer_hist1d(od, od, 100, rng), reference.outer_hist1d(od, od, 100, rng))


@requires_cuda
def test_rejects_factors_on_different_devices():
    for left_device, right_device in (("cuda", "cpu"), ("cpu", "cuda")):
        left, right = torch.ones(2, 3, device=left_device), torch.ones(2, 3, device=right_device)
        assert_rejects("outer_hist1d", lambda m: m.outer_hist1d(left, right), "is on")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    delta, inputs = factors(6, 5, 7, device=device)
    torch.library.opcheck(torch.ops.cockpit_fast.outer_hist1d.default, (delta, inputs, 20, -1.0, 1.0, 6.0))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    delta, inputs = factors(128, 256, 78, dtype)
    expected = ops.outer_hist1d(delta, inputs, 100, (-2.0, 2.0), 128.0)
    assert torch.equal(ops.outer_hist1d(delta.cuda(), inputs.cuda(), 100, (-2.0, 2.0), 128.0).cpu(), expected)
