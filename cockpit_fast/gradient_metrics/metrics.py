"""Gradient metrics with the API of gradient-metrics 0.5.0: Max, Min, Mean, MeanStd and PNorm.

Every built-in metric keeps a running row of :mod:`cockpit_fast.stats` columns and turns it into
its values with ``_rows_from_stats``. The same method turns the rows of a whole batch into per-sample
values, which is how :class:`~cockpit_fast.gradient_metrics.GradientMetricCollector` serves a batch
from one backward pass. Feeding gradients one at a time (``metric(grad)``) still works as before,
and subclasses that override how a metric collects are served sample by sample.
"""

import math

import torch
import torch.nn as nn

from cockpit_fast import ops
from cockpit_fast import stats as columns

# Methods the batched formula stands in for: a subclass that overrides one of them gets its own
# per-sample calls instead (see GradientMetric._serves_batches).
_PER_SAMPLE_METHODS = ("__call__", "_collect", "_get_metric", "data", "reset")


class GradientMetric:
    """Base class of the metrics: a value computed over the gradients of some parameters.

    Args:
        target_layers: A module, a tensor, or a sequence of both. A module contributes all of its
            ``parameters()``; the metric spans every target parameter of one sample together.
        grad_transform: Optional callable applied to each parameter's gradient of one sample
            before the metric sees it.

    Subclasses implement ``_collect(grad)``, ``_get_metric()`` and ``reset()``. They may also
    implement ``_stats_p_values()`` and ``_rows_from_stats(stats, count)`` to be computed for a
    whole batch at once.
    """

    def __init__(self, target_layers, grad_transform=None):
        single = isinstance(target_layers, (nn.Module, torch.Tensor))
        self.target_layers = (target_layers,) if single else tuple(target_layers)
        self.target_parameters = []
        self.grad_transform = grad_transform
        self._register_parameters()

    def __call__(self, grad):
        """Collects one gradient, or each of a sequence of gradients, after the transform."""
        grads = [grad] if isinstance(grad, torch.Tensor) else list(grad)
        for g in grads:
            # Detached: the caller's gradient may feed other consumers.
            g = g.detach()
            if self.grad_transform is not None:
                g = as_floating(self.grad_transform(g))
            self._collect(g)

    def _collect(self, grad):
        """Updates the metric with one (transformed) gradient; subclasses implement it."""
        raise NotImplementedError

    @property
    def data(self):
        """The current metric values as a 1-D tensor."""
        return self._get_metric().view(-1)

    def _get_metric(self):
        """The current metric values; subclasses implement it."""
        raise NotImplementedError

    def reset(self):
        """Returns the metric to its state before any gradient; subclasses implement it."""
        raise NotImplementedError

    def _register_parameters(self):
        for target in self.target_layers:
            if isinstance(target, torch.Tensor):
                self.target_parameters.append(target)
            else:
                self.target_parameters.extend(target.parameters())

    def _stats_p_values(self):
        """The p values whose sum |x|^p columns ``_rows_from_stats`` reads (in that order)."""
        return ()

    def _rows_from_stats(self, stats, count):
        """Metric values of each row of merged stats over ``count`` values: shape (rows, dim)."""
        raise NotImplementedError

    def _serves_batches(self):
        """True when ``_rows_from_stats`` gives what this object's per-sample methods would.

        That holds while every per-sample method is the one inherited alongside the batched formula;
        a subclass that overrides ``_collect`` (say) without a formula of its own must be fed
        sample by sample.
        """
        cls = type(self)
        owner = next(c for c in cls.__mro__ if "_rows_from_stats" in vars(c))
        if owner is GradientMetric:
            return False
        return all(getattr(cls, name) is getattr(owner, name) for name in _PER_SAMPLE_METHODS)


def as_floating(values):
    """A transform's output as the stats can take it: integers (and booleans) in the default
    dtype, which is what the original's float buffers promote them to."""
    if values.is_floating_point() or values.is_complex():
        return values
    return values.to(torch.get_default_dtype())


