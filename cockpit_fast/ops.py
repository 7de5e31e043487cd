"""Typed wrappers around the fused ``cockpit_fast`` custom ops, with their fake kernels.

Every op takes per-sample gradients ``g`` of shape ``(N, *param_shape)`` as BackPACK's ``BatchGrad``
stores them, and a ``scale`` that multiplies the values before the statistic (Cockpit passes N to
undo the 1/N of a mean-reduced loss). Sums come back in the accumulation dtype: float64 for
float64 input, float32 for float32, float16 and bfloat16 (squares of float16 overflow early).

The ops are statistics with no gradient: their results never require grad, whatever the inputs.
Arguments are checked by one normaliser per op in :mod:`cockpit_fast._validation`, which the
wrappers call before the fused op, the pure-torch twins before computing and the fake kernels
before tracing: every route accepts the same arguments and rejects bad ones with the same
``ValueError``.

When the C++ extension is not built, or ``COCKPIT_FAST_REFERENCE=1`` is set, the wrappers run the
pure-torch twins in :mod:`cockpit_fast.reference` and warn once; ``has_extension()`` tells which.
"""

import glob
import importlib
import importlib.machinery
import os
import warnings

import torch

from cockpit_fast import _validation as v
from cockpit_fast import reference
from cockpit_fast import stats as columns

_FORCE_REFERENCE_ENV = "COCKPIT_FAST_REFERENCE"
_HOW_TO_BUILD = (
    "Build it against the installed torch: `pip install --no-build-isolation .` in the source tree, "
    "or `python setup.py build_ext --inplace` for a checkout used in place"
)


def _load_extension():
    if os.environ.get(_FORCE_REFERENCE_ENV, "") not in ("", "0"):
        return None, f"{_FORCE_REFERENCE_ENV} is set"
    try:
        importlib.import_module("cockpit_fast._C")  # importing it registers the ops
    except ImportError as error:
        return None, _why_not_loaded(error, glob.glob(os.path.join(os.path.dirname(__file__), "_C.*")))
    return torch.ops.cockpit_fast, None


def _why_not_loaded(error, built_files):
    """What went wrong when ``cockpit_fast._C`` did not import, and how to build it."""
    names = [os.path.basename(path) for path in built_files]
    if not names:
        what = f"the C++ extension cockpit_fast._C is not built (no _C.* in {os.path.dirname(__file__)})"
    elif not {"_C" + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES} & set(names):
        what = f"the C++ extension cockpit_fast._C was built for another Python ({', '.join(names)})"
    elif "undefined symbol" in str(error):  # torch's C++ symbols differ between its versions
        what = (
            f"the C++ extension cockpit_fast._C was built for another version of torch than the installed "
            f"{torch.__version__} ({error})"
        )
    else:
        what = f"the C++ extension cockpit_fast._C failed to load ({error})"
    return f"{what}. {_HOW_TO_BUILD}"


_OPS, _WHY_REFERENCE = _load_extension()
_warned = False


def has_extension():
    """True when the fused C++ (and, if built so, CUDA) kernels are in use."""
    return _OPS is not None


def has_cuda_kernels():
    """True when the extension was compiled with its CUDA kernels."""
    return _OPS is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "cockpit_fast::hist1d", "CUDA"
    )


@torch.compiler.assume_constant_result  # under torch.compile it runs (and warns) as in eager
def _use_reference():
    global _warned
    if _OPS is not None:
        return False
    if not _warned:
        warnings.warn(
            f"cockpit_fast runs its pure-torch reference ops, which are much slower: {_WHY_REFERENCE}.",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned = True
    return True


def batch_l2(g, scale=1.0):
    """Per-sample squared norms sum_j (scale * g[n, j])^2, shape (N,)."""
    if _use_reference():
        return reference.batch_l2(g, scale)
    return _OPS.batch_l2.default(g, v.grad_args("batch_l2", g, scale))


def sum_grad_squared(g, scale=1.0):
    """sum_n (scale * g[n])^2, shape g.shape[1:]."""
    if _use_reference():
        return reference.sum_grad_squared(g, scale)
    return _OPS.sum_grad_squared.default(g, v.grad_args("sum_grad_squared", g, scale))


def batch_l2_and_sum_grad_squared(g, scale=1.0):
    """``(batch_l2(g, scale), sum_grad_squared(g, scale))`` from one pass over g."""
    if _use_reference():
        return reference.batch_l2_and_sum_grad_squared(g, scale)
    return _OPS.batch_l2_and_sum_grad_squared.default(g, v.grad_args("batch_l2_and_sum_grad_squared", g, scale))


def hist1d(g, bins=100, range=(-2.0, 2.0), scale=1.0):
    """int64 counts, shape (bins,), of scale * g clamped into ``range`` and binned like torch.histc.

    Equal-width bins, the last one closed; NaN is never counted, +-inf lands in the outer bins.
    """
    if _use_reference():
        return reference.hist1d(g, bins, range, scale)
    return _OPS.hist1d.default(g, *v.hist1d_args(g, bins, range, scale))


def hist2d(g, param, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), scale=1.0):
    """int64 counts, shape bins, over pairs (scale * g[n, j], param[j]) for all n, j.

    Both coordinates are clamped to the centres of their outer bins, as Cockpit's GradHist2d does;
    ``param`` is broadcast over N inside the kernel. A pair with a NaN coordinate is not counted.
    """
    if _use_reference():
        return reference.hist2d(g, param, bins, range, scale)
    (xbins, ybins), (xlo, xhi), (ylo, yhi), scale = v.hist2d_args(g, param, bins, range, scale)
    return _OPS.hist2d.default(g, param, xbins, ybins, xlo, xhi, ylo, yhi, scale)


