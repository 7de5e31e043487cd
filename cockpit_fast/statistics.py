"""What one tracked training step shares: its plan, its context, the statistics it asks for, and their computation.

The public API of custom quantities that read per-sample statistics: a quantity's
``statistics(plan)`` names what it needs (:data:`BATCH_L2`, :class:`Hist1d`, :class:`Projection`,
...) from the step's :class:`StepPlan`, and its ``compute`` reads the values from the
:class:`StepContext` (``ctx.per_param``, ``ctx.summed``).

Data flows one way: the cockpit makes a step's :class:`StepPlan` before its backward pass (fixed
from then on), the per-sample engine gives forms, :class:`StepStatistics` turns each micro-batch's
forms into statistics, the cockpit makes the :class:`StepContext` once from them, and under
``torch.distributed`` :func:`cockpit_fast.distributed.reduce_step` makes the global batch's
context from it; quantities read the last.

Quantities never read per-sample gradients themselves. Before the backward pass each one names
the per-parameter *statistics* it needs (hashable keys, so two quantities asking for the same
histogram or the same norms share one computation). After each backward pass
:class:`StepStatistics` computes every requested statistic of every tracked parameter from
the per-sample engine's forms (:mod:`cockpit_fast.per_sample`): closed forms where a form has
them (factors of Linear and convolution weights, embedding rows), else the fused ops over the
per-sample gradients, formed a chunk of samples at a time. Every route gives the same results.

Sums (``BATCH_L2``, ``SUM_GRAD_SQUARED``, dot products) stay in BackPACK's units, that of
``grad_batch = ∇ℓ_n / N`` for a mean loss; quantities rescale them with the batch size. Histograms and abs-maxima see ``N * grad_batch``, i.e. the
individual gradients themselves, because their clamping and binning depend on the scale.
"""

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property, reduce
from typing import Callable

import torch
from cockpit_fast import ops
from cockpit_fast import stats as columns
from cockpit_fast.fsdp import gathered, is_sharded, norms
from cockpit_fast.per_sample.grads import DenseGrads, Kept, Scratch, ZeroGrads, held_bytes

ROUTES = ("auto", "factors", "grad_batch")
"""How per-sample statistics are computed from a form: ``"auto"``, its closed forms where they are
cheaper than forming the gradients; ``"factors"``, its closed forms wherever it has them;
``"grad_batch"``, always from the per-sample gradients themselves."""


WRAPPED_LATER = (
    "(A forward pass that used none of them, an expert no token chose, gives them no gradient: track parameters "
    "that every step uses too. A model wrapped after the cockpit was made, by FSDP1 or anything else that "
    "replaces its parameters, computes with other tensors: make the cockpit from the wrapped model's parameters)"
)
"""Why tracked parameters may get no gradient although the model ran: the errors saying so end with it."""


class HotParameter:
    """A tracked parameter inside the hook, while its per-sample gradients are at hand.

    Args:
        index (int): Position among the tracked parameters.
        param (torch.Tensor): The parameter.
        form: Its per-sample gradients (:class:`~cockpit_fast.per_sample.PerSampleGrads`).
        grad_batch (torch.Tensor, optional): Dense per-sample gradients of consecutive samples
            (a chunk of ``form``), in BackPACK's ``grad_batch`` units.
        grad (torch.Tensor, optional): The mini-batch gradient; by default the form's.
        route (str): One of :data:`ROUTES`.
        batch_size (int, optional): N of the step's batch, by which ``grad_batch`` is multiplied
            to be the individual gradients; by default the form's (more where the form holds
            one micro-batch of several).
    """

    def __init__(self, index, param, form, grad_batch=None, grad=None, route="auto", batch_size=None):
        self.index = index
        self.param = param
        self.form = form
        self.grad_batch = grad_batch
        self.batch_size = form.batch_size if batch_size is None else batch_size
        self.route = route
        if grad is not None:
            self.grad = grad

    @cached_property
    def grad(self):
        """The mini-batch gradient, formed once for all statistics that read it."""
        return self.form.grad


