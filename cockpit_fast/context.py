"""Cockpit 1.0.2's ``cockpit.context`` readers of ``info``, for quantities written for Cockpit.

A quantity built on :class:`~cockpit_fast.quantities.quantity.SingleStepQuantity` or
:class:`~cockpit_fast.quantities.quantity.TwoStepQuantity` reads what the user handed to
``cockpit(global_step, info=...)`` with these functions while it is tracked, as in Cockpit.
"""

from contextlib import contextmanager

_TRACKED = {}  # global_step -> the StepContext being tracked


@contextmanager
def tracking(ctx):
    """Make ``ctx``'s ``info`` readable here while a quantity tracks ``ctx.global_step``."""
    _TRACKED[ctx.global_step] = ctx
    try:
        yield
    finally:
        del _TRACKED[ctx.global_step]


def get(name, global_step):
    """The ``info`` entry ``name`` of ``global_step``.

    Raises:
        KeyError: If it was not handed in (or the step is not being tracked).
    """
    ctx = _TRACKED.get(global_step)
    if ctx is None or not ctx.has_info(name):
        raise KeyError(f"Please hand in '{name}' via cockpit(info=...).")
    return ctx.info(name, None)


def get_individual_losses(global_step):
    """``info['individual_losses']``."""
    return get("individual_losses", global_step)


def get_batch_size(global_step):
    """``info['batch_size']``."""
    return get("batch_size", global_step)


def get_optimizer(global_step):
    """``info['optimizer']``."""
    return get("optimizer", global_step)


def get_loss(global_step):
    """``info['loss']`` (the cockpit itself warns when it is NaN)."""
    return get("loss", global_step)
