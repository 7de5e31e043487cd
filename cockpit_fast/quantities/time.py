"""Wall-clock time."""

import time

from cockpit_fast.quantities.quantity import Quantity


class Time(Quantity):
    """Tracks ``time.time()`` at the end of the backward pass."""

    def _compute(self, ctx):
        return time.time()
