"""Policies that move a histogram's bin range between steps."""

import struct

import torch

from cockpit_fast.statistics import GRAD_ABS_MAX
from cockpit_fast._validation import check_range


class BinAdaptation:
    """Base policy: on scheduled steps, computes a new range from the step's data.

    Args:
        track_schedule (callable): Maps the global step to whether to adapt after that step.
        verbose (bool, optional): Print new ranges. Defaults to ``False``.
    """

    def __init__(self, track_schedule, verbose=False):
        self._track_schedule = track_schedule
        self._verbose = verbose

    def should_compute(self, global_step):
        """Whether to adapt the range after ``global_step``."""
        return self._track_schedule(global_step)

    def statistics(self, global_step):
        """Per-parameter statistics the adaptation needs at ``global_step``."""
        return set()

    def extensions(self, global_step):
        """Extra BackPACK extensions the adaptation needs (none)."""
        return []

    def new_range(self, ctx, current, bins):
        """The range of ``bins`` bins to use from the next step on."""
        raise NotImplementedError


class NoAdaptation(BinAdaptation):
    """Keep the range fixed."""

    def __init__(self, verbose=False):
        super().__init__(track_schedule=lambda global_step: False, verbose=verbose)


class _AbsMax(BinAdaptation):
    """Set the range to ``[-m, m]`` with m the largest absolute value, padded, and not too small.

    Args:
        track_schedule (callable): When to adapt.
        verbose (bool, optional): Print new ranges. Defaults to ``False``.
        padding (float, optional): Relative padding added to m. Defaults to 0.
        min_size (float, optional): Smallest width of the range. Defaults to 1e-6.
    """

    def __init__(self, track_schedule, verbose=False, padding=0.0, min_size=1e-6):
        super().__init__(track_schedule, verbose=verbose)
        self._padding = padding
        self._min_size = min_size

    def new_range(self, ctx, current, bins):
        # The next step's binning needs the limit as a number: the one sync of an adaptation step.
        abs_max = self._abs_max(ctx).item()
        end = (1.0 + self._padding) * max(self._min_size / 2, abs_max)
        end = _computable_end(end, bins, {p.dtype for p in ctx.params})
        if self._verbose:
            print(f"[Step {ctx.global_step} | {type(self).__name__}]: new limits {-end:.5f}, {end:.5f}")
        return -end, end

    def _abs_max(self, ctx):
        raise NotImplementedError


class GradAbsMax(_AbsMax):
    """Adapt to the largest absolute individual gradient element."""

    def statistics(self, global_step):
        return {GRAD_ABS_MAX} if self.should_compute(global_step) else set()

    def _abs_max(self, ctx):
        return torch.stack(ctx.per_param(GRAD_ABS_MAX)).max()


class ParamAbsMax(_AbsMax):
    """Adapt to the largest absolute parameter element."""

    def _abs_max(self, ctx):
        return torch.stack([p.detach().abs().max() for p in ctx.params]).max()


def _computable_end(end, bins, dtypes):
    """The ``x`` nearest to ``end`` for which the ops can bin ``(-x, x)`` in ``bins`` bins of
    every one of ``dtypes`` (:func:`~cockpit_fast._validation.check_range`).

    A gradient spike (or a vanishing gradient with ``min_size=0``) must not move the range
    where the ops reject it: every later step would fail before the range could adapt back.
    """

    def fits(x):
        try:
            for dtype in dtypes:
                check_range("bin adaptation", (-x, x), bins, dtype)
        except ValueError:
            return False
        return True

    if fits(end):
        return end
    # The ends that fit form an interval holding 1.0 (2^24 bins of width 2^-23 are fine in
    # float32): bisect between 1.0 and ``end`` on the bit patterns of positive doubles, which
    # are ordered as the doubles are.
    good, bad = _bits(1.0), _bits(end)
    while abs(bad - good) > 1:
        middle = (good + bad) // 2
        if fits(_double(middle)):
            good = middle
        else:
            bad = middle
    return _double(good)


def _bits(x):
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _double(bits):
    return struct.unpack("<d", struct.pack("<q", bits))[0]