class Statistic:
    """A per-parameter statistic of the individual gradients, computed inside the hook."""

    reduction = "sum"
    """How ranks combine it (:mod:`cockpit_fast.distributed`): ``"sum"``, ``"max"``,
    ``"per_sample"`` (concatenated in rank order), or ``"local"`` (not combined: each rank's own)."""

    sample_power = 0
    """k such that it is in units of ``(1/N)^k`` through ``grad_batch = ∇ℓ_n / N``: what the
    batch size of one rank is exchanged for the global one with."""

    reads_param = False
    """Whether it reads the parameter's values (under FSDP2, gathered from the shards first)."""

    uses_mean_grad = False
    """Whether it reads the mini-batch gradient, which under ``torch.distributed`` is known only
    after every rank's gradient is combined: such statistics wait for it."""

    kept_aside = False
    """Whether its closed form reads none of this step's per-sample gradients (a projection of an
    earlier step's, kept) or keeps the form as it is: taken from the form first, on every route
    (None: from formed chunks after all), and never from the fused ops' pass over this step's
    gradients."""

    once_a_step = False
    """Whether it reads nothing of the step's micro-batches (an earlier step's values, kept): taken
    with the first micro-batch that reaches the parameter, not once each."""

    keeps_chunks = False
    """Whether its value holds the formed gradients it was computed from (then they are not formed
    in memory the next chunk takes)."""

    def from_grad_batch(self, hot):
        """Compute the statistic of one :class:`HotParameter` (or of its chunk of samples)."""
        raise NotImplementedError

    def from_form(self, form, hot):
        """Compute it in closed form from the parameter's per-sample gradient ``form``; None:
        take it from chunks of the per-sample gradients."""
        return None

    def merge(self, parts):
        """Combine the values of consecutive chunks of samples (default: per-sample, concatenated)."""
        return torch.cat(parts)

    def global_factor(self, local_n, global_n):
        """What a ``"per_sample"`` value of a rank with ``local_n`` of the ``global_n`` samples is
        multiplied by to be in the global batch's units."""
        return (local_n / global_n) ** self.sample_power

    def rank_lengths(self, sizes):
        """How many values of a ``"per_sample"`` statistic each rank holds: its batch size."""
        return sizes


class _BatchL2(Statistic):
    reduction, sample_power = "per_sample", 2

    def __repr__(self):
        return "batch_l2"

    def from_grad_batch(self, hot):
        return ops.batch_l2(hot.grad_batch)

    def from_form(self, form, hot):
        return form.batch_l2(force=hot.route == "factors")


class _SumGradSquared(Statistic):
    sample_power = 2

    def __repr__(self):
        return "sum_grad_squared"

    def from_grad_batch(self, hot):
        return ops.sum_grad_squared(hot.grad_batch)

    def from_form(self, form, hot):
        return form.sum_grad_squared()

    def merge(self, parts):
        return sum(parts)


BATCH_L2 = _BatchL2()
"""(N,) per-sample squared norms of ``grad_batch``."""
SUM_GRAD_SQUARED = _SumGradSquared()
"""sum_n grad_batch[n]^2, shaped like the parameter."""


class _GradAbsMax(Statistic):
    reduction = "max"

    def __repr__(self):
        return "grad_abs_max"

    def from_grad_batch(self, hot):
        return ops.per_sample_stats(hot.grad_batch, hot.batch_size)[:, columns.MAX_ABS].max()

    def from_form(self, form, hot):
        return form.abs_max(hot.batch_size)

    def merge(self, parts):
        return torch.stack(parts).max()


GRAD_ABS_MAX = _GradAbsMax()
"""0-dim tensor: max |N * grad_batch| over samples and elements (bin adaptation)."""


class _DotMeanGrad(Statistic):
    reduction, sample_power, uses_mean_grad = "per_sample", 1, True

    def __repr__(self):
        return "dot_mean_grad"

    def direction(self, hot):
        return hot.grad

    def from_grad_batch(self, hot):
        return ops.batch_dot(hot.grad_batch, self.direction(hot))

    def from_form(self, form, hot):
        return form.dot(self.direction(hot))


DOT_MEAN_GRAD = _DotMeanGrad()
"""(N,) dot products <grad_batch[n], mini-batch gradient>."""


class _KeepGradBatch(Statistic):
    reduction = "local"  # each rank keeps its own; what is later taken from it is combined
    kept_aside = True  # where its form pays to keep
    keeps_chunks = True

    def __repr__(self):
        return "grad_batch"

    def from_grad_batch(self, hot):
        return Kept([DenseGrads(hot.grad_batch)])

    def from_form(self, form, hot):
        return Kept.copied(form) if hot.route != "grad_batch" and Kept.pays(form) else None

    def merge(self, parts):
        return Kept.joined(parts)


GRAD_BATCH = _KeepGradBatch()
"""``grad_batch`` kept (a :class:`~cockpit_fast.per_sample.grads.Kept`), for the one quantity
that must project it on a later step (Alpha)."""


@dataclass(frozen=True)
class Hist1d(Statistic):
    """Counts of the individual gradient elements in ``bins`` bins over ``range``."""

    bins: int
    range: tuple

    def from_grad_batch(self, hot):
        return ops.hist1d(hot.grad_batch, self.bins, self.range, scale=hot.batch_size)

    def from_form(self, form, hot):
        return form.hist1d(self.bins, self.range, scale=hot.batch_size)

    def merge(self, parts):
        return sum(parts)


