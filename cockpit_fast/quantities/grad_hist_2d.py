"""Histogram of individual gradient elements against parameter elements."""

import torch

from cockpit_fast.statistics import Hist2d
from cockpit_fast.quantities.bin_adaptation import NoAdaptation
from cockpit_fast.quantities.quantity import FastQuantity, plain_state, restored_state


class GradHist2d(FastQuantity):
    """Tracks a 2D histogram: individual gradient elements (x) against parameter elements (y).

    Values outside the range are clamped to the centre of the outer bin. The value is
    ``{"hist": int64 counts (xbins, ybins), "edges": (x edges, y edges)}`` summed over
    parameters; with ``keep_individual`` also ``"param_groups"`` and ``"param_<i>"`` entries
    holding each parameter's own histogram.

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        bins ((int, int), optional): Bins along x and y. Defaults to ``(40, 50)``.
        range (((float, float), (float, float)), optional): Ranges along x and y.
            Defaults to ``((-1, 1), (-2, 2))``.
        adapt ((BinAdaptation or None, BinAdaptation or None), optional): Per-axis range
            adaptation; None keeps the axis fixed. Defaults to ``(None, None)``.
        keep_individual (bool, optional): Also output per-parameter histograms.
    """

    def __init__(
        self,
        track_schedule,
        verbose=False,
        bins=(40, 50),
        range=((-1, 1), (-2, 2)),
        adapt=(None, None),
        keep_individual=False,
    ):
        super().__init__(track_schedule, verbose=verbose)
        self._bins = tuple(bins)
        self._range = [tuple(axis) for axis in range]
        self._made_with = {"bins": [int(b) for b in bins], "range": [[float(end) for end in axis] for axis in range]}
        self._adapt = [NoAdaptation(verbose=verbose) if a is None else a for a in adapt]
        self._keep_individual = keep_individual

    def _histogram(self):
        return Hist2d(self._bins, tuple(self._range))

    def statistics(self, ctx):
        step = ctx.global_step
        wanted = {self._histogram()} if self.should_compute(step) else set()
        for adapt in self._adapt:
            wanted |= adapt.statistics(step)
        return wanted

    def extensions(self, global_step):
        return [e for adapt in self._adapt for e in adapt.extensions(global_step)]

    def reads_batch(self, global_step):  # adapting a range reads the batch too
        return super().reads_batch(global_step) or any(a.should_compute(global_step) for a in self._adapt)

    def track(self, ctx):
        super().track(ctx)
        for axis, adapt in enumerate(self._adapt):
            if adapt.should_compute(ctx.global_step):
                self._range[axis] = tuple(adapt.new_range(ctx, self._range[axis], self._bins[axis]))

    def state_dict(self):  # the ranges where bin adaptation left them
        return {**super().state_dict(), "range": plain_state(self._range)}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        self._range = [tuple(axis) for axis in restored_state(state["range"])]

    def _compute(self, ctx):
        hists = ctx.per_param(self._histogram())
        device = hists[0].device
        edges = tuple(
            torch.linspace(lo, hi, bins + 1, device=device) for bins, (lo, hi) in zip(self._bins, self._range)
        )
        result = {"hist": sum(hists), "edges": edges}
        if self._keep_individual:
            result["param_groups"] = len(hists)
            for index, hist in enumerate(hists):
                result[f"param_{index}"] = {"hist": hist, "edges": edges}
        return result
