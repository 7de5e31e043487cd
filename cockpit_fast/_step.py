"""What one tracked training step shares: its context, the statistics it asks for, and the hook.

Quantities never read BackPACK buffers themselves. Before the backward pass each one names the
per-parameter *statistics* it needs (hashable keys, so two quantities asking for the same
histogram or the same norms share one computation). The :class:`StatisticsHook` runs inside
BackPACK right after a module's extensions, computes every requested statistic of that module's
parameters with the fused ops while ``grad_batch`` is hot, and deletes the buffer at once.

Sums (``BATCH_L2``, ``SUM_GRAD_SQUARED``, dot products) stay in BackPACK's units, that of
``grad_batch = ∇ℓ_n / N`` for a mean loss, so they agree whichever source produced them (the
fused ops on ``grad_batch`` or BackPACK's own ``BatchL2Grad`` / ``SumGradSquared``); quantities
rescale them with the batch size. Histograms and abs-maxima see ``N * grad_batch``, i.e. the
individual gradients themselves, because their clamping and binning depend on the scale.
"""

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared

from cockpit_fast import ops
from cockpit_fast import stats as columns


class HotParameter:
    """A tracked parameter inside the hook, while its ``grad_batch`` is at hand.

    Args:
        index (int): Position among the tracked parameters.
        param (torch.Tensor): The parameter.
        grad_batch (torch.Tensor): Its BackPACK ``grad_batch``, detached.
    """

    def __init__(self, index, param, grad_batch):
        self.index = index
        self.param = param
        self.grad_batch = grad_batch

    @cached_property
    def grad(self):
        """The mini-batch gradient, summed from ``grad_batch`` once for all statistics.

        ``param.grad`` is not yet written when the hook runs.
        """
        return self.grad_batch.sum(0)


class Statistic:
    """A per-parameter statistic of the individual gradients, computed inside the hook."""

    needs_grad_batch = True
    """Whether it needs the individual gradient elements (else a cheaper BackPACK source exists)."""

    def from_grad_batch(self, hot):
        """Compute the statistic of one :class:`HotParameter`."""
        raise NotImplementedError


class _SquareNorm(Statistic):
    """A sum of squares that BackPACK can also compute without materialising ``grad_batch``.

    ``name`` is also the savefield of ``extension``, BackPACK's extension computing it.
    """

    needs_grad_batch = False

    def __init__(self, name, op, extension):
        self.name, self._op, self._extension = name, op, extension

    def __repr__(self):
        return self.name

    def from_grad_batch(self, hot):
        return self._op(hot.grad_batch)

    def extension(self):
        """The BackPACK extension that computes this statistic directly."""
        return self._extension()


BATCH_L2 = _SquareNorm("batch_l2", ops.batch_l2, BatchL2Grad)
"""(N,) per-sample squared norms of ``grad_batch``."""
SUM_GRAD_SQUARED = _SquareNorm("sum_grad_squared", ops.sum_grad_squared, SumGradSquared)
"""sum_n grad_batch[n]^2, shaped like the parameter."""


class _GradAbsMax(Statistic):
    def __repr__(self):
        return "grad_abs_max"

    def from_grad_batch(self, hot):
        n = hot.grad_batch.shape[0]
        return ops.per_sample_stats(hot.grad_batch, n)[:, columns.MAX_ABS].max()


GRAD_ABS_MAX = _GradAbsMax()
"""0-dim tensor: max |N * grad_batch| over samples and elements (bin adaptation)."""


class _DotMeanGrad(Statistic):
    def __repr__(self):
        return "dot_mean_grad"

    def from_grad_batch(self, hot):
        return ops.batch_dot(hot.grad_batch, hot.grad)


DOT_MEAN_GRAD = _DotMeanGrad()
"""(N,) dot products <grad_batch[n], mini-batch gradient>."""


class _KeepGradBatch(Statistic):
    def __repr__(self):
        return "grad_batch"

    def from_grad_batch(self, hot):
        return hot.grad_batch


GRAD_BATCH = _KeepGradBatch()
"""``grad_batch`` itself, for the one quantity that must project it on a later step (Alpha)."""


@dataclass(frozen=True)
class Hist1d(Statistic):
    """Counts of the individual gradient elements in ``bins`` bins over ``range``."""

    bins: int
    range: tuple

    def from_grad_batch(self, hot):
        return ops.hist1d(hot.grad_batch, self.bins, self.range, scale=hot.grad_batch.shape[0])


@dataclass(frozen=True)
class Hist2d(Statistic):
    """Counts over (individual gradient element, parameter element) pairs."""

    bins: tuple
    range: tuple

    def from_grad_batch(self, hot):
        n = hot.grad_batch.shape[0]
        return ops.hist2d(hot.grad_batch, hot.param.detach(), self.bins, self.range, scale=n)


@dataclass(frozen=True)
class Projection(Statistic):
    """(N,) dot products of ``grad_batch`` with a direction known only to its ``owner``.

    ``direction(hot)`` returns the direction for one :class:`HotParameter`; two projections are
    the same computation when owner and label agree.
    """

    owner: object
    label: str
    direction: Callable = field(compare=False, repr=False)

    def from_grad_batch(self, hot):
        return ops.batch_dot(hot.grad_batch, self.direction(hot))


STATISTIC_SOURCES = frozenset({"grad_batch", BATCH_L2.name, SUM_GRAD_SQUARED.name})
"""BackPACK buffers the hook reads statistics from."""


