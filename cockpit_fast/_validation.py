"""The argument rules of every op, applied before any kernel runs, and of a cockpit's ``info``.

The wrappers in :mod:`cockpit_fast.ops`, the pure-torch twins in :mod:`cockpit_fast.reference`
and the fake kernels call the same normaliser (``<op>_args``), so every path accepts the same
arguments and rejects the others with the same ``ValueError``, naming the op and the problem:

* tensors are ``torch.Tensor``;
* a count (``bins``) is a Python or NumPy integer or a 0-d integer tensor, never a bool;
* a number (``scale``, range bounds, p values) is a Python or NumPy real number or a 0-d real
  tensor, never a bool;
* a pair (a range, 2D bins) is a tuple or list of two; ``p_values`` a tuple or list of numbers.

The checks compare the numbers themselves: a number that ``torch.compile(dynamic=True)`` makes
symbolic is specialised to its value (a guard; a new value recompiles), as the ops' schemas,
whose numbers are plain floats and ints, specialise it anyway.

The C++ ops repeat the value checks with ``TORCH_CHECK_VALUE`` (csrc/include/cockpit_fast/checks.h)
for direct ``torch.ops.cockpit_fast`` calls, whose argument types the op schemas fix; the limits
they share are written once, in :mod:`cockpit_fast._limits`.

:func:`check_info` checks what a user hands to ``cockpit(global_step, info=...)`` when the step
starts, before any quantity reads it.
"""

import math
import numbers
import operator
import struct
from collections.abc import Mapping

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

from cockpit_fast._limits import MAX_BINS, MAX_P_VALUES
from cockpit_fast.fsdp import is_sharded

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype):
    """float64 stays float64; every other accepted dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(op, t, name):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"cockpit_fast.{op}: {name} must be a tensor, got {type(t).__name__}")
    if is_sharded(t):  # no sharding strategy: the statistic of a shard is not that of the tensor
        raise ValueError(
            f"cockpit_fast.{op}: {name} is a DTensor (placements {tuple(t.placements)}): the op computes on plain "
            f"tensors; pass {name}.full_tensor(), or {name}.to_local() for this rank's shard alone"
        )


def _is_0d_tensor(value, kinds):
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and (
        kinds == "integer" and not value.dtype.is_floating_point and not value.dtype.is_complex
        or kinds == "real" and not value.dtype.is_complex
    )


def _as_integer(value):
    """``value`` as an int if it is a Python or NumPy integer or a 0-d integer tensor (never a
    bool), else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and not _is_0d_tensor(value, "integer")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_count(op, value, name):
    """``value`` as a positive int (see the module's rules)."""
    count = _as_integer(value)
    if count is None or count <= 0:
        raise ValueError(f"cockpit_fast.{op}: {name} must be a positive integer, got {value!r}")
    return count


def as_number(op, value, name):
    """``value`` as a float (see the module's rules)."""
    if type(value) is float and not torch.compiler.is_compiling():  # (the engine's every call: skip the checks below)
        return value
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or _is_0d_tensor(value, "real")):
        raise ValueError(f"cockpit_fast.{op}: {name} must be a real number, got {value!r}")
    return guard_scalar(float(value))  # under Dynamo, float() of a symbolic number stays symbolic


def as_pair(op, value, name, what):
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"cockpit_fast.{op}: {name} must be a pair {what}, got {value!r}")
    return value


def check_grad(op, g):
    check_tensor(op, g, "g")
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
    check_tensor(op, other, name)
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


def check_directions(op, g, directions):
    """``directions`` (k, *g.shape[1:]), k >= 0: each one a companion of ``g``."""
    check_tensor(op, directions, "directions")
    if directions.device != g.device:
        raise ValueError(f"cockpit_fast.{op}: g is on {g.device} but directions is on {directions.device}")
    if directions.dtype != g.dtype:
        raise ValueError(f"cockpit_fast.{op}: g is {g.dtype} but directions is {directions.dtype}")
    if directions.dim() != g.dim() or tuple(directions.shape[1:]) != tuple(g.shape[1:]):
        expected = ", ".join(["k", *map(str, g.shape[1:])]) + ("," if g.dim() == 1 else "")
        raise ValueError(
            f"cockpit_fast.{op}: directions must have shape (k, *g.shape[1:]) = ({expected}), "
            f"got {tuple(directions.shape)}"
        )


def check_factor_pair(op, left, right, dims, layout):
    """Two factors of per-sample gradients: ``dims``-d (``layout`` names the dimensions), float,
    on one device in one dtype."""
    for name, t in (("left", left), ("right", right)):
        check_tensor(op, t, name)
        if t.dim() != dims:
            raise ValueError(f"cockpit_fast.{op}: {name} must be a {dims}-d {layout} tensor, got a {t.dim()}-d tensor")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"cockpit_fast.{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
    if right.device != left.device:
        raise ValueError(f"cockpit_fast.{op}: left is on {left.device} but right is on {right.device}")
    if right.dtype != left.dtype:
        raise ValueError(f"cockpit_fast.{op}: left is {left.dtype} but right is {right.dtype}")