@dataclass(frozen=True)
class Hist2d(Statistic):
    """Counts over (individual gradient element, parameter element) pairs."""

    bins: tuple
    range: tuple

    reads_param = True

    def from_grad_batch(self, hot):
        return ops.hist2d(hot.grad_batch, hot.param.detach(), self.bins, self.range, scale=hot.batch_size)

    def from_form(self, form, hot):
        return form.hist2d(hot.param, self.bins, self.range, scale=hot.batch_size)

    def merge(self, parts):
        return sum(parts)


@dataclass(frozen=True)
class Projection(Statistic):
    """(N,) dot products of ``grad_batch`` with a direction known only to its ``owner``.

    ``direction(hot)`` returns the direction for one :class:`HotParameter`; two projections are
    the same computation when owner and label agree. ``uses_mean_grad``: whether the direction
    is built from ``hot.grad``; ``reads_param``: from ``hot.param``.
    """

    owner: object
    label: str
    direction: Callable = field(compare=False, repr=False)
    uses_mean_grad: bool = field(default=False, compare=False)
    reads_param: bool = field(default=False, compare=False)
    reduction = "per_sample"
    sample_power = 1

    def __repr__(self):  # the same in every process (no object address): orders reductions
        return f"projection({type(self.owner).__name__}, {self.label!r})"

    def from_grad_batch(self, hot):
        return ops.batch_dot(hot.grad_batch, self.direction(hot))

    def from_form(self, form, hot):
        return form.dot(self.direction(hot))


class _InfoReader:
    """Reads the ``info`` the user handed to ``cockpit(global_step, info=...)``."""

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

    def given(self, name):
        """The ``info`` entry ``name``, or None where the user did not hand it in."""
        return self._info.get(name)

    def given_batch_size(self):
        """The batch size ``info`` tells: ``info['batch_size']``, else the length of
        ``info['individual_losses']``; None where it tells neither."""
        if self.has_info("batch_size"):
            return int(self._info["batch_size"])
        if self.has_info("individual_losses"):
            return int(self._info["individual_losses"].numel())
        return None

    def loss(self, quantity):
        """The mini-batch loss from ``info['loss']`` as a 0-dim tensor."""
        return self.info("loss", quantity).detach().reshape(())

    def info_with(self, **entries):
        """This step's ``info`` with ``entries`` replaced (a new dict)."""
        return {**self._info, **entries}


class StepPlan(_InfoReader):
    """What a tracked step knows before its backward pass, fixed from then on: the step, the
    parameters, the user's ``info``, the group its batch is combined over, and the statistics
    each quantity asks for (asked once: a quantity may keep state of what it asked).

    Args:
        global_step (int): The step being tracked.
        params (list[torch.Tensor]): The tracked parameters, in output order.
        info (dict): What the user handed to ``cockpit(..., info=...)``.
        group (optional): The process group this step's batch is combined over; None: this
            process alone (no group, or no quantity reads the batch at this step).
        quantities (list): The quantities, asked for their :meth:`statistics` of this step.
    """

    def __init__(self, global_step, params, info, group=None, quantities=()):
        self.global_step, self.params, self.group = global_step, params, group
        self._info = info
        scaler = info.get("grad_scaler") if hasattr(info, "get") else None
        # A GradScaler's scaled loss: its gradients times this are those of the loss itself.
        self.unscale = 1.0 if scaler is None else 1.0 / float(scaler.get_scale())
        self.statistics_of = {q: frozenset(q.statistics(self)) for q in quantities}
        self.requests = frozenset().union(*self.statistics_of.values())


