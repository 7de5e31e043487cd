"""Gradient noise scale (McCandlish et al., 2018)."""

import numbers

import torch

from cockpit_fast.statistics import BATCH_L2
from cockpit_fast.quantities.quantity import FastQuantity, plain_state, restored_state, skip_single_sample, this_process


class GradNoiseScale(FastQuantity):
    """Tracks the simple gradient noise scale B_simple = tr(Σ) / |G|² of McCandlish et al. (2018),
    "An Empirical Model of Large-Batch Training" (appendix A.1, with batch sizes 1 and N).

    With N individual gradients g_n (each sample's own loss) and their mean ḡ (the gradient of
    the mean loss), the unbiased estimates
    ``trace_sigma = sum_n |g_n − ḡ|² / (N − 1) = (sum_n |g_n|² − N |ḡ|²) / (N − 1)`` of tr(Σ) and
    ``grad_sq = |ḡ|² − trace_sigma / N`` of |G|², and ``b_simple = trace_sigma / grad_sq``: from
    the per-sample squared norms (``BATCH_L2``) and the mini-batch gradient, no other per-sample
    pass. Under ``torch.distributed`` they are those of the global batch.

    The output of a tracked step is a dict: ``trace_sigma``, ``grad_sq``, ``b_simple``; the same
    per tracked parameter, in parameter order (``trace_sigma_per_param``, ``grad_sq_per_param``,
    ``b_simple_per_param``: they add up to the totals, the ratios do not); and the smoothed
    ``trace_sigma_ema``, ``grad_sq_ema`` and ``b_simple_ema``, carried across tracked steps.

    ``grad_sq`` is negative when the noise outweighs the mean gradient in this batch, and so is
    ``b_simple``; hence the two estimates are smoothed separately before their ratio is taken
    (as nanoGNS and gns-pytorch do): exponential moving averages started at zero and divided by
    ``1 − decay^t`` after the t-th tracked step, Adam's bias correction of its moments (the first
    step's EMA is that step's value). The correction cancels in ``b_simple_ema``, the ratio of
    the two averages, and matters only for the averages themselves.

    With ``estimator="micro_batches"`` no per-sample gradient is formed: the small batches of
    the appendix's two-batch-size estimator are the step's k micro-batches
    (``tracked.micro_batch``), at the cost of k gradient norms. With B_m samples and mean
    gradient G_m in micro-batch m, B = sum_m B_m and S = sum_m B_m |G_m|² / B, whose expectation
    is |G|² + k tr(Σ) / B, ``trace_sigma = (S − |ḡ|²) B / (k − 1)`` and
    ``grad_sq = |ḡ|² − trace_sigma / B``, both unbiased for any sizes; with micro-batches of
    one sample each they are the per-sample estimates above. Under ``torch.distributed`` it
    reads each process's own micro-batches and gradient.

    A step with one sample (one micro-batch) has no variance estimate: it is skipped (nothing is
    stored, the averages are left as they are) with a warning the first time, so that neither the
    log nor the averages of the later steps carry a NaN.

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        decay (float, optional): Weight of the past in the moving averages, in [0, 1); 0 keeps
            each step's own estimates. Defaults to 0.9.
        estimator (str, optional): ``"per_sample"`` (default): from the individual gradients;
            ``"micro_batches"``: from the micro-batches' gradients.
    """

    ESTIMATORS = ("per_sample", "micro_batches")

    def __init__(self, track_schedule, verbose=False, decay=0.9, estimator="per_sample"):
        super().__init__(track_schedule, verbose=verbose)
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
            raise TypeError(f"GradNoiseScale: decay must be a real number, got {type(decay).__name__}")
        if not 0 <= decay < 1:
            raise ValueError(f"GradNoiseScale: decay must be in [0, 1), got {decay}")
        if estimator not in self.ESTIMATORS:
            raise ValueError(f"GradNoiseScale: estimator must be one of {self.ESTIMATORS}, got {estimator!r}")
        self._estimator = estimator
        self.NEEDS_CALLS = estimator == "per_sample"  # micro-batch norms need no module calls
        self._decay = float(decay)
        self._ema_trace_sigma = 0.0
        self._ema_grad_sq = 0.0
        self._ema_steps = 0

    def statistics(self, ctx):
        return {BATCH_L2} if self.NEEDS_CALLS and self.should_compute(ctx.global_step) else set()

    def reads_micro_batches(self, global_step):
        return not self.NEEDS_CALLS and self.should_compute(global_step)

    def state_dict(self):
        averages = {
            "ema_trace_sigma": self._ema_trace_sigma,
            "ema_grad_sq": self._ema_grad_sq,
            "ema_steps": self._ema_steps,
            "warned_single_sample": self._warned_single_sample,
        }
        # From micro-batches, the averages are of this process's own micro-batches.
        saved = plain_state(averages) if self.NEEDS_CALLS else {key: this_process(v) for key, v in averages.items()}
        return {**super().state_dict(), **saved}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        device = params[0].device  # where the statistics are summed
        self._ema_trace_sigma = restored_state(state["ema_trace_sigma"], device)
        self._ema_grad_sq = restored_state(state["ema_grad_sq"], device)
        self._ema_steps = restored_state(state["ema_steps"])
        self._warned_single_sample = restored_state(state["warned_single_sample"])

    def _compute(self, ctx):
        estimates = self._per_sample(ctx) if self.NEEDS_CALLS else self._from_micro_batches(ctx)
        if estimates is None:
            return skip_single_sample(self, "samples" if self.NEEDS_CALLS else "micro-batches", ctx.global_step)
        trace_sigma, grad_sq = estimates
        total_trace_sigma, total_grad_sq = trace_sigma.sum(), grad_sq.sum()

        self._ema_steps += 1
        self._ema_trace_sigma = self._decay * self._ema_trace_sigma + (1 - self._decay) * total_trace_sigma
        self._ema_grad_sq = self._decay * self._ema_grad_sq + (1 - self._decay) * total_grad_sq
        bias_correction = 1 - self._decay**self._ema_steps
        trace_sigma_ema = self._ema_trace_sigma / bias_correction
        grad_sq_ema = self._ema_grad_sq / bias_correction
        return {
            "trace_sigma": total_trace_sigma,
            "grad_sq": total_grad_sq,
            "b_simple": total_trace_sigma / total_grad_sq,
            "trace_sigma_per_param": list(trace_sigma),
            "grad_sq_per_param": list(grad_sq),
            "b_simple_per_param": list(trace_sigma / grad_sq),
            "trace_sigma_ema": trace_sigma_ema,
            "grad_sq_ema": grad_sq_ema,
            "b_simple_ema": trace_sigma_ema / grad_sq_ema,
        }

    @staticmethod
    def _per_sample(ctx):
        """tr(Σ) and |G|² per parameter from the individual gradients; None for one sample."""
        batch_l2 = torch.stack(ctx.per_param(BATCH_L2))  # (P, N): ||∇ℓ_n / N||² per parameter
        n = batch_l2.shape[1]
        if n < 2:
            return None
        mean_sq = torch.stack([(g**2).sum() for g in ctx.grads()])  # |ḡ|² per parameter
        trace_sigma = (n**2 * batch_l2.sum(1) - n * mean_sq) / (n - 1)
        return trace_sigma, mean_sq - trace_sigma / n

    def _from_micro_batches(self, ctx):
        """tr(Σ) and |G|² per parameter from the micro-batches' gradients; None for one."""
        sizes, squared, mean_sq = ctx.micro_batch_norms(self)
        k, n = len(sizes), sizes.sum()
        if k < 2:
            return None
        # A micro-batch's share of the step's gradient is B_m / B times its mean gradient G_m.
        small = (squared * (n / sizes)[:, None]).sum(0)  # sum_m B_m |G_m|² / B
        trace_sigma = (small - mean_sq) * n / (k - 1)
        return trace_sigma, mean_sq - trace_sigma / n
