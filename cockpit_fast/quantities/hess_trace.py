"""Trace of the Hessian or of a diagonal approximation to it."""

from cockpit_fast.quantities._curvature import check_curvature, curvature_extension, diagonal_curvature
from cockpit_fast.quantities.quantity import FastQuantity


class HessTrace(FastQuantity):
    """Tracks the trace of a diagonal curvature per parameter (a list, one per parameter).

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        curvature (str, optional): ``"diag_h"`` (exact Hessian diagonal, default),
            ``"diag_ggn_exact"`` or ``"diag_ggn_mc"`` (cheapest).

    Raises:
        KeyError: For an unknown curvature, listing the options.
    """

    def __init__(self, track_schedule, verbose=False, curvature="diag_h"):
        super().__init__(track_schedule, verbose=verbose)
        self._curvature = check_curvature(curvature)

    def extensions(self, global_step):
        return [curvature_extension(self._curvature)] if self.should_compute(global_step) else []

    def _compute(self, ctx):
        return [diag.sum() for diag in diagonal_curvature(ctx, self._curvature, self)]