def check_factors(op, left, right, scale):
    """Factors (N, p) and (N, q) of per-sample outer products: 2-d, float, same N, dtype, device."""
    check_factor_pair(op, left, right, 2, "(N, features)")
    if right.shape[0] != left.shape[0]:
        raise ValueError(
            f"cockpit_fast.{op}: left and right must have the same number of samples, "
            f"got {left.shape[0]} and {right.shape[0]}"
        )
    return check_scale(op, scale, left.dtype)


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


def check_range(op, range, bins, dtype, axis=""):
    """``(lo, hi)``: finite, ordered bounds whose bins can be computed in ``dtype``'s accumulation
    type: a range fine in double can overflow (span * bins) or round to nothing (the bin width)
    in float32."""
    lo, hi = as_pair(op, range, f"{axis}range", "(lo, hi)")
    lo, hi = as_number(op, lo, f"{axis}range's lo"), as_number(op, hi, f"{axis}range's hi")
    # Bounds checked once for an op, bins and dtype (not where traced: the numbers may be symbolic).
    key = (op, lo, hi, bins, dtype, axis)
    if torch.compiler.is_compiling() or key not in _CHECKED_BOUNDS:
        _check_bounds(op, lo, hi, bins, dtype, axis)
        if not torch.compiler.is_compiling() and len(_CHECKED_BOUNDS) < 64:
            _CHECKED_BOUNDS.add(key)
    return lo, hi


_CHECKED_BOUNDS = set()


def _check_bounds(op, lo, hi, bins, dtype, axis):
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


def check_scale(op, scale, dtype, name="scale"):
    """``scale`` multiplies every value in ``dtype``'s accumulation type: it must be finite there."""
    scale = as_number(op, scale, name)
    rounded, precision = _accumulated(dtype)
    if not math.isfinite(rounded(scale)):
        raise ValueError(
            f"cockpit_fast.{op}: {name} must be finite in {precision}, the precision it multiplies in, "
            f"got {scale}"
        )
    return scale


def check_p_values(op, p_values, dtype):
    """At most MAX_P_VALUES values, finite and > 0 in ``dtype``'s accumulation type."""
    if not isinstance(p_values, (tuple, list)):
        raise ValueError(f"cockpit_fast.{op}: p_values must be a tuple or list of numbers, got {p_values!r}")
    rounded, precision = _accumulated(dtype)
    if len(p_values) > MAX_P_VALUES:
        raise ValueError(
            f"cockpit_fast.{op}: at most {MAX_P_VALUES} p values per call, got {len(p_values)}"
        )
    p_values = [as_number(op, p, "a p value") for p in p_values]
    for p in p_values:
        if not (math.isfinite(rounded(p)) and rounded(p) > 0):
            raise ValueError(
                f"cockpit_fast.{op}: p values must be finite and > 0 in {precision} (use the "
                f"max_abs column for p = inf), got {p}"
            )
    return p_values


# One normaliser per op, returning its checked arguments: used by the wrappers before they
# dispatch, by the reference twins and by the fake kernels alike.


def grad_args(op, g, scale):
    check_grad(op, g)
    return check_scale(op, scale, g.dtype)


def binning_1d(op, bins, range, dtype):
    """``bins, lo, hi`` of a 1D histogram of ``dtype`` values, checked."""
    bins = as_count(op, bins, "bins")
    check_cells(op, bins)
    return (bins, *check_range(op, range, bins, dtype))


def binning_2d(op, bins, range, dtype):
    """``(xbins, ybins), (xlo, xhi), (ylo, yhi)`` of a 2D histogram of ``dtype`` values, checked."""
    xbins, ybins = as_pair(op, bins, "bins", "(xbins, ybins)")
    xbins, ybins = as_count(op, xbins, "x bins"), as_count(op, ybins, "y bins")
    check_cells(op, xbins * ybins)
    xrange, yrange = as_pair(op, range, "range", "((xlo, xhi), (ylo, yhi))")
    return (xbins, ybins), check_range(op, xrange, xbins, dtype, "x "), check_range(op, yrange, ybins, dtype, "y ")


def hist1d_args(g, bins, range, scale):
    scale = grad_args("hist1d", g, scale)
    return (*binning_1d("hist1d", bins, range, g.dtype), scale)


def hist2d_args(g, param, bins, range, scale):
    scale = grad_args("hist2d", g, scale)
    check_companion("hist2d", g, param, "param")
    return (*binning_2d("hist2d", bins, range, g.dtype), scale)


def batch_dot_args(g, direction, scale):
    scale = grad_args("batch_dot", g, scale)
    check_companion("batch_dot", g, direction, "direction")
    return scale


def hist1d_batch_l2_batch_dots_args(g, directions, bins, range, hist_scale, scale):
    op = "hist1d_batch_l2_batch_dots"
    scale = grad_args(op, g, scale)
    hist_scale = check_scale(op, hist_scale, g.dtype, "hist_scale")
    check_directions(op, g, directions)
    return (*binning_1d(op, bins, range, g.dtype), hist_scale, scale)


