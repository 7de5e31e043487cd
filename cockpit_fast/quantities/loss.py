"""The mini-batch loss."""

import math
import warnings

from cockpit_fast.quantities.quantity import Quantity


class Loss(Quantity):
    """Tracks the mini-batch training loss from ``info['loss']``."""

    def _compute(self, ctx):
        return ctx.loss(self)

    def _convert(self, value):
        loss = value.item()
        if math.isnan(loss):
            warnings.warn("The mini-batch loss is NaN; quantities computed from it are meaningless.")
        return loss
