"""Histogram of individual gradient elements."""

import torch

from cockpit_fast.statistics import Hist1d
from cockpit_fast.quantities.bin_adaptation import NoAdaptation
from cockpit_fast.quantities.quantity import FastQuantity, plain_state, restored_state


class GradHist1d(FastQuantity):
    """Tracks a histogram of all individual gradient elements, outliers clamped into the range.

    The value is ``{"hist": counts (bins,), "edges": bin edges (bins + 1,)}``, summed over
    parameters. The counts are float, as Cockpit's (torch.histc), but float64 and exact: they are
    summed in int64, and float64 holds every count below 2^53 (float32 only below 2^24).

    Args:
        track_schedule (callable): When to track.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
        bins (int, optional): Number of bins. Defaults to 100.
        range ((float, float), optional): Bin range. Defaults to ``(-2, 2)``.
        adapt (BinAdaptation, optional): How the range moves between steps. Defaults to none.
    """

    def __init__(self, track_schedule, verbose=False, bins=100, range=(-2, 2), adapt=None):
        super().__init__(track_schedule, verbose=verbose)
        self._bins = bins
        self._range = tuple(range)
        self._made_with = {"bins": int(bins), "range": [float(end) for end in range]}  # (settings())
        self._adapt = NoAdaptation(verbose=verbose) if adapt is None else adapt

    def _histogram(self):
        return Hist1d(self._bins, self._range)

    def statistics(self, ctx):
        step = ctx.global_step
        wanted = {self._histogram()} if self.should_compute(step) else set()
        return wanted | self._adapt.statistics(step)

    def extensions(self, global_step):
        return self._adapt.extensions(global_step)

    def reads_batch(self, global_step):  # adapting the range reads the batch too
        return super().reads_batch(global_step) or self._adapt.should_compute(global_step)

    def track(self, ctx):
        super().track(ctx)
        if self._adapt.should_compute(ctx.global_step):
            self._range = tuple(self._adapt.new_range(ctx, self._range, self._bins))

    def state_dict(self):  # the range where bin adaptation left it
        return {**super().state_dict(), "range": plain_state(self._range)}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        self._range = tuple(restored_state(state["range"]))

    def _compute(self, ctx):
        hist = ctx.summed(self._histogram()).double()
        start, end = self._range
        edges = torch.linspace(start, end, self._bins + 1, device=hist.device)
        return {"hist": hist, "edges": edges}