class _RunningStatsMetric(GradientMetric):
    """A metric whose state is one running stats row, merged with each collected gradient.

    Subclasses set what ``_stats_p_values`` reads before calling this ``__init__``.
    """

    def __init__(self, target_layers, grad_transform=None):
        super().__init__(target_layers, grad_transform)
        self.reset()

    def _collect(self, grad):
        row = ops.per_sample_stats(grad.reshape(1, -1), 1.0, self._stats_p_values())
        dtype = torch.promote_types(self._stats.dtype, row.dtype)
        running = (self._stats.to(row.device, dtype), self._count)
        self._stats, self._count = columns.merge([running, (row.to(dtype), grad.numel())])
        # The original's buffers start in the default dtype and promote with every gradient.
        self._dtype = torch.promote_types(self._dtype, grad.dtype)

    def _get_metric(self):
        return self._rows_from_stats(self._stats, self._count)[0].to(self._dtype)

    def reset(self):
        """Forgets every collected gradient."""
        self._dtype = torch.get_default_dtype()
        self._count = 0
        # The merge identity: rows of no values (see cockpit_fast.stats).
        identity = [-math.inf, math.inf, 0.0, 0.0, 0.0] + [0.0] * len(self._stats_p_values())
        self._stats = torch.tensor([identity], dtype=self._dtype)


class Max(_RunningStatsMetric):
    """The largest gradient entry (-inf before any gradient)."""

    def _rows_from_stats(self, stats, count):
        return stats[:, columns.MAX : columns.MAX + 1]


class Min(_RunningStatsMetric):
    """The smallest gradient entry (+inf before any gradient)."""

    def _rows_from_stats(self, stats, count):
        return stats[:, columns.MIN : columns.MIN + 1]


class Mean(_RunningStatsMetric):
    """The mean over all gradient entries (0 before any gradient)."""

    def _rows_from_stats(self, stats, count):
        return stats[:, columns.MEAN : columns.MEAN + 1]


class MeanStd(_RunningStatsMetric):
    """Mean and sample standard deviation over all gradient entries.

    The standard deviation is ``sqrt(M2 / (count - 1) + eps**2)``, so never below ``eps``; with
    at most one entry it is ``eps`` itself.

    Args:
        target_layers: See :class:`GradientMetric`.
        grad_transform: See :class:`GradientMetric`.
        return_mean: Whether the values start with the mean; otherwise only the std is given.
        eps: Floor of the standard deviation; must be positive.

    Raises:
        ValueError: If ``eps`` is not greater than zero.
    """

    def __init__(self, target_layers, grad_transform=None, return_mean=True, eps=1e-16):
        GradientMetric.__init__(self, target_layers, grad_transform)  # targets first, as the original
        if not eps > 0:
            raise ValueError(f"eps has to be greater than zero, got {eps}")
        self.eps = eps
        self.return_mean = return_mean
        self.reset()

    def _rows_from_stats(self, stats, count):
        mean = stats[:, columns.MEAN : columns.MEAN + 1]
        if count > 1:
            std = torch.sqrt(stats[:, columns.M2 : columns.M2 + 1] / (count - 1) + self.eps**2)
        else:
            std = torch.full_like(mean, self.eps)
        return torch.cat((mean, std), dim=1) if self.return_mean else std


class PNorm(_RunningStatsMetric):
    """The p-norm ``(sum |x|^p)^(1/p)`` of all gradient entries flattened together.

    Args:
        target_layers: See :class:`GradientMetric`.
        grad_transform: See :class:`GradientMetric`.
        p: The power, a float in (0, inf] or the string ``"inf"``. Defaults to 1. NaN is
            accepted, as by the original: the norm of any gradient is then NaN.

    Raises:
        ValueError: If ``p`` is not a number, or not greater than 0.
        TypeError: If ``p`` cannot be given to ``float`` (None, say).
    """

    def __init__(self, target_layers, grad_transform=None, p=1.0):
        GradientMetric.__init__(self, target_layers, grad_transform)  # targets first, as the original
        try:
            p = float(p)
        except ValueError:
            raise ValueError(_P_MESSAGE.format(p)) from None
        if p <= 0:
            raise ValueError(_P_MESSAGE.format(p))
        self.p = p
        self.reset()

    def _stats_p_values(self):
        # The sup norm is the max|x| column, which every stats row has; NaN needs no column.
        return () if math.isinf(self.p) or math.isnan(self.p) else (self.p,)

    def _rows_from_stats(self, stats, count):
        if math.isinf(self.p):
            return stats[:, columns.MAX_ABS : columns.MAX_ABS + 1]
        if math.isnan(self.p):  # the original's 0 ** nan: NaN over any values, 0 over none
            return torch.full_like(stats[:, :1], math.nan if count else 0.0)
        return stats[:, columns.P0 : columns.P0 + 1] ** (1.0 / self.p)


_P_MESSAGE = "Parameter 'p' should either be a float in the interval (0,inf] or the string 'inf', found '{}'"