class StepContext(_InfoReader):
    """Everything one tracked step knows once its backward passes ran: the plan, the statistics,
    the step's gradient; what quantities read. Made once by the cockpit after the backward
    passes; under ``torch.distributed`` (``plan.group`` given),
    :func:`cockpit_fast.distributed.reduce_step` makes the global batch's from it (the
    statistics, ``info``'s batch size, loss and individual losses, the gradient, the diagonal
    curvatures) before any quantity reads it.

    Args:
        plan (StepPlan): The step's plan.
        results (dict): ``{statistic: {index: value}}`` computed.
        local_grads (dict): ``{index: gradient}`` of this process's backward passes.
        grads (list, optional): The step's gradient, one per parameter (the global batch's, or
            this process's passes' before a trainer clips ``param.grad``); None: ``param.grad``.
        local_batch_size (int, optional): This process's samples, as the per-sample gradients
            have them.
        info (dict, optional): ``info`` of the step where it differs from the plan's (entries
            put together from micro-batches, or the global batch's).
        waiting (StepStatistics, optional): Statistics that wait for the global gradient.
        extended_params (list): Every parameter BackPACK's extensions visited, tracked or not.
        micro_batch_norms (tuple, optional): See :meth:`micro_batch_norms`.
        curvatures (dict, optional): ``{savefield: values}`` of the global batch.
        rank_sizes (list, optional): Every rank's batch size, once reduced.
        rank_share (float): ``N_r / N``: the weight of this rank's means in the global batch's.
    """

    def __init__(
        self, plan, results=None, local_grads=None, grads=None, local_batch_size=None, info=None, waiting=None,
        extended_params=(), micro_batch_norms=None, curvatures=None, rank_sizes=None, rank_share=1.0,
    ):
        self.plan = plan
        self.global_step, self.params, self.group, self.unscale = plan.global_step, plan.params, plan.group, plan.unscale
        self.requests = plan.requests
        self._info = plan._info if info is None else info
        self._results = {statistic: dict(values) for statistic, values in (results or {}).items()}
        self.local_grads = dict(local_grads or {})
        self._global_grads = grads
        self.local_batch_size = local_batch_size
        self.waiting = waiting
        self.extended_params = list(extended_params)
        self._micro_batch_norms = micro_batch_norms
        self._curvatures = dict(curvatures or {})
        self.rank_sizes, self.rank_share = rank_sizes, rank_share
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._grad_l2_squared = None

    def reduced(self, **changes):
        """A context like this one but for ``changes`` (constructor arguments)."""
        fields = {
            "results": self._results, "local_grads": self.local_grads, "grads": self._global_grads,
            "local_batch_size": self.local_batch_size, "info": self._info, "waiting": self.waiting,
            "extended_params": self.extended_params, "micro_batch_norms": self._micro_batch_norms,
            "curvatures": self._curvatures, "rank_sizes": self.rank_sizes, "rank_share": self.rank_share,
        }
        return StepContext(self.plan, **{**fields, **changes})

    def differentiable_grads(self):
        """Gradients that still carry their graph (``create_graph=True``): ``param.grad``, or this
        rank's own gradients under ``torch.distributed``. None where a parameter has none."""
        if self.group is None:
            grads = [p.grad for p in self.params]
        else:
            grads = [self.local_grads.get(i) for i in range(len(self.params))]
        return [g if g is not None and g.grad_fn is not None else None for g in grads]


    def index_of(self, param):
        """Position of ``param`` among the tracked parameters, or None."""
        return self._index.get(id(param))

    def results(self):
        """``{statistic: {index: value}}`` of everything computed (a copy to change freely)."""
        return {statistic: dict(values) for statistic, values in self._results.items()}

    def per_param(self, statistic):
        """``statistic`` of every tracked parameter, in parameter order."""
        values = self._results.get(statistic, {})
        missing = [i for i in range(len(self.params)) if i not in values]
        if missing:
            raise RuntimeError(
                f"{statistic!r} was not computed for parameters {missing}: the backward pass gave them a gradient "
                "but the per-sample engine no per-sample gradients (used outside the module calls it watched: "
                "read by a module that does not own them, or in a forward pass made before the cockpit); with "
                "info['individual_losses'] they take the whole graph"
            )
        return [values[i] for i in range(len(self.params))]

    def summed(self, statistic):
        """``statistic`` summed over the tracked parameters."""
        return sum_of(self.per_param(statistic))

    def grads(self):
        """Mini-batch gradients of the tracked parameters (of the global batch when distributed)."""
        if self._global_grads is not None:
            return self._global_grads
        if all(p.grad is None for p in self.params):
            raise RuntimeError(
                f"the mini-batch gradient was not computed for any tracked parameter: were they used "
                f"in the forward pass? {WRAPPED_LATER}"
            )
        # One no backward pass reached (an expert no token chose) has a zero gradient.
        grads = [zero_grad(p) if p.grad is None else p.grad.detach() for p in self.params]
        return grads if self.unscale == 1.0 else [g * self.unscale for g in grads]

    def flat_grad(self):
        """Mini-batch gradient of all tracked parameters as one vector."""
        return flatten(self.grads())

    def grad_l2_squared(self):
        """Squared norm of the mini-batch gradient over all tracked parameters (0-dim tensor),
        computed once a step for every quantity that reads it (NormTest, InnerTest, OrthoTest)."""
        if self._grad_l2_squared is None:
            self._grad_l2_squared = squared_norm(self.grads())
        return self._grad_l2_squared

    def micro_batch_norms(self, quantity):
        """``(sizes, squared_norms, step_squared_norms)``: each micro-batch's number of samples,
        ``(k,)``, the squared norms of its gradient per tracked parameter, ``(k, P)``, in the
        step's units (the micro-batch's share of the step's gradient), and those of the step's
        gradient, ``(P,)``, this process's own; float64; ``k = 1`` on a step of one backward
        pass."""
        if self._micro_batch_norms is None:
            raise RuntimeError(f"{type(quantity).__name__}: the micro-batches' gradient norms were not kept at this step")
        return self._micro_batch_norms

    def curvature(self, name):
        """The diagonal curvature BackPACK stored as ``name``, of every tracked parameter."""
        if name in self._curvatures:
            return self._curvatures[name]
        return [getattr(p, name).detach() for p in self.params]