def batch_dot(g, direction, scale=1.0):
    """scale * <g[n], direction> for every sample, shape (N,)."""
    if _use_reference():
        return reference.batch_dot(g, direction, scale)
    return _OPS.batch_dot.default(g, direction, v.batch_dot_args(g, direction, scale))


def hist1d_batch_l2_batch_dots(g, directions, bins=100, range=(-2.0, 2.0), hist_scale=1.0, scale=1.0):
    """``(hist1d(g, bins, range, hist_scale), batch_l2(g, scale), dots)`` from one pass over g.

    ``directions`` has shape (k, *g.shape[1:]), k >= 0; ``dots[:, i]`` is
    ``batch_dot(g, directions[i], scale)``, shape (N, k). The histogram has its own scale, as
    Cockpit bins N * g but sums g. On the CPU every result is the separate op's bit for bit; on
    CUDA the counts are, and the sums agree to rounding.
    """
    if _use_reference():
        return reference.hist1d_batch_l2_batch_dots(g, directions, bins, range, hist_scale, scale)
    return _OPS.hist1d_batch_l2_batch_dots.default(
        g, directions, *v.hist1d_batch_l2_batch_dots_args(g, directions, bins, range, hist_scale, scale)
    )


def factored_hist1d_batch_l2_batch_dots(left, right, directions, bins=100, range=(-2.0, 2.0), hist_scale=1.0, scale=1.0):
    """:func:`hist1d_batch_l2_batch_dots` of the per-sample gradients ``G[n] = left[n]^T right[n]``.

    ``left`` (N, T, p) and ``right`` (N, T, q) are a weight gradient's factors summed over T
    positions (a Linear layer's output gradients and inputs); ``directions`` has shape (k, p, q).
    Returns the histogram of ``hist_scale * G``, the squared norms of ``scale * G[n]``, and (N, k)
    dots against each direction, as ``hist1d_batch_l2_batch_dots(torch.bmm(left.transpose(1, 2),
    right), directions, ...)`` gives them.

    On the CPU the (N, p, q) chunk is never written to memory: each task forms a row block of one
    G[n] with a GEMM into a small buffer and bins and sums it while it is in cache. The GEMM rounds
    its own way: sums agree with the formed route's to rounding, and counts differ only for values
    within rounding of a bin edge. On CUDA the kernel forms the chunk with one batched GEMM and
    runs :func:`hist1d_batch_l2_batch_dots`'s kernel over it (device memory is fast enough).
    """
    if _use_reference():
        return reference.factored_hist1d_batch_l2_batch_dots(left, right, directions, bins, range, hist_scale, scale)
    args = v.factored_hist1d_batch_l2_batch_dots_args(left, right, directions, bins, range, hist_scale, scale)
    return _OPS.factored_hist1d_batch_l2_batch_dots.default(left, right, directions, *args)


def per_sample_stats(g, scale=1.0, p_values=()):
    """Rows of max, min, mean, M2, max|x|, sum|x|^p per sample; see :mod:`cockpit_fast.stats`."""
    if _use_reference():
        return reference.per_sample_stats(g, scale, p_values)
    return _OPS.per_sample_stats.default(g, *v.per_sample_stats_args(g, scale, p_values))


