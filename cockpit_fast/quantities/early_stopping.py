"""Evidence-based early stopping criterion."""

from cockpit_fast.statistics import SUM_GRAD_SQUARED, flatten
from cockpit_fast.quantities._optim import require_plain_sgd
from cockpit_fast.quantities.quantity import FastQuantity


class EarlyStopping(FastQuantity):
    """Tracks the EB criterion (Mahsereci et al., 2017, eq. 7); training should stop above 0.

    1 − B · mean_j g_j² / (s_j² + ε) with s² the per-element sample variance of the individual
    gradients. Only defined for plain SGD; needs ``info`` entries ``optimizer`` and
    ``batch_size``.

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
        require_plain_sgd(ctx.info("optimizer", self), self)
        b = ctx.info("batch_size", self)
        grad_squared = ctx.flat_grad() ** 2
        second_moment = b**2 * flatten(ctx.per_param(SUM_GRAD_SQUARED))
        variance = (second_moment - b * grad_squared) / (b - 1)
        return 1 - b * (grad_squared / (variance + self._epsilon)).mean()
