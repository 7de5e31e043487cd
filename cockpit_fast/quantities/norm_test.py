"""Norm test for the mini-batch size."""

from cockpit_fast.statistics import BATCH_L2
from cockpit_fast.quantities.quantity import FastQuantity, samples_for_variance


class NormTest(FastQuantity):
    """Tracks the largest θ for which the norm test (Byrd et al., 2012, eq. 3.9) passes.

    With N samples, individual gradients ∇ℓ_n and mini-batch gradient g:
    θ = sqrt(Var_1 / (N ||g||²)), Var_1 = (sum_n ||∇ℓ_n||² − N ||g||²) / (N − 1).
    """

    def statistics(self, ctx):
        return {BATCH_L2} if self.should_compute(ctx.global_step) else set()

    def _compute(self, ctx):
        batch_l2 = ctx.summed(BATCH_L2)  # ||∇ℓ_n / N||²
        n = samples_for_variance(self, batch_l2, ctx.global_step)
        if n is None:
            return None
        grad_l2_squared = ctx.grad_l2_squared()
        variance_l1 = (n**2 * batch_l2.sum() - n * grad_l2_squared) / (n - 1)
        return (variance_l1 / n / grad_l2_squared).sqrt()