def factored_hist1d_batch_l2_batch_dots_args(left, right, directions, bins, range, hist_scale, scale):
    """Factors left (N, T, p) and right (N, T, q) of G[n] = left[n]^T right[n]; directions (k, p, q)."""
    op = "factored_hist1d_batch_l2_batch_dots"
    check_factor_pair(op, left, right, 3, "(N, T, features)")
    if tuple(right.shape[:2]) != tuple(left.shape[:2]):
        raise ValueError(
            f"cockpit_fast.{op}: left and right must have the same (N, T), got {list(left.shape[:2])} and {list(right.shape[:2])}"
        )
    scale = check_scale(op, scale, left.dtype)
    hist_scale = check_scale(op, hist_scale, left.dtype, "hist_scale")
    check_tensor(op, directions, "directions")
    if directions.device != left.device:
        raise ValueError(f"cockpit_fast.{op}: left is on {left.device} but directions is on {directions.device}")
    if directions.dtype != left.dtype:
        raise ValueError(f"cockpit_fast.{op}: left is {left.dtype} but directions is {directions.dtype}")
    p, q = left.shape[2], right.shape[2]
    if directions.dim() != 3 or tuple(directions.shape[1:]) != (p, q):
        raise ValueError(
            f"cockpit_fast.{op}: directions must have shape (k, left.shape[2], right.shape[2]) = (k, {p}, {q}), "
            f"got {list(directions.shape)}"
        )
    return (*binning_1d(op, bins, range, left.dtype), hist_scale, scale)


def per_sample_stats_args(g, scale, p_values):
    scale = grad_args("per_sample_stats", g, scale)
    return scale, check_p_values("per_sample_stats", p_values, g.dtype)


def outer_hist1d_args(left, right, bins, range, scale):
    scale = check_factors("outer_hist1d", left, right, scale)
    return (*binning_1d("outer_hist1d", bins, range, left.dtype), scale)


def outer_hist2d_args(left, right, param, bins, range, scale):
    scale = check_factors("outer_hist2d", left, right, scale)
    check_tensor("outer_hist2d", param, "param")
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


def _given(value):
    """What a user handed in, for an error message: its type, and its value where that is short."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    kind = type(value).__qualname__
    if type(value).__module__ != "builtins":
        kind = f"{type(value).__module__}.{kind}"
    return f"{kind} {value!r}" if isinstance(value, (numbers.Number, str)) else kind


def _check_info_tensor(info, name, what, shape, fits):
    """``info[name]``, where handed in, must be a tensor holding ``what``, of a ``shape`` it ``fits``."""
    if name not in info:
        return
    value = info[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"info['{name}'] must be {what} as a tensor, got {_given(value)}")
    if not fits(value):
        raise ValueError(f"info['{name}'] must be {what}, a tensor of {shape}, got {_given(value)}")


def check_info(info):
    """The ``info`` of ``cockpit(global_step, info=...)``: ``None`` or a dict whose entries the
    quantities read have the types they read. Entries of other names are left to the user's own
    quantities.

    * ``loss``: the mini-batch loss, a floating-point tensor of one element (0-d or not);
    * ``batch_size``: a Python or NumPy integer or a 0-d integer tensor, at least 0;
    * ``individual_losses``: every sample's loss, a floating-point tensor of shape (N,) or (N, 1);
    * ``optimizer``: a ``torch.optim.Optimizer``;
    * ``grad_scaler``: a ``torch.amp.GradScaler`` (anything with ``get_scale()``) whose scaled
      loss the backward pass runs on.

    Raises:
        TypeError: If ``info`` or one of these entries has another type.
        ValueError: If one of these entries has another shape or a negative batch size.
    """
    if info is None:
        return
    if not isinstance(info, Mapping):
        raise TypeError(
            "info must be a dict with entries such as 'loss', 'individual_losses', 'batch_size' and "
            f"'optimizer', got {_given(info)}"
        )
    _check_info_tensor(
        info, "loss", "the scalar mini-batch loss (the one backward() is called on)", "one floating-point element",
        lambda loss: loss.numel() == 1 and loss.is_floating_point(),
    )
    if "batch_size" in info:
        batch_size = _as_integer(info["batch_size"])
        if batch_size is None:
            raise TypeError(
                "info['batch_size'] must be an integer (int, NumPy integer or 0-d integer tensor), "
                f"got {_given(info['batch_size'])}"
            )
        if batch_size < 0:
            raise ValueError(f"info['batch_size'] must be at least 0, got {batch_size}")
    _check_info_tensor(
        info, "individual_losses", "every sample's loss (the loss function with reduction='none')",
        "floating point, of shape (N,) or (N, 1)",
        lambda losses: losses.is_floating_point() and (losses.dim() == 1 or (losses.dim() == 2 and losses.shape[1] == 1)),
    )
    if "optimizer" in info and not isinstance(info["optimizer"], torch.optim.Optimizer):
        raise TypeError(f"info['optimizer'] must be a torch.optim.Optimizer, got {_given(info['optimizer'])}")
    if "grad_scaler" in info and not callable(getattr(info["grad_scaler"], "get_scale", None)):
        raise TypeError(f"info['grad_scaler'] must be a torch.amp.GradScaler, got {_given(info['grad_scaler'])}")