def outer_hist1d(left, right, bins=100, range=(-2.0, 2.0), scale=1.0):
    """:func:`hist1d` of the per-sample outer products ``left[n] right[n]^T``, never formed.

    ``left`` (N, p) and ``right`` (N, q) are the factors of a per-sample gradient, e.g. a Linear
    layer's output gradient and input. Each product is rounded in the input dtype, as the
    materialised gradient is, so the counts equal ``hist1d`` of the formed products exactly.
    """
    if _use_reference():
        return reference.outer_hist1d(left, right, bins, range, scale)
    return _OPS.outer_hist1d.default(left, right, *v.outer_hist1d_args(left, right, bins, range, scale))


def outer_hist2d(left, right, param, bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), scale=1.0):
    """:func:`hist2d` over pairs (scale * left[n, i] * right[n, j], param[i, j]), products never formed.

    ``param`` has shape (p, q). Counts equal ``hist2d`` of the formed products exactly.
    """
    if _use_reference():
        return reference.outer_hist2d(left, right, param, bins, range, scale)
    (xbins, ybins), (xlo, xhi), (ylo, yhi), scale = v.outer_hist2d_args(left, right, param, bins, range, scale)
    return _OPS.outer_hist2d.default(left, right, param, xbins, ybins, xlo, xhi, ylo, yhi, scale)


def _register_fake_kernels():
    """Shape-only twins so the ops trace under torch.compile(fullgraph=True) and FakeTensor."""

    def acc(g, *shape):
        return g.new_empty(shape, dtype=v.accumulation_dtype(g.dtype))

    @torch.library.register_fake("cockpit_fast::batch_l2")
    def _(g, scale):
        v.grad_args("batch_l2", g, scale)
        return acc(g, g.shape[0])

    @torch.library.register_fake("cockpit_fast::sum_grad_squared")
    def _(g, scale):
        v.grad_args("sum_grad_squared", g, scale)
        return acc(g, *g.shape[1:])

    @torch.library.register_fake("cockpit_fast::batch_l2_and_sum_grad_squared")
    def _(g, scale):
        v.grad_args("batch_l2_and_sum_grad_squared", g, scale)
        return acc(g, g.shape[0]), acc(g, *g.shape[1:])

    @torch.library.register_fake("cockpit_fast::hist1d")
    def _(g, bins, lo, hi, scale):
        v.hist1d_args(g, bins, (lo, hi), scale)
        return g.new_empty((bins,), dtype=torch.int64)

    @torch.library.register_fake("cockpit_fast::hist2d")
    def _(g, param, xbins, ybins, xlo, xhi, ylo, yhi, scale):
        v.hist2d_args(g, param, (xbins, ybins), ((xlo, xhi), (ylo, yhi)), scale)
        return g.new_empty((xbins, ybins), dtype=torch.int64)

    @torch.library.register_fake("cockpit_fast::batch_dot")
    def _(g, direction, scale):
        v.batch_dot_args(g, direction, scale)
        return acc(g, g.shape[0])

    @torch.library.register_fake("cockpit_fast::hist1d_batch_l2_batch_dots")
    def _(g, directions, bins, lo, hi, hist_scale, scale):
        v.hist1d_batch_l2_batch_dots_args(g, directions, bins, (lo, hi), hist_scale, scale)
        return g.new_empty((bins,), dtype=torch.int64), acc(g, g.shape[0]), acc(g, g.shape[0], directions.shape[0])

    @torch.library.register_fake("cockpit_fast::factored_hist1d_batch_l2_batch_dots")
    def _(left, right, directions, bins, lo, hi, hist_scale, scale):
        v.factored_hist1d_batch_l2_batch_dots_args(left, right, directions, bins, (lo, hi), hist_scale, scale)
        n, k = left.shape[0], directions.shape[0]
        return left.new_empty((bins,), dtype=torch.int64), acc(left, n), acc(left, n, k)

    @torch.library.register_fake("cockpit_fast::per_sample_stats")
    def _(g, scale, p_values):
        v.per_sample_stats_args(g, scale, p_values)
        return acc(g, g.shape[0], columns.P0 + len(p_values))

    @torch.library.register_fake("cockpit_fast::outer_hist1d")
    def _(left, right, bins, lo, hi, scale):
        v.outer_hist1d_args(left, right, bins, (lo, hi), scale)
        return left.new_empty((bins,), dtype=torch.int64)

    @torch.library.register_fake("cockpit_fast::outer_hist2d")
    def _(left, right, param, xbins, ybins, xlo, xhi, ylo, yhi, scale):
        v.outer_hist2d_args(left, right, param, (xbins, ybins), ((xlo, xhi), (ylo, yhi)), scale)
        return left.new_empty((xbins, ybins), dtype=torch.int64)


if _OPS is not None:
    _register_fake_kernels()