def unreached(params):
    """Indices of the tracked ``params`` no backward pass of the step reached (no ``.grad``: an
    expert no token chose) while others were; [] where none was reached (nothing ran)."""
    without = [i for i, p in enumerate(params) if p.grad is None]
    return without if len(without) < len(params) else []


def zero_grad(param):
    """The gradient of a parameter no backward pass reached: zeros, broadcast from one (a step
    with hundreds of unchosen experts allocates nothing for them)."""
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


def flatten(tensors):
    """Concatenate flattened tensors into one vector."""
    return torch.cat([t.flatten() for t in tensors])


def sum_of(tensors):
    """The sum of same-shaped tensors, from two kernels rather than one addition each: on a GPU a
    step's statistics wait on their launches from the host, not on the device."""
    return torch.stack(list(tensors)).sum(0)


def squared_norm(tensors):
    """Sum of the tensors' squared ℓ₂ norms (0-dim): their norms from one fused call (FSDP2's
    shards reduced over their processes), not three kernels for each. The norms are taken in
    float32 at least: a bfloat16 norm, squared, would double its rounding."""
    tensors = list(tensors)
    dtype = reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)
    return torch.stack(norms(tensors, dtype)).square().sum()


class StepStatistics:
    """The requested statistics of one step, over its micro-batches (its backward passes).

    Each micro-batch's statistics are computed when its backward pass ends (:meth:`add`) and
    combined as consecutive chunks of samples are (:meth:`Statistic.merge`): sums add up,
    per-sample values are concatenated, maxima taken; a micro-batch is to the step what a rank
    is to the global batch under ``torch.distributed``. What cannot be computed yet waits, its
    forms kept: the statistics that read the step's gradient (dot products with it), and all of
    them where the step's batch size, the units of its individual gradients, is not known before
    the last micro-batch. Beyond the first micro-batch, at most ``keep_limit`` bytes are kept;
    past it what waits is dropped (:attr:`skipped`).

    Args:
        params (list[torch.Tensor]): The tracked parameters.
        requests (set[Statistic]): What the quantities asked for.
        route (str): One of :data:`ROUTES`.
        batch_size (int, optional): N of the step's batch (the forms are in the units of its loss,
            each sample's gradient over N); None: the samples of all micro-batches, once known.
        keep_limit (int, optional): Most bytes of forms kept; None: no limit.
    """

    def __init__(self, params, requests, route="auto", batch_size=None, keep_limit=None):
        self.params, self.route, self.batch_size, self.keep_limit = params, route, batch_size, keep_limit
        self.requests = frozenset(requests)
        waiting = {s for s in requests if s.uses_mean_grad}
        # What waits for the end of the step: all of it where the units are not known before.
        self._at_end = set(requests) if batch_size is None else waiting
        self._now = set(requests) - self._at_end
        self._waiting = waiting
        self._parts = defaultdict(lambda: defaultdict(dict))  # statistic -> index -> {micro-batch: value}
        self._kept = []  # (micro-batch, [(index, param, form)]) of each micro-batch, for self._at_end
        self._sizes = []  # samples of each micro-batch
        self.reached = set()  # indices of the parameters some micro-batch's backward pass gave a gradient
        self._graded = []  # of each micro-batch, the indices its backward pass gave a gradient
        self._complete = None  # of those, the ones every micro-batch's reached (None: no micro-batch yet)
        self.anywhere = self.reached  # those some rank's backward passes reached (agree())
        self.kept_bytes = 0  # what the kept forms hold (reported by benchmarks/bench_training_loops.py)
        self.dropped = False  # the kept forms outgrew keep_limit: what waited is skipped
        self.samples = 0  # samples of the micro-batches so far
        self.micro_batches = 0
        self._streamed = {}  # index -> samples, of the parameters stream() gave the pass under way

    @property
    def skipped(self):
        """The statistics dropped for the step (none unless :attr:`dropped`)."""
        return self._at_end if self.dropped else set()

    def add(self, forms, grads=None, graded=None):
        """One micro-batch's per-sample gradients, ``{id(param): form}``.

        ``grads`` (indexed like the parameters): the step's gradient, where this micro-batch is
        the step's only one and nothing reduces its gradient later. Then every statistic is
        computed now, those that read the gradient in the same pass over each form as the rest
        (later, a dot product with factors costs a weight-gradient product).

        ``graded``: the indices of the parameters this micro-batch's backward pass gave a gradient
        (by default those with a form). One it did not reach has zero gradients for its samples
        (:meth:`_merged`); one it reached without a form has no statistics (:meth:`StepContext.per_param` says so)."""
        batch = self.micro_batches
        self.micro_batches += 1
        streamed, self._streamed = self._streamed, {}
        found = [(index, param, forms[id(param)]) for index, param in enumerate(self.params) if id(param) in forms]
        self._sizes.append(max([form.batch_size for _, _, form in found] + list(streamed.values()), default=0))
        here = {index for index, _, _ in found} | set(streamed) if graded is None else set(graded)
        self._graded.append(here)
        self.reached.update(here)
        if self._sizes[-1]:
            self._complete = here if self._complete is None else self._complete & here
        self.samples += self._sizes[-1]
        if grads is not None:
            self._compute(batch, found, self._now | self._at_end, self.batch_size or self.samples, grads)
            self._now, self._at_end = self._now | (self._at_end - self._waiting), set()  # later() yields the rest
            return
        self._compute(batch, found, self._now, self.batch_size)
        if self._at_end and not self.dropped:
            self._kept.append((batch, found))
            self.kept_bytes += sum(held_bytes(form) for _, _, form in found)
            if self.micro_batches > 1 and self.keep_limit is not None and self.kept_bytes > self.keep_limit:
                self._drop()

    def stream(self, index, form, grad):
        """Parameter ``index``'s statistics from its ``form``, while the backward pass of the step's
        only micro-batch runs, its gradient ``grad`` final there: its forms need not be kept until
        the pass ends (:meth:`add` then takes the rest)."""
        batch_size = self.batch_size or form.batch_size
        values = compute_statistics(index, self.params[index], form, self.requests, grad, self.route, batch_size)
        for statistic, value in values.items():
            self._parts[statistic][index][self.micro_batches] = value
        self._streamed[index] = form.batch_size

    def _drop(self):
        self._kept.clear()
        self.dropped = True

    def _compute(self, batch, found, statistics, batch_size, grads=None):
        if not statistics:
            return
        forms = {index: form for index, _, form in found}
        # FSDP2's shards, where a statistic reads every value: every rank gathers each layer in
        # turn, whichever its own samples reached (collectives all join in one order).
        params = gathered(p.detach() for p in self.params) if any(s.reads_param for s in statistics) else enumerate(self.params)
        for index, param in params:
            if index not in forms:
                continue
            form = forms[index]
            grad = None if grads is None else grads[index]
            asked = {s for s in statistics if not (s.once_a_step and self._parts[s].get(index))}
            values = compute_statistics(index, param, form, asked, grad, self.route, batch_size=batch_size)
            for statistic, value in values.items():
                self._parts[statistic][index][batch] = value

    @property
    def complete(self):
        """Indices of the parameters every micro-batch's backward pass reached."""
        return self._complete or set()

    def agree(self, anywhere, everywhere, dropped):
        """Under ``torch.distributed``, what every rank's backward passes made of the step (alike
        on every rank): the indices of the parameters some of them reached (``anywhere``) and
        every one of them (``everywhere``).
        ``dropped``: some rank dropped the forms it kept, so every rank skips what waited for
        them.

        Raises:
            ValueError: On every rank alike, where a statistic reads the values of a parameter
                FSDP2 shards that not every backward pass reached (gathered, they would have to
                be, by the ranks that lack them alone).
        """
        partial = [i for i in range(len(self.params)) if i not in everywhere and is_sharded(self.params[i])]
        readers = sorted(repr(s) for s in self.requests if s.reads_param)
        if partial and readers:
            raise ValueError(
                f"{', '.join(readers)} read the values of tracked parameters {partial}, sharded by FSDP2, which some "
                "micro-batch or rank of the step did not use: track them on steps that use every parameter"
            )
        self.anywhere = set(anywhere)
        if dropped:
            self._drop()

    def values(self):
        """``(statistic, index, value)`` over the micro-batches of every statistic but those that
        read the step's gradient."""
        pending = set() if self.dropped else self._at_end - self._waiting
        for batch, found in self._kept:
            self._compute(batch, found, pending, self.batch_size or self.samples)
        yield from self._merged(self._now | pending)

    def later(self, grads):
        """``(statistic, index, value)`` of the statistics that read the step's gradient ``grads``
        (indexed like the parameters); none where their forms were dropped."""
        waiting = set() if self.dropped else self._waiting
        for batch, found in self._kept:
            self._compute(batch, found, waiting, self.batch_size or self.samples, grads)
        self._kept = []
        yield from self._merged(waiting, grads)

    def _merged(self, statistics, grads=None):
        zeros = {}  # (index, micro-batch) -> {statistic: value} of zero gradients, every statistic at once
        for statistic in statistics:
            parts = {**dict.fromkeys(range(len(self.params)), {}), **self._parts.pop(statistic, {})}
            with_samples = {batch for batch, size in enumerate(self._sizes) if size}
            for index, values in sorted(parts.items()):
                if not statistic.once_a_step or not values:
                    values = {**self._of_zeros(statistic, index, values.keys(), grads, statistics, zeros), **values}
                if not values or not statistic.once_a_step and not with_samples <= set(values):
                    continue  # a micro-batch gave it a gradient but no form: per_param() says so
                values = [values[batch] for batch in sorted(values)]
                yield statistic, index, merged(statistic, values)

    def _of_zeros(self, statistic, index, reached, grads, statistics, zeros):
        """``{micro-batch: value}`` of ``statistic`` for the micro-batches whose backward passes did
        not reach parameter ``index`` (a branch one of them skips, an expert none of its tokens
        chose, on this rank or on every rank): their samples' gradients are zeros, which one
        backward pass over the step's batch would count too (in the histograms, as per-sample
        norms and products). Computed with every one of ``statistics`` into ``zeros``
        (:meth:`_merged`'s), once a parameter and micro-batch."""
        param, grad = self.params[index], None if grads is None else grads[index]
        missing = [
            batch for batch, size in enumerate(self._sizes) if size and batch not in reached and index not in self._graded[batch]
        ]
        if statistic.once_a_step:  # what it reads was kept before this step: one value, computed alone
            form = ZeroGrads(self._sizes[missing[0]], param) if missing else None
            return {} if form is None else {missing[0]: self._of_form(index, param, form, {statistic}, grad)[statistic]}
        values = {}
        for batch in missing:
            if (index, batch) not in zeros:
                each = {s for s in statistics if not s.once_a_step}
                zeros[index, batch] = self._of_form(index, param, ZeroGrads(self._sizes[batch], param), each, grad)
            values[batch] = zeros[index, batch][statistic]
        return values

    def _of_form(self, index, param, form, statistics, grad):
        return compute_statistics(index, param.detach(), form, statistics, grad, self.route, self.batch_size or self.samples)


