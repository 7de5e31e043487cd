"""Inner product test for the mini-batch size."""

from cockpit_fast.statistics import DOT_MEAN_GRAD
from cockpit_fast.quantities.quantity import FastQuantity, samples_for_variance


class InnerTest(FastQuantity):
    """Tracks the largest θ for which the inner product test (Bollapragada et al., 2017) passes.

    With projections π_n = <∇ℓ_n, g> of the individual gradients on the mini-batch gradient g:
    θ = sqrt(Var(π) / (N ||g||⁴)), Var(π) = (sum_n π_n² − N ||g||⁴) / (N − 1).
    """

    def statistics(self, ctx):
        return {DOT_MEAN_GRAD} if self.should_compute(ctx.global_step) else set()

    def _compute(self, ctx):
        projections = ctx.summed(DOT_MEAN_GRAD)  # <∇ℓ_n / N, g>
        n = samples_for_variance(self, projections, ctx.global_step)
        if n is None:
            return None
        projections = n * projections
        grad_l2_squared = ctx.grad_l2_squared()
        variance = ((projections**2).sum() - n * grad_l2_squared**2) / (n - 1)
        return (variance / n / grad_l2_squared**2).sqrt()
