"""Pure-torch twins of the fused ops: same signatures, same results, computed the way Cockpit does.

These are the test oracle and the fallback when the C++ extension is not built. Each one
materialises the intermediate tensors the fused kernels avoid (the scaled copy, the clamped copy,
the expanded parameter, the index tensor). Values are computed in the accumulation dtype
(float64 for float64 input, float32 otherwise), exactly like the kernels. Like the ops, they
have no gradient: their results never require grad.
"""

import math

import torch

from cockpit_fast import _validation as v
from cockpit_fast import stats as columns


def _scaled(g, scale):
    """scale * g in the accumulation dtype, flattened per sample: (N, D)."""
    x = g.to(v.accumulation_dtype(g.dtype))
    return (scale * x).reshape(g.shape[0], math.prod(g.shape[1:]))  # explicit: N may be 0


@torch.no_grad()
def batch_l2(g, scale=1.0):
    """Per-sample squared norm: sum_j (scale * g[n, j])^2, shape (N,)."""
    scale = v.grad_args("batch_l2", g, scale)
    return (_scaled(g, scale) ** 2).sum(1)


@torch.no_grad()
def sum_grad_squared(g, scale=1.0):
    """sum_n (scale * g[n])^2, shape g.shape[1:]."""
    scale = v.grad_args("sum_grad_squared", g, scale)
    return (_scaled(g, scale) ** 2).sum(0).reshape(g.shape[1:])


@torch.no_grad()
def batch_l2_and_sum_grad_squared(g, scale=1.0):
    """Both of the above; the fused op reads g once for the two."""
    scale = v.grad_args("batch_l2_and_sum_grad_squared", g, scale)
    squares = _scaled(g, scale) ** 2
    return squares.sum(1), squares.sum(0).reshape(g.shape[1:])


# torch.histc counts in the input's dtype: float32 holds every count up to 2^24 exactly, so
# chunks of at most that many values are counted exactly, and their counts summed in int64.
_EXACT_FLOAT32_COUNTS = 2**24


@torch.no_grad()
def hist1d(g, bins=100, range=(-2.0, 2.0), scale=1.0):
    """int64 counts of scale * g clamped into [lo, hi], binned by torch.histc; NaN is not counted."""
    bins, lo, hi, scale = v.hist1d_args(g, bins, range, scale)
    clamped = _scaled(g, scale).clamp(lo, hi).flatten()
    counts = torch.zeros(bins, dtype=torch.long, device=g.device)
    for chunk in clamped.split(_EXACT_FLOAT32_COUNTS):
        counts += torch.histc(chunk, bins=bins, min=lo, max=hi).long()
    return counts


@torch.no_grad()
def hist2d(g, param, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), scale=1.0):
    """2D int64 counts over (scale * g[n, j], param[j]), both clamped to the centres of the outer bins.

    This is Cockpit's GradHist2d arithmetic: clamp, subtract the lower limit, divide by the bin
    width and truncate; pairs with a NaN coordinate are not counted.
    """
    (xbins, ybins), xrange, yrange, scale = v.hist2d_args(g, param, bins, range, scale)
    x = _scaled(g, scale).flatten()
    y = param.to(x.dtype).reshape(1, -1).expand(g.shape[0], -1).flatten()
    index = torch.zeros_like(x, dtype=torch.long)
    for data, n_bins, (lo, hi), stride in ((x, xbins, xrange, ybins), (y, ybins, yrange, 1)):
        width = (hi - lo) / n_bins
        centred = data.clamp(lo + width / 2, hi - width / 2)
        # The clamp keeps finite values in [0, n_bins); the outer clamp only tames NaN's cast.
        # A tensor divisor: torch on CUDA divides by a Python number as a product with its
        # reciprocal, which can put a value one bin off; a tensor rounds as the kernels do.
        bin_index = ((centred - lo) / centred.new_tensor(width)).long().clamp(0, n_bins - 1)
        index += stride * bin_index
    counted = ~(x.isnan() | y.isnan())
    hist = torch.zeros(xbins * ybins, dtype=torch.long, device=g.device)
    hist.put_(index[counted], torch.ones_like(index[counted]), accumulate=True)
    return hist.reshape(xbins, ybins)