def compute_statistics(index, param, form, statistics, grad=None, route="auto", batch_size=None):
    """``statistics`` of the ``index``-th parameter from its per-sample gradient ``form``.

    Args:
        form: A :class:`~cockpit_fast.per_sample.PerSampleGrads`.
        grad (torch.Tensor, optional): The mini-batch gradient statistics read as ``hot.grad``;
            by default this process's own, the form's.
        route (str): One of :data:`ROUTES`.
        batch_size (int, optional): N of the step's batch (:class:`HotParameter`).

    Returns:
        dict: statistic -> value.
    """
    if not statistics:
        return {}
    hot = HotParameter(index, param, form, grad=grad, route=route, batch_size=batch_size)
    # Those kept aside first, on every route: they read none of the step's gradients.
    aside = {statistic: statistic.from_form(form, hot) for statistic in statistics if statistic.kept_aside}
    aside = {statistic: value for statistic, value in aside.items() if value is not None}
    values, rest, from_chunks = dict(aside), set(statistics) - set(aside), set()
    # Histograms first, dot products last: the closed forms most often missing are tried before
    # the costly ones (a dot product through factors is a weight-gradient product), which are
    # wasted once another statistic has the gradients formed.
    for statistic in sorted(rest, key=_closed_form_cost):
        value = None if route == "grad_batch" else statistic.from_form(form, hot)
        if value is None and route == "auto":
            # The gradients are formed anyway: every statistic reads them in the same pass.
            from_chunks, values = rest, dict(aside)
            break
        if value is None:
            from_chunks.add(statistic)
        else:
            values[statistic] = value
    if from_chunks:
        parts = defaultdict(list)
        unformed = _unformed(hot, from_chunks) if route != "grad_batch" else None  # that route reads formed gradients
        for range_values in unformed or _chunk_values(index, param, form, from_chunks, grad, route, batch_size):
            for statistic, value in range_values.items():
                parts[statistic].append(value)
        for statistic in from_chunks:
            values[statistic] = merged(statistic, parts[statistic])
    return values


