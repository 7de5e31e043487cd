"""Wall-clock time."""

import time

from cockpit_fast.quantities.quantity import FastQuantity


class Time(FastQuantity):
    """Tracks ``time.time()`` at the end of the backward pass."""

    NEEDS_CALLS = False
    READS_BATCH = False  # parameters and time are the same in every process

    def _compute(self, ctx):
        return time.time()
