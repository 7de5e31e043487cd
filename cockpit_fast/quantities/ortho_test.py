"""Orthogonality test for the mini-batch size."""

from cockpit_fast.statistics import BATCH_L2, DOT_MEAN_GRAD
from cockpit_fast.quantities.quantity import FastQuantity, samples_for_variance


class OrthoTest(FastQuantity):
    """Tracks the largest ν for which the orthogonality test (Bollapragada et al., 2017) passes.

    It measures the variance of the individual gradients' components orthogonal to the
    mini-batch gradient g: ν = sqrt(V / (N ||g||²)) with
    V = (sum_n ||∇ℓ_n||² − sum_n <∇ℓ_n, g>² / ||g||²) / (N − 1).
    """

    def statistics(self, ctx):
        return {BATCH_L2, DOT_MEAN_GRAD} if self.should_compute(ctx.global_step) else set()

    def _compute(self, ctx):
        batch_l2 = ctx.summed(BATCH_L2)  # ||∇ℓ_n / N||²
        n = samples_for_variance(self, batch_l2, ctx.global_step)
        if n is None:
            return None
        projections = n * ctx.summed(DOT_MEAN_GRAD)
        grad_l2_squared = ctx.grad_l2_squared()
        variance = (n**2 * batch_l2.sum() - (projections**2 / grad_l2_squared).sum()) / (n - 1)
        return (variance / n / grad_l2_squared).sqrt()