def _chunk_values(index, param, form, statistics, grad, route, batch_size):
    """Each chunk of formed gradients' ``{statistic: value}``, in sample order."""
    # The directions once for every chunk: an embedding table's chunks hold a sample or two each.
    fused, directions = _fused_histogram(statistics), None
    scratch = None if any(statistic.keeps_chunks for statistic in statistics) else Scratch()
    for chunk in form.chunks(scratch=scratch):
        if chunk.dtype != param.dtype and param.is_floating_point():
            chunk = chunk.to(param.dtype)  # formed in a layer's autocast dtype: read against the parameter's
        chunk_hot = HotParameter(index, param, form, chunk, grad=grad, route=route, batch_size=batch_size)
        if fused and directions is None:
            directions = _stacked_directions(chunk_hot, fused[1])
        yield _from_grad_batch(chunk_hot, statistics, fused, directions)


def merged(statistic, parts):
    """``statistic``'s value over consecutive parts (chunks of samples, micro-batches): a single
    part as it is, not copied."""
    return parts[0] if len(parts) == 1 else statistic.merge(parts)


def _unformed(hot, statistics):
    """Each sample range's ``{statistic: value}`` where the form bins its gradients without writing
    them (a weight's factors over several positions) and the statistics are one histogram's, the
    squared norms' and dot products' (``economy``); else None."""
    hists, dots = _fused_parts(statistics)
    if len(hists) != 1 or set(statistics) - {*hists, *dots, BATCH_L2}:
        return None
    hist = hists[0]
    directions = [s.direction(hot) for s in dots]
    binned = hot.form.binned_ranges(directions, hist.bins, hist.range, hot.batch_size, hot.param.dtype)
    if binned is None:
        return None
    return [_fused_values(statistics, hist, dots, *results) for results in binned]


