"""Columns of ``per_sample_stats`` and how results from several parameters merge.

``per_sample_stats(g, scale, p_values)`` returns, for every sample n, one row over the values
x = scale * g[n] (flattened), in the accumulation dtype (float64 for float64 input, else float32):

============  ======================================================================
column        meaning
============  ======================================================================
``MAX``       max_j x_j   (-inf for an empty row; NaN if any x_j is NaN)
``MIN``       min_j x_j   (+inf for an empty row; NaN if any x_j is NaN)
``MEAN``      mean_j x_j  (0 for an empty row)
``M2``        sum_j (x_j - mean)^2, the Welford/Chan second moment (0 for an empty row)
``MAX_ABS``   max_j |x_j| (0 for an empty row): the p = inf norm
``P0 + i``    sum_j |x_j|^p_i for the i-th requested p value
============  ======================================================================

Empty rows give the identity of every merge, so rows of several parameters merge exactly like
the values of one concatenated parameter would (``merge``).
"""

import torch

MAX, MIN, MEAN, M2, MAX_ABS, P0 = range(6)


def merge(parts):
    """Merge ``[(stats, count), ...]`` of several parameters into ``(stats, count)``.

    ``count`` is the number of values per sample behind ``stats`` (the parameter's numel).
    Means and second moments merge with Chan et al.'s parallel formula, which stays accurate
    where subtracting squared sums would cancel.
    """
    stats, count = parts[0]
    for other, other_count in parts[1:]:
        stats, count = _merge_two(stats, count, other, other_count), count + other_count
    return stats, count


def _merge_two(a, na, b, nb):
    if nb == 0:  # an empty part is the identity (also where delta * delta would overflow)
        return a
    if na == 0:
        return b.clone()
    n = na + nb
    out = a.clone()
    out[:, MAX] = torch.maximum(a[:, MAX], b[:, MAX])
    out[:, MIN] = torch.minimum(a[:, MIN], b[:, MIN])
    delta = b[:, MEAN] - a[:, MEAN]
    # Where a mean is infinite, Chan's update gives inf - inf = NaN: weigh the means directly.
    chan = a[:, MEAN] + delta * (nb / n)
    weighted = a[:, MEAN] * (na / n) + b[:, MEAN] * (nb / n)
    out[:, MEAN] = torch.where(torch.isfinite(delta), chan, weighted)
    out[:, M2] = a[:, M2] + b[:, M2] + delta * delta * (na * nb / n)
    out[:, MAX_ABS] = torch.maximum(a[:, MAX_ABS], b[:, MAX_ABS])
    out[:, P0:] = a[:, P0:] + b[:, P0:]
    return out
