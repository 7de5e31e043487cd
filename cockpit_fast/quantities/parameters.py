"""The parameter values."""

from cockpit_fast.fsdp import gathered
from cockpit_fast.quantities.quantity import FastQuantity


class Parameters(FastQuantity):
    """Tracks the values of every parameter, as nested lists (one per parameter)."""

    NEEDS_CALLS = False
    READS_BATCH = False  # parameters and time are the same in every process

    def _compute(self, ctx):
        # Host copies: a long run must not pile parameter snapshots up in device memory. (FSDP2's
        # shards gathered a batch at a time.)
        return [value.to("cpu", copy=True) for _, value in gathered(p.detach() for p in ctx.params)]

    def _convert(self, value):
        return [p.tolist() for p in value]
