"""Argument checks shared by the fake kernels and the pure-torch reference.

The C++ ops make the same checks with ``TORCH_CHECK_VALUE`` (csrc/include/cockpit_fast/checks.h),
so every path raises ``ValueError`` with a message that names the op and the problem.
"""

import math
import struct

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Most p values one ``per_sample_stats`` call accepts (fixed-size state in the kernels).
MAX_P_VALUES = 8

#: Most cells one histogram may have (int32 slots in the kernels; float32 resolves no more).
MAX_BINS = 2**24


def accumulation_dtype(dtype):
    """float64 stays float64; every other accepted dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_grad(op, g):
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"cockpit_fast.{op}: g must be a tensor, got {type(g).__name__}")
    if g.dim() < 1:
        raise ValueError(
            f"cockpit_fast.{op}: g must have a leading batch dimension (N, *param_shape), "
            f"got a {g.dim()}-d tensor"
        )
    if g.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"cockpit_fast.{op}: g must be float16, bfloat16, float32 or float64, got {g.dtype}"
        )


def check_companion(op, g, other, name):
    """``other`` (a parameter or a direction) must have ``g``'s per-sample shape, device and dtype."""
    if not isinstance(other, torch.Tensor):
        raise ValueError(f"cockpit_fast.{op}: {name} must be a tensor, got {type(other).__name__}")
    if other.device != g.device:
        raise ValueError(
            f"cockpit_fast.{op}: g is on {g.device} but {name} is on {other.device}"
        )
    if other.dtype != g.dtype:
        raise ValueError(f"cockpit_fast.{op}: g is {g.dtype} but {name} is {other.dtype}")
    if tuple(other.shape) != tuple(g.shape[1:]):
        raise ValueError(
            f"cockpit_fast.{op}: {name} must have shape g.shape[1:] = {tuple(g.shape[1:])}, "
            f"got {tuple(other.shape)}"
        )


