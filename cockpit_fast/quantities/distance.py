"""Distance of the parameters from their initial values."""

from cockpit_fast.quantities.quantity import FastQuantity, plain_state, restored_copies
from cockpit_fast.quantities.update_size import layerwise_distance


class Distance(FastQuantity):
    """Tracks each parameter's ℓ₂ distance from its value at step 0 (a list, one per parameter).

    The parameters are copied at step 0, whatever the schedule; step 0 must be tracked.
    """

    NEEDS_CALLS = False
    READS_BATCH = False  # parameters and time are the same in every process

    INIT_GLOBAL_STEP = 0

    def __init__(self, track_schedule, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._initial = None

    def should_compute(self, global_step):
        return global_step == self.INIT_GLOBAL_STEP or self._track_schedule(global_step)

    def track(self, ctx):
        if ctx.global_step == self.INIT_GLOBAL_STEP:
            self._initial = [p.detach().clone() for p in ctx.params]
        if self._track_schedule(ctx.global_step):
            if self._initial is None:
                raise RuntimeError(f"Distance needs step {self.INIT_GLOBAL_STEP} to be tracked by the cockpit")
            self._store(ctx.global_step, layerwise_distance(ctx.params, self._initial))

    def state_dict(self):
        return {**super().state_dict(), "initial": plain_state(self._initial)}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        initial = state["initial"]
        self._initial = None if initial is None else restored_copies(initial, params)