def extensions_for(statistics, params, user_extensions=()):
    """The cheapest BackPACK extensions from which the hook can compute ``statistics``.

    Square norms come from BackPACK's own extensions unless ``grad_batch`` is computed anyway, or
    a parameter is a convolution kernel (more than 2 dimensions): BackPACK computes those norms
    from unfolded inputs, which costs more than ``grad_batch`` and one fused pass (a step of a
    small CNN: 52 ms against 33 ms; on an MLP's Linear layers the reverse, 2.7 ms against 49 ms).
    """
    has_grad_batch = any(isinstance(e, BatchGrad) for e in user_extensions)
    if not statistics or has_grad_batch:
        return []
    if any(s.needs_grad_batch for s in statistics) or any(p.dim() > 2 for p in params):
        return [BatchGrad()]
    return [s.extension() for s in statistics]


class StepContext:
    """Everything one tracked step knows: step, parameters, user info and computed statistics.

    Args:
        global_step (int): The step being tracked.
        params (list[torch.Tensor]): The tracked parameters, in output order.
        info (dict): What the user handed to ``cockpit(..., info=...)``.
    """

    def __init__(self, global_step, params, info):
        self.global_step = global_step
        self.params = params
        self._info = info
        self._index = {id(p): i for i, p in enumerate(params)}
        self.requests = set()
        self._results = defaultdict(dict)

    def info(self, name, quantity):
        """The ``info`` entry ``name``; a KeyError names the entry and the quantity needing it."""
        try:
            return self._info[name]
        except KeyError:
            raise KeyError(
                f"{type(quantity).__name__} needs '{name}': hand it in via cockpit(..., info={{'{name}': ...}})"
            ) from None

    def has_info(self, name):
        """Whether the user handed in the ``info`` entry ``name``."""
        return name in self._info

    def loss(self, quantity):
        """The mini-batch loss from ``info['loss']``; it must be a scalar tensor."""
        loss = self.info("loss", quantity)
        if loss.numel() != 1:
            raise ValueError(f"info['loss'] must be the scalar mini-batch loss, got shape {tuple(loss.shape)}")
        return loss.detach().reshape(())

    def index_of(self, param):
        """Position of ``param`` among the tracked parameters, or None."""
        return self._index.get(id(param))

    def store(self, statistic, index, value):
        """Record ``statistic`` of the ``index``-th parameter."""
        self._results[statistic][index] = value

    def per_param(self, statistic):
        """``statistic`` of every tracked parameter, in parameter order."""
        values = self._results.get(statistic, {})
        missing = [i for i in range(len(self.params)) if i not in values]
        if missing:
            raise RuntimeError(
                f"{statistic!r} was not computed for parameters {missing}: were they used in the "
                "forward pass of a model extended by BackPACK (backpack.extend)?"
            )
        return [values[i] for i in range(len(self.params))]

    def summed(self, statistic):
        """``statistic`` summed over the tracked parameters."""
        return sum(self.per_param(statistic))

    def grads(self):
        """Mini-batch gradients of the tracked parameters."""
        return [p.grad.detach() for p in self.params]

    def flat_grad(self):
        """Mini-batch gradient of all tracked parameters as one vector."""
        return flatten(self.grads())

    def grad_l2_squared(self):
        """Squared norm of the mini-batch gradient over all tracked parameters (0-dim tensor)."""
        return sum((g**2).sum() for g in self.grads())


def flatten(tensors):
    """Concatenate flattened tensors into one vector."""
    return torch.cat([t.flatten() for t in tensors])


class StatisticsHook:
    """BackPACK extension hook: computes the step's statistics per parameter, then frees buffers.

    Args:
        ctx (StepContext): Receives the statistics; ``ctx.requests`` says which.
        delete_fields (set[str]): BackPACK buffers to delete once read (those the user did not
            ask for through their own extensions).
    """

    def __init__(self, ctx, delete_fields):
        self._ctx = ctx
        self._delete_fields = delete_fields
        self._visited = set()
        requests = ctx.requests
        self._fused_norms = BATCH_L2 in requests and SUM_GRAD_SQUARED in requests
        self._others = requests - {BATCH_L2, SUM_GRAD_SQUARED} if self._fused_norms else requests

    def __call__(self, module):
        # Containers are visited too; their parameters belong to their leaf modules.
        if next(module.children(), None) is not None:
            return
        for param in module.parameters():
            if id(param) in self._visited or not param.requires_grad:
                continue
            self._visited.add(id(param))
            index = self._ctx.index_of(param)
            if index is not None:
                self._collect(index, param)
            for name in self._delete_fields:
                if hasattr(param, name):
                    delattr(param, name)

    def _collect(self, index, param):
        ctx = self._ctx
        grad_batch = getattr(param, "grad_batch", None)
        if grad_batch is None:  # only BackPACK's square-norm extensions ran
            for statistic in self._ctx.requests:
                ctx.store(statistic, index, getattr(param, statistic.name))
            return
        hot = HotParameter(index, param, grad_batch.detach())
        if self._fused_norms:
            batch_l2, sum_grad_squared = ops.batch_l2_and_sum_grad_squared(hot.grad_batch)
            ctx.store(BATCH_L2, index, batch_l2)
            ctx.store(SUM_GRAD_SQUARED, index, sum_grad_squared)
        for statistic in self._others:
            ctx.store(statistic, index, statistic.from_grad_batch(hot))
