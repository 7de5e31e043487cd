"""Size of the parameter update of one step."""

import torch

from cockpit_fast.fsdp import each, norms
from cockpit_fast.quantities.quantity import FastQuantity, StepCache, plain_state, restored_copies


def layerwise_distance(params, reference):
    """ℓ₂ distance of each parameter from its reference copy (list of 0-dim tensors; of FSDP2's
    shards, reduced over the processes in one collective)."""
    return norms(each(torch._foreach_sub, [p.detach() for p in params], list(reference)))


class UpdateSize(FastQuantity):
    """Tracks the ℓ₂ norm of each parameter's update from step t to t + 1, stored under step t.

    Parameters are copied at every scheduled step t and compared at step t + 1.
    """

    NEEDS_CALLS = False
    READS_BATCH = False  # parameters and time are the same in every process

    def __init__(self, track_schedule, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._start = StepCache()

    def should_compute(self, global_step):
        return self._track_schedule(global_step) or self._track_schedule(global_step - 1)

    def track(self, ctx):
        step = ctx.global_step
        start = self._start.pop(step - 1)
        self._start.drop_before(step)
        if start is not None:
            self._store(step - 1, layerwise_distance(ctx.params, start))
        if self._track_schedule(step):
            self._start.put(step, [p.detach().clone() for p in ctx.params])

    def state_dict(self):
        return {**super().state_dict(), "start": self._start.state_dict(plain_state)}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        self._start.load_state_dict(state["start"], lambda copies: restored_copies(copies, params))