def check_factors(op, left, right, scale):
    """Factors (N, p) and (N, q) of per-sample outer products: 2-d, float, same N, dtype, device."""
    for name, t in (("left", left), ("right", right)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"cockpit_fast.{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(
                f"cockpit_fast.{op}: {name} must be a 2-d (N, features) tensor, got a {t.dim()}-d tensor"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"cockpit_fast.{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
    if right.device != left.device:
        raise ValueError(f"cockpit_fast.{op}: left is on {left.device} but right is on {right.device}")
    if right.dtype != left.dtype:
        raise ValueError(f"cockpit_fast.{op}: left is {left.dtype} but right is {right.dtype}")
    if right.shape[0] != left.shape[0]:
        raise ValueError(
            f"cockpit_fast.{op}: left and right must have the same number of samples, "
            f"got {left.shape[0]} and {right.shape[0]}"
        )
    check_scale(op, scale, left.dtype)
    return float(scale)


def check_bins(op, bins, axis=""):
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise ValueError(f"cockpit_fast.{op}: {axis}bins must be a positive integer, got {bins!r}")


def check_cells(op, cells):
    if cells > MAX_BINS:
        raise ValueError(f"cockpit_fast.{op}: at most {MAX_BINS} histogram cells, got {cells}")


def _to_float32(x):
    """``x`` rounded to float32, ±inf beyond its range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _accumulated(dtype):
    """The rounding to ``dtype``'s accumulation type, and that type's name."""
    if accumulation_dtype(dtype) == torch.float64:
        return float, "float64"
    return _to_float32, "float32"


def check_range(op, lo, hi, bins, dtype, axis=""):
    """Finite, ordered bounds whose bins can be computed in ``dtype``'s accumulation type: a range
    fine in double can overflow (span * bins) or round to nothing (the bin width) in float32."""
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"cockpit_fast.{op}: {axis}range bounds must be finite, got ({lo}, {hi})")
    if not lo < hi:
        raise ValueError(f"cockpit_fast.{op}: {axis}range needs lo < hi, got ({lo}, {hi})")
    rounded, precision = _accumulated(dtype)
    low, high = rounded(lo), rounded(hi)
    span_times_bins, width = rounded(rounded(high - low) * bins), rounded((hi - lo) / bins)
    if not (low < high and math.isfinite(span_times_bins) and width > 0):
        raise ValueError(
            f"cockpit_fast.{op}: {axis}range ({lo}, {hi}) with {bins} bins overflows or rounds to "
            f"nothing in {precision}, the precision the bins are computed in"
        )


def check_scale(op, scale, dtype):
    """``scale`` multiplies every value in ``dtype``'s accumulation type: it must be finite there."""
    rounded, precision = _accumulated(dtype)
    if not math.isfinite(rounded(float(scale))):
        raise ValueError(
            f"cockpit_fast.{op}: scale must be finite in {precision}, the precision it multiplies in, "
            f"got {scale}"
        )


def check_p_values(op, p_values, dtype):
    """At most MAX_P_VALUES values, finite and > 0 in ``dtype``'s accumulation type."""
    rounded, precision = _accumulated(dtype)
    if len(p_values) > MAX_P_VALUES:
        raise ValueError(
            f"cockpit_fast.{op}: at most {MAX_P_VALUES} p values per call, got {len(p_values)}"
        )
    for p in p_values:
        if not (math.isfinite(rounded(p)) and rounded(p) > 0):
            raise ValueError(
                f"cockpit_fast.{op}: p values must be finite and > 0 in {precision} (use the "
                f"max_abs column for p = inf), got {p}"
            )


# One normaliser per op: used by the reference twins and by the fake kernels alike.


def grad_args(op, g, scale):
    check_grad(op, g)
    check_scale(op, scale, g.dtype)
    return float(scale)


def hist1d_args(g, bins, range, scale):
    scale = grad_args("hist1d", g, scale)
    return (*binning_1d("hist1d", bins, range, g.dtype), scale)


def binning_1d(op, bins, range, dtype):
    """``bins, lo, hi`` of a 1D histogram of ``dtype`` values, checked."""
    check_bins(op, bins)
    check_cells(op, bins)
    lo, hi = range
    check_range(op, lo, hi, bins, dtype)
    return bins, float(lo), float(hi)


def binning_2d(op, bins, range, dtype):
    """``(xbins, ybins), (xlo, xhi), (ylo, yhi)`` of a 2D histogram of ``dtype`` values, checked."""
    xbins, ybins = bins
    (xlo, xhi), (ylo, yhi) = range
    check_bins(op, xbins, "x ")
    check_bins(op, ybins, "y ")
    check_cells(op, xbins * ybins)
    check_range(op, xlo, xhi, xbins, dtype, "x ")
    check_range(op, ylo, yhi, ybins, dtype, "y ")
    return (xbins, ybins), (float(xlo), float(xhi)), (float(ylo), float(yhi))


def hist2d_args(g, param, bins, range, scale):
    scale = grad_args("hist2d", g, scale)
    check_companion("hist2d", g, param, "param")
    return (*binning_2d("hist2d", bins, range, g.dtype), scale)


def batch_dot_args(g, direction, scale):
    scale = grad_args("batch_dot", g, scale)
    check_companion("batch_dot", g, direction, "direction")
    return scale


def per_sample_stats_args(g, scale, p_values):
    scale = grad_args("per_sample_stats", g, scale)
    p_values = [float(p) for p in p_values]
    check_p_values("per_sample_stats", p_values, g.dtype)
    return scale, p_values


def outer_hist1d_args(left, right, bins, range, scale):
    scale = check_factors("outer_hist1d", left, right, scale)
    return (*binning_1d("outer_hist1d", bins, range, left.dtype), scale)


def outer_hist2d_args(left, right, param, bins, range, scale):
    scale = check_factors("outer_hist2d", left, right, scale)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"cockpit_fast.outer_hist2d: param must be a tensor, got {type(param).__name__}")
    if param.device != left.device:
        raise ValueError(f"cockpit_fast.outer_hist2d: left is on {left.device} but param is on {param.device}")
    if param.dtype != left.dtype:
        raise ValueError(f"cockpit_fast.outer_hist2d: left is {left.dtype} but param is {param.dtype}")
    expected = (left.shape[1], right.shape[1])
    if tuple(param.shape) != expected:
        raise ValueError(
            f"cockpit_fast.outer_hist2d: param must have shape (left.shape[1], right.shape[1]) = "
            f"{expected}, got {tuple(param.shape)}"
        )
    return (*binning_2d("outer_hist2d", bins, range, left.dtype), scale)
