"""Tracking schedules: functions mapping the global step to whether to track it."""

import torch


def linear(interval, offset=0):
    """Track at steps ``offset + n * interval`` for n >= 0.

    Args:
        interval (int): Steps between two tracked steps.
        offset (int, optional): First tracked step. Defaults to 0.

    Returns:
        callable: The schedule.
    """

    def schedule(global_step):
        return global_step >= offset and (global_step - offset) % interval == 0

    schedule.__doc__ = f"Track at steps {offset} + n * {interval}, n >= 0."
    return schedule


def logarithmic(start, end, steps=300, base=10, init=True):
    """Track at ``steps`` log-spaced steps between ``base**start`` and ``base**end``.

    The steps are the log-spaced values rounded down to integers (duplicates collapse), as
    Cockpit 1.0.2 computes them.

    Args:
        start (float): Exponent of the first step.
        end (float): Exponent of the last step.
        steps (int, optional): Number of log-spaced points. Defaults to 300.
        base (float, optional): Base of the exponents. Defaults to 10.
        init (bool, optional): Also track step 0. Defaults to True.

    Returns:
        callable: The schedule.
    """
    tracked = set(torch.logspace(start, end, steps, base=base, dtype=torch.int64).tolist())
    if init:
        tracked.add(0)

    def schedule(global_step):
        return global_step in tracked

    return schedule