@torch.no_grad()
def batch_dot(g, direction, scale=1.0):
    """scale * <g[n], direction> for every sample, shape (N,)."""
    scale = v.batch_dot_args(g, direction, scale)
    x = _scaled(g, scale)
    return torch.einsum("nd,d->n", x, direction.to(x.dtype).flatten())


@torch.no_grad()
def hist1d_batch_l2_batch_dots(g, directions, bins=100, range=(-2.0, 2.0), hist_scale=1.0, scale=1.0):
    """hist1d with ``hist_scale``, batch_l2 and (N, k) batch_dot against each direction with ``scale``."""
    bins, lo, hi, hist_scale, scale = v.hist1d_batch_l2_batch_dots_args(g, directions, bins, range, hist_scale, scale)
    x = _scaled(g, scale)
    d = directions.to(x.dtype).reshape(directions.shape[0], x.shape[1])
    return hist1d(g, bins, (lo, hi), hist_scale), (x**2).sum(1), torch.einsum("nd,kd->nk", x, d)


@torch.no_grad()
def factored_hist1d_batch_l2_batch_dots(left, right, directions, bins=100, range=(-2.0, 2.0), hist_scale=1.0, scale=1.0):
    """hist1d_batch_l2_batch_dots of G = left^T right per sample, formed with one bmm in the input dtype."""
    bins, lo, hi, hist_scale, scale = v.factored_hist1d_batch_l2_batch_dots_args(
        left, right, directions, bins, range, hist_scale, scale
    )
    g = torch.bmm(left.transpose(1, 2), right)
    return hist1d_batch_l2_batch_dots(g, directions, bins, (lo, hi), hist_scale, scale)


@torch.no_grad()
def per_sample_stats(g, scale=1.0, p_values=()):
    """One row per sample: max, min, mean, M2, max|x|, then sum |x|^p per p (see cockpit_fast.stats)."""
    scale, p_values = v.per_sample_stats_args(g, scale, p_values)
    x = _scaled(g, scale)
    n, d = x.shape
    out = torch.zeros(n, columns.P0 + len(p_values), dtype=x.dtype, device=x.device)
    if d == 0:
        out[:, columns.MAX] = float("-inf")
        out[:, columns.MIN] = float("inf")
        return out
    mean = x.mean(1)
    # A sum of values near the top of the range overflows, and may meet an infinity of the other
    # sign (inf - inf = NaN); partial sums of x / d cannot overflow. The kernels do the same.
    mean = torch.where(mean.isfinite(), mean, (x / d).sum(1))
    out[:, columns.MAX] = x.amax(1)
    out[:, columns.MIN] = x.amin(1)
    out[:, columns.MEAN] = mean
    out[:, columns.M2] = ((x - mean[:, None]) ** 2).sum(1)
    out[:, columns.MAX_ABS] = x.abs().amax(1)
    for i, p in enumerate(p_values):
        out[:, columns.P0 + i] = x.abs().pow(p).sum(1)
    return out


def _outer_products(left, right):
    """The per-sample outer products left[n] right[n]^T, rounded in the input dtype: (N, p, q)."""
    return left[:, :, None] * right[:, None, :]


@torch.no_grad()
def outer_hist1d(left, right, bins=100, range=(-2.0, 2.0), scale=1.0):
    """:func:`hist1d` of the per-sample outer products ``left[n] right[n]^T``, formed in full."""
    bins, lo, hi, scale = v.outer_hist1d_args(left, right, bins, range, scale)
    return hist1d(_outer_products(left, right), bins, (lo, hi), scale)


@torch.no_grad()
def outer_hist2d(left, right, param, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), scale=1.0):
    """:func:`hist2d` of the per-sample outer products ``left[n] right[n]^T`` against ``param``."""
    bins, xrange, yrange, scale = v.outer_hist2d_args(left, right, param, bins, range, scale)
    return hist2d(_outer_products(left, right), param, bins, (xrange, yrange), scale)
