"""The mini-batch loss."""

from cockpit_fast.quantities.quantity import FastQuantity


class Loss(FastQuantity):
    """Tracks the mini-batch training loss from ``info['loss']``.

    A NaN loss is warned about by the cockpit on every tracked step, whatever it tracks.
    """

    NEEDS_CALLS = False

    def _compute(self, ctx):
        return ctx.loss(self)
