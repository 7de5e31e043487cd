"""Norm of the mini-batch gradient."""

import torch

from cockpit_fast.quantities.quantity import FastQuantity


class GradNorm(FastQuantity):
    """Tracks the ℓ₂ norm of each parameter's mini-batch gradient (a list, one per parameter)."""

    NEEDS_CALLS = False

    def _compute(self, ctx):
        return [torch.linalg.vector_norm(g) for g in ctx.grads()]
