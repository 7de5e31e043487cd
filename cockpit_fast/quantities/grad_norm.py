"""Norm of the mini-batch gradient."""

from cockpit_fast.fsdp import norms
from cockpit_fast.quantities.quantity import FastQuantity


class GradNorm(FastQuantity):
    """Tracks the ℓ₂ norm of each parameter's mini-batch gradient (a list, one per parameter)."""

    NEEDS_CALLS = False

    def _compute(self, ctx):
        return norms(ctx.grads())
