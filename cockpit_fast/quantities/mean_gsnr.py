"""Mean gradient signal-to-noise ratio."""

from cockpit_fast.statistics import SUM_GRAD_SQUARED, flatten
from cockpit_fast.quantities.quantity import FastQuantity


class MeanGSNR(FastQuantity):
    """Tracks the gradient signal-to-noise ratio (Liu et al., 2020) averaged over all elements.

    Per element: g² / (B · sum_n grad_batch_n² − g² + ε) with g the mini-batch gradient.

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        epsilon (float, optional): Keeps the denominator positive. Defaults to 1e-5.
    """

    def __init__(self, track_schedule, verbose=False, epsilon=1e-5):
        super().__init__(track_schedule, verbose=verbose)
        self._epsilon = epsilon

    def statistics(self, ctx):
        return {SUM_GRAD_SQUARED} if self.should_compute(ctx.global_step) else set()

    def _compute(self, ctx):
        grad_squared = ctx.flat_grad() ** 2
        sum_grad_squared = flatten(ctx.per_param(SUM_GRAD_SQUARED))
        batch_size = ctx.info("batch_size", self)
        gsnr = grad_squared / (batch_size * sum_grad_squared - grad_squared + self._epsilon)
        return gsnr.mean()