def _fused_parts(statistics):
    """The histograms and the dot products (in an order every process shares) among ``statistics``:
    what the fused ops compute in one pass with the squared norms."""
    hists = [statistic for statistic in statistics if isinstance(statistic, Hist1d)]
    dots = sorted((s for s in statistics if isinstance(s, (_DotMeanGrad, Projection)) and not s.kept_aside), key=repr)
    return hists, dots


def _fused_values(statistics, hist, dots, counts, l2, products):
    """``{statistic: value}`` of a fused op's results: the squared norms where asked for alone (with
    SUM_GRAD_SQUARED they come from the op that computes both)."""
    values = {hist: counts, **{statistic: products[:, j] for j, statistic in enumerate(dots)}}
    if BATCH_L2 in statistics and SUM_GRAD_SQUARED not in statistics:
        values[BATCH_L2] = l2
    return values


def _closed_form_cost(statistic):
    if isinstance(statistic, (_DotMeanGrad, Projection)):
        return 2
    return 1 if statistic in (BATCH_L2, SUM_GRAD_SQUARED) else 0


def _stacked_directions(hot, dots):
    """``(len(dots), *shape)``: the direction of each dot product in ``dots`` (of ``hot``'s chunk)."""
    g = hot.grad_batch
    if len(dots) == 1:  # a view: no copy of one direction
        return dots[0].direction(hot).unsqueeze(0)
    return torch.stack([statistic.direction(hot) for statistic in dots]) if dots else g.new_empty(0, *g.shape[1:])


def _fused_histogram(statistics):
    """``(histogram, dot products)`` where :func:`_from_grad_batch` computes them in one fused pass
    (with the squared norms); else None."""
    hists, dots = _fused_parts(statistics)
    return (hists[0], dots) if hists and (dots or BATCH_L2 in statistics) else None


def _from_grad_batch(hot, statistics, fused, directions):
    """``statistics`` of ``hot.grad_batch`` in as few passes over it as the fused ops allow: a
    histogram with the squared norms and the dot products (``fused``, that of
    :func:`_fused_histogram`, along ``directions``, those of :func:`_stacked_directions`), both
    square norms together."""
    values = {}
    if fused:
        hist, dots = fused
        results = ops.hist1d_batch_l2_batch_dots(hot.grad_batch, directions, hist.bins, hist.range, hot.batch_size)
        values.update(_fused_values(statistics, hist, dots, *results))
    if BATCH_L2 in statistics and SUM_GRAD_SQUARED in statistics:
        values[BATCH_L2], values[SUM_GRAD_SQUARED] = ops.batch_l2_and_sum_grad_squared(hot.grad_batch)
    for statistic in statistics:
        if statistic not in values:
            values[statistic] = statistic.from_grad_batch(hot)
    return values
