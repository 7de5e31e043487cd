"""Largest Hessian eigenvalue."""

import warnings

import numpy as np
import torch

from cockpit_fast._optional import require
from cockpit_fast.distributed import global_mean, same_everywhere
from cockpit_fast.quantities.quantity import FastQuantity
from cockpit_fast.statistics import unreached


class HessMaxEV(FastQuantity):
    """Tracks the largest eigenvalue of the loss Hessian, by power iteration on Hessian-vector
    products (needs ``loss.backward(create_graph=cockpit.create_graph(step))``).

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        use_power (bool, optional): Power iteration on the device (default); else SciPy's
            Lanczos ``eigsh`` through host transfers.
    """

    NEEDS_CALLS = False
    RUNS_AFTER_CLEANUP = True
    MAX_ITERATIONS = 100
    RTOL = 1e-3
    ATOL = 1e-6

    def __init__(self, track_schedule, verbose=False, use_power=True):
        super().__init__(track_schedule, verbose=verbose)
        self._use_power = use_power
        if not use_power:  # checked now, not at the first tracked step
            require("scipy.sparse.linalg", "scipy", "HessMaxEV(use_power=False)")

    def create_graph(self, global_step):
        return self.should_compute(global_step)

    def _compute(self, ctx):
        grads = ctx.differentiable_grads()
        missing = unreached(ctx.params) if ctx.group is None else []  # (ranks differ)
        if missing:
            raise ValueError(
                f"HessMaxEV: no backward pass of step {ctx.global_step} reached tracked parameters {missing} (an "
                "expert no token chose, a layer the forward pass skipped): track it over parameters every step uses"
            )
        if any(g is None for g in grads):
            raise RuntimeError("HessMaxEV needs loss.backward(create_graph=cockpit.create_graph(global_step))")

        def hvp(vectors):
            # Under torch.distributed: each rank's product, combined into the global batch's.
            return global_mean(torch.autograd.grad(grads, ctx.params, grad_outputs=vectors, retain_graph=True), ctx)

        if self._use_power:
            start = same_everywhere([torch.rand_like(p) for p in ctx.params], ctx.group)
            return np.float64(self._power_iteration(hvp, start).item())
        # Processes must iterate in step: one start for all (ARPACK's own otherwise).
        start = None if ctx.group is None else same_everywhere([torch.rand_like(p) for p in ctx.params], ctx.group)
        return np.float64(self._lanczos(hvp, ctx.params, start))

    def _power_iteration(self, hvp, start):
        """Largest eigenvalue from the random vectors ``start``; warns if it has not converged."""

        def normalized(vectors):
            norm = torch.sqrt(sum((v**2).sum() for v in vectors))
            return [v / norm for v in vectors]

        vectors = normalized(start)
        eigenvalue = torch.tensor([float("inf")], dtype=start[0].dtype, device=start[0].device)
        for _ in range(self.MAX_ITERATIONS):
            products = hvp(vectors)
            estimate = sum((v * hv).sum() for v, hv in zip(vectors, products))
            vectors = normalized([hv.detach() for hv in products])
            if torch.allclose(eigenvalue, estimate, rtol=self.RTOL, atol=self.ATOL):
                return estimate
            eigenvalue = estimate
        warnings.warn(f"Exceeded maximum number of {self.MAX_ITERATIONS} iterations")
        return eigenvalue

    @staticmethod
    def _lanczos(hvp, params, start=None):
        linalg = require("scipy.sparse.linalg", "scipy", "HessMaxEV(use_power=False)")
        LinearOperator, eigsh = linalg.LinearOperator, linalg.eigsh

        shapes = [p.shape for p in params]
        sizes = [p.numel() for p in params]
        device = params[0].device

        def matvec(vector):
            chunks = torch.from_numpy(vector).to(device).split(sizes)
            products = hvp([c.reshape(s).to(p.dtype) for c, s, p in zip(chunks, shapes, params)])
            return torch.cat([hv.detach().flatten() for hv in products]).cpu().numpy()

        dim = sum(sizes)
        operator = LinearOperator((dim, dim), matvec=matvec, dtype=np.float32)
        v0 = None if start is None else torch.cat([s.flatten() for s in start]).cpu().double().numpy()
        return eigsh(operator, k=1, which="LA", v0=v0, return_eigenvectors=False)[0]
