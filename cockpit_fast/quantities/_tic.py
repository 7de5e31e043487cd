"""What the two Takeuchi information criterion quantities share."""

from cockpit_fast.statistics import SUM_GRAD_SQUARED, flatten
from cockpit_fast.quantities._curvature import check_curvature, curvature_extension, diagonal_curvature
from cockpit_fast.quantities.quantity import FastQuantity


class TIC(FastQuantity):
    """Base of the TIC approximations (Thomas et al., 2019): gradient second moment over curvature.

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        curvature (str, optional): ``"diag_h"`` (default), ``"diag_ggn_exact"`` or
            ``"diag_ggn_mc"``.
        epsilon (float, optional): Keeps the denominator positive. Defaults to 1e-7.

    Raises:
        KeyError: For an unknown curvature, listing the options.
    """

    def __init__(self, track_schedule, verbose=False, curvature="diag_h", epsilon=1e-7):
        super().__init__(track_schedule, verbose=verbose)
        self._curvature = check_curvature(curvature)
        self._epsilon = epsilon

    def statistics(self, ctx):
        return {SUM_GRAD_SQUARED} if self.should_compute(ctx.global_step) else set()

    def extensions(self, global_step):
        return [curvature_extension(self._curvature)] if self.should_compute(global_step) else []

    def _second_moment_and_curvature(self, ctx):
        """B · sum_n grad_batch_n² and the diagonal curvature, both flattened."""
        batch_size = ctx.info("batch_size", self)
        second_moment = batch_size * flatten(ctx.per_param(SUM_GRAD_SQUARED))
        return second_moment, flatten(diagonal_curvature(ctx, self._curvature, self))
