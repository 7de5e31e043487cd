"""CABS batch size suggestion."""

from cockpit_fast.statistics import SUM_GRAD_SQUARED, flatten
from cockpit_fast.quantities._optim import require_plain_sgd, single_learning_rate
from cockpit_fast.quantities.quantity import FastQuantity


class CABS(FastQuantity):
    """Tracks the batch size that CABS (Balles et al., 2017, eq. 22) suggests, for plain SGD.

    lr · tr(Σ) / L, with Σ the gradient covariance estimated from the individual gradients and L
    the mini-batch loss. Needs ``info`` entries ``optimizer``, ``batch_size`` and ``loss``.
    """

    def statistics(self, ctx):
        return {SUM_GRAD_SQUARED} if self.should_compute(ctx.global_step) else set()

    def _compute(self, ctx):
        optimizer = ctx.info("optimizer", self)
        require_plain_sgd(optimizer, self)
        lr = single_learning_rate(optimizer)
        b = ctx.info("batch_size", self)
        grad_squared = ctx.flat_grad() ** 2
        second_moment = b**2 * flatten(ctx.per_param(SUM_GRAD_SQUARED))  # sum_n (∇ℓ_n)²
        return lr * (second_moment - b * grad_squared).sum() / (b * ctx.loss(self))
