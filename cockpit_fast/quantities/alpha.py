"""Normalized step length α from a noise-aware quadratic fit along the update."""

import numbers
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from cockpit_fast.fsdp import each, gathered, is_sharded, local_part, reduction_dtypes, summed_squares
from cockpit_fast.per_sample.capture import outside_autocast
from cockpit_fast.per_sample.grads import Kept
from cockpit_fast.statistics import DOT_MEAN_GRAD, GRAD_BATCH, Projection, squared_norm, sum_of
from cockpit_fast.quantities._optim import is_plain_sgd, learning_rates
from cockpit_fast.quantities.quantity import (
    Deferred,
    FastQuantity,
    StepCache,
    plain_state,
    restored_per_param,
    restored_state,
    this_process,
)


class Alpha(FastQuantity):
    """Tracks α, where the step from t to t + 1 lands on a quadratic fitted along it, under step t.

    The fit uses loss values, projected gradients and their sample variances at both ends.
    α = 0 means the step reached the minimum of the fit, -1 that it stayed where it started
    (or the fit is concave), 1 that it overshot to the same height. None when the fit failed.

    For SGD without momentum (owning every tracked parameter) the update is -lr times the
    mini-batch gradient, so the individual gradients' projections on it are -lr times their dot
    products with that gradient (the statistic InnerTest and OrthoTest read too, computed once)
    and nothing big is kept; where SGD then steps with another gradient (clipped after the
    ``with`` block), that step gets no value, with a warning, and later steps keep the
    parameters, as for other optimizers. For other optimizers (or none handed in via
    ``info['optimizer']``, which warns) the parameters and individual gradients of step t are
    kept until the update is known: once an optimizer that owns every tracked parameter has
    stepped, they are projected at the next module call (a forward pass), and let go before
    that pass's activations are made; else at step t + 1. Needs ``info`` entries ``loss``,
    ``individual_losses`` and ``batch_size``. The fit itself runs when output is read.
    """

    SAVE_SHIFT = 1

    def __init__(self, track_schedule, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._starts = StepCache()
        self._sgd_gradient_changed = False  # SGD stepped with another gradient than the step's: keep parameters

    def is_start(self, global_step):
        """Whether ``global_step`` starts a step whose α is tracked."""
        return self._track_schedule(global_step)

    def is_end(self, global_step):
        """Whether ``global_step`` ends a step whose α is tracked."""
        return self._track_schedule(global_step - self.SAVE_SHIFT)

    def should_compute(self, global_step):
        return self.is_start(global_step) or self.is_end(global_step)

    def statistics(self, ctx):
        step = ctx.global_step
        wanted = set()
        start = self._starts.get(step - self.SAVE_SHIFT) if self.is_end(step) else None
        # Its optimizer has stepped by now: where SGD stepped otherwise, it gets no value (nothing
        # to project) and a start made at this step keeps the parameters.
        self._sgd_gradient_changed |= start is not None and start.gradient_changed
        if start is not None and start.observation is not None and not start.gradient_changed:
            wanted.add(Projection(self, "end", start.direction, reads_param=start.params is not None))
            if not start.sgd:  # the start's kept individual gradients, on the update now known
                wanted.add(self._kept_projection(start))
        if self.is_start(step):
            start = _StartPoint(self._sgd_learning_rates(ctx))
            self._starts.put(step, start)
            start.watch_inside(ctx.params)
            wanted.add(DOT_MEAN_GRAD if start.sgd else GRAD_BATCH)
        return wanted

    def _kept_projection(self, start):
        """Projections of the start's kept individual gradients on the update, known at the end."""
        return _KeptProjection(self, "kept", start.direction, reads_param=start.params is not None, start=start)

    def _sgd_learning_rates(self, ctx):
        """Per-parameter learning rates if the update is plain SGD's, else None."""
        if not ctx.has_info("optimizer"):
            warnings.warn("No 'optimizer' handed in via info: Alpha keeps parameters and individual gradients")
            return None
        if self._sgd_gradient_changed:
            return None
        optimizer = ctx.info("optimizer", self)
        rates = learning_rates(optimizer) if is_plain_sgd(optimizer) else None
        # (An optimizer of some of the parameters, as a GAN's: the others' updates are unknown.)
        return rates if rates is not None and all(id(p) in rates for p in ctx.params) else None

    def track(self, ctx):
        step = ctx.global_step
        if self.is_end(step):
            start = self._starts.pop(step - self.SAVE_SHIFT)
            if start is not None:
                start.stop_watching()
            if start is not None and start.gradient_changed:
                warnings.warn(
                    f"[Step {step - self.SAVE_SHIFT}] Alpha: SGD stepped with another gradient than the step's (changed "
                    "after the `with` block: clipped, say; or, over processes with unequal batch sizes, reduced to "
                    "another mean than the global batch's), so its update is not -lr times the step's gradient: "
                    "no value for this step; from the next one on, Alpha keeps the parameters to read the update"
                )
            elif start is not None and start.observation is not None:  # else its step failed
                self._store(step - self.SAVE_SHIFT, self._fit(ctx, start))
        for dropped in self._starts.drop_before(step):
            dropped.stop_watching()
        if self.is_start(step):
            self._starts.get(step).observe(ctx, self)

    def state_dict(self):  # the starts waiting for their ends
        starts = self._starts.state_dict(_StartPoint.state_dict)
        return {**super().state_dict(), "starts": starts, "sgd_gradient_changed": self._sgd_gradient_changed}

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        self._starts.load_state_dict(state["starts"], lambda start: _StartPoint.restored(start, params))
        self._sgd_gradient_changed = state.get("sgd_gradient_changed", False)

    def _fit(self, ctx, start):
        directions = [start.directions[i] for i in range(len(ctx.params))]
        update_size = torch.sqrt(squared_norm(directions))
        if not start.sgd:  # the update is known only now
            start.observation.dots = ctx.summed(self._kept_projection(start))
        end = _Observation(ctx, self, ctx.summed(Projection(self, "end", start.direction)))
        observations = [start.observation, end]
        dfs, var_dfs = zip(*(o.projected_gradient(update_size) for o in observations))
        return Deferred(
            _alpha,
            update_size,
            [o.loss for o in observations],
            list(dfs),
            [o.loss_variance for o in observations],
            list(var_dfs),
        )


class _Observation:
    """Loss, its sample variance and the individual gradients' dot products with the update."""

    def __init__(self, ctx, quantity, dots):
        self.loss = ctx.loss(quantity)
        self.loss_variance = ctx.info("individual_losses", quantity).detach().var()
        self.batch_size = ctx.info("batch_size", quantity)
        self.dots = dots  # <grad_batch_n, update>, i.e. <∇ℓ_n, update> / N

    @classmethod
    def restored(cls, state, device):
        """The observation whose ``vars()`` were saved as ``state``, its tensors on ``device``."""
        observation = cls.__new__(cls)  # __init__ reads a step being tracked
        vars(observation).update(restored_state(state, device))
        return observation

    def projected_gradient(self, update_size):
        """Mean and sample variance of the individual gradients projected on the update."""
        projections = self.batch_size * self.dots / update_size
        return projections.mean(), projections.var()


def _scaled(tensors, factors):
    """Each tensor times its factor: in one foreach call where the factors are numbers (a
    launch per tensor costs a GPU step's host more than the products), else one by one
    (foreach's scalar lists take no tensor learning rate)."""
    if all(isinstance(factor, numbers.Number) for factor in factors):
        return each(torch._foreach_mul, tensors, factors)
    return [factor * t for factor, t in zip(factors, tensors)]


@dataclass(frozen=True, repr=False)  # Projection's repr: the same in every process
class _KeptProjection(Projection):
    """Projections of the start's individual gradients, kept by each process until the end of
    the step, on the update: computed in the end's hook, in the start's units and samples."""

    start: object = field(default=None, compare=False, repr=False)
    kept_aside = True  # the start's individual gradients, not this step's
    once_a_step = True  # all of the start's samples, whichever micro-batch of the end reads them

    def from_grad_batch(self, hot):
        if self.start.kept_dots is not None:  # projected before this step's forward pass
            return self.start.kept_dots[hot.index]
        return self.start.grad_batch[hot.index].dot(self.direction(hot))

    def from_form(self, form, hot):
        return self.from_grad_batch(hot)

    def global_factor(self, local_n, global_n):
        return self.start.rank_share

    def rank_lengths(self, sizes):
        return self.start.rank_sizes


class _StartPoint:
    """What the start of a step keeps until its end; how depends on the optimizer.

    Args:
        sgd_learning_rates (dict or None): Per-parameter learning rates of plain SGD, whose
            update is known in the backward pass; None to keep parameters and ``grad_batch``.
    """

    def __init__(self, sgd_learning_rates):
        self.sgd = sgd_learning_rates is not None
        self._learning_rates = sgd_learning_rates
        self.directions = {}
        self.observation = None  # set once the start step is tracked
        self.params = None
        self.grad_batch = None
        self.kept_dots = None  # grad_batch projected on the update, before the end's forward pass
        self._tracked = None  # the parameters, while an optimizer's step is awaited
        self._stepped = False
        self._handed = None  # SGD: {id(param): (index, param, its gradient weakly, that one's version)} at the step's end
        self.gradient_changed = False  # SGD stepped with another gradient than the step's
        self._compare_every = False  # compare every gradient SGD steps with, not only those changed
        self._inside = None  # the parameters, while the step's `with` block is open
        self._stepped_from = None  # an optimizer's step inside that block: SGD's gradients, or the parameters
        self._stepped_inside = False  # whether that step ended inside the block (not only began: a closure's)

    def direction(self, hot):
        """The update of one parameter, in the end's hook (the optimizer has stepped by then)."""
        if self.params is not None:  # not plain SGD's, nor projected before the end's forward pass
            self.directions[hot.index] = hot.param.detach() - self.params[hot.index]
        return self.directions[hot.index]

    def _watch_optimizer(self, params):
        """Project the kept individual gradients on the update before the next forward pass once
        an optimizer owning every parameter of ``params`` has stepped (:func:`_optimizer_stepped`):
        they need not be held through that pass and its backward pass."""
        self._tracked = params
        _watch_optimizer_steps()
        _WAITING.add(self)

    def optimizer_stepped(self, owned):
        """An optimizer owning the parameters of ids ``owned`` has stepped; whether this start
        now waits for the next module call to project."""
        self._stepped = self._stepped or {id(p) for p in self._tracked} <= owned
        return self._stepped

    def project_if_stepped(self):
        """At a module call: project the kept individual gradients on the update if an optimizer
        owning every tracked parameter has stepped (and anything that wraps it has done with the
        parameters, as Lookahead's slow weights: the update is the parameters' change)."""
        if not self._stepped:
            return
        self.stop_watching()
        dots = [None] * len(self.params)
        # (FSDP2's shards gathered; the end reads these directions, not the parameters: they do
        # not change within its forward and backward passes)
        for i, value in gathered(p.detach() for p in self._tracked):
            self.directions[i] = value - self.params[i]
            dots[i] = self.grad_batch[i].dot(self.directions[i])
        self.kept_dots, self.grad_batch, self.params = dots, None, None

    def watch_inside(self, params):
        """Until :meth:`observe`, at the end of the step's ``with`` block: an optimizer owning
        ``params`` that steps inside the block steps before the start is observed; keep what
        it steps from (:meth:`before_step_inside`, :meth:`after_step_inside`)."""
        self._inside = list(params)
        _watch_optimizer_steps()
        _INSIDE.add(self)

    def before_step_inside(self, owned):
        """An optimizer owning the parameters of ids ``owned`` is about to step inside the
        block: keep the gradients plain SGD steps with, or the parameters it steps from. (A
        step with a closure, as Lightning's, may run the block's end inside it: the step counts
        once it has ended, :meth:`after_step_inside`.)"""
        if self._stepped_from is not None or not {id(p) for p in self._inside} <= owned:
            return
        if self.sgd:
            self._stepped_from = [p.grad for p in self._inside]
        else:  # (FSDP2's shards gathered, as observe() takes them)
            self._stepped_from = [value.clone() for _, value in gathered(p.detach() for p in self._inside)]

    def after_step_inside(self, owned):
        """An optimizer owning the parameters of ids ``owned`` has stepped inside the block."""
        self._stepped_inside |= self._stepped_from is not None and {id(p) for p in self._inside} <= owned

    def _check_sgd_gradients(self, params, rank_sizes):
        """Check, once SGD has stepped, that it stepped with this step's gradients (a trainer may
        clip them after the ``with`` block): else the update is not the one observed. Where the
        processes' batches differ in size (their reduction may average their mean gradients, not
        the global batch's mean), or under FSDP2 (its shards are alike on no two processes), every
        gradient is compared, so that each process decides alike."""
        self._handed = {id(p): (i, p, weakref.ref(p.grad), p.grad._version) for i, p in enumerate(params) if p.grad is not None}
        self._compare_every = len(set(rank_sizes or [])) > 1 or any(is_sharded(p) for p in params)
        _watch_optimizer_steps()
        _CHECKING.add(self)

    def check_stepped_gradients(self, owned):
        """After the step of an optimizer owning the parameters of ids ``owned`` (its gradients
        still there: a closure's backward pass runs inside the step): whether it stepped with
        those the update was observed from, to :data:`SAME_UPDATE` (compared where one was
        changed in place since, a clip by a factor 1 changing none, or every one, as
        :meth:`_check_sgd_gradients` says)."""
        moved = []
        for key in owned & self._handed.keys():
            index, param, grad, version = self._handed.pop(key)
            if self._compare_every or param.grad is not grad() or param.grad._version != version:
                moved.append((index, param))
        if not self._handed:
            _CHECKING.discard(self)
        if moved and not self.gradient_changed:
            self._compare_stepped(moved, [param.grad for _, param in moved])

    def _compare_stepped(self, moved, grads):
        """Whether SGD stepped with ``grads`` for the ``(index, param)`` pairs ``moved``: else
        :attr:`gradient_changed`."""
        if any(grad is None for grad in grads):
            self.gradient_changed = True
            return
        if not moved:
            return
        # Each process's parts (FSDP2's shards; the directions are full values), then norms over processes.
        params = [param for _, param in moved]
        now = _scaled([local_part(g, p) for g, p in zip(grads, params)], [-self._learning_rates[id(p)] for p in params])
        kept = [local_part(self.directions[i], param) for i, param in moved]
        off, size = summed_squares([torch._foreach_sub(now, kept), kept], params)
        # (FSDP2 may reduce in bfloat16: its rounding, relative to the gradient's norm, is no change.)
        rounding = max((torch.finfo(d).eps for d in reduction_dtypes(params).values()), default=0.0)
        self.gradient_changed = bool(off > max(SAME_UPDATE, 2 * rounding) ** 2 * size)

    def stop_watching(self):
        """Stop watching the optimizer and the module calls (the end has come, or will not)."""
        _WAITING.discard(self)
        _CHECKING.discard(self)
        _INSIDE.discard(self)

    def observe(self, ctx, quantity):
        """Take the start's loss information and update (plain SGD's, -lr times the gradient)
        or, without SGD, what to project at the end."""
        dots = None
        _INSIDE.discard(self)
        stepped_from = self._stepped_from if self._stepped_inside else None
        self._stepped_from = None
        if self.sgd:
            steps = [-self._learning_rates[id(p)] for p in ctx.params]
            self.directions = dict(enumerate(_scaled(ctx.grads(), steps)))
            dots = sum_of(_scaled(ctx.per_param(DOT_MEAN_GRAD), steps))
            if stepped_from is None:
                self._check_sgd_gradients(ctx.params, ctx.rank_sizes)
            else:  # SGD stepped inside the block: with these gradients?
                stepped = [(i, p) for i, p in enumerate(ctx.params) if stepped_from[i] is not None]
                self._compare_stepped(stepped, [stepped_from[i] for i, _ in stepped])
        self.observation = _Observation(ctx, quantity, dots)
        self.rank_sizes, self.rank_share = ctx.rank_sizes, ctx.rank_share
        if not self.sgd:
            # (FSDP2's shards gathered: the end's direction reads each parameter's values)
            self.params = stepped_from or [value.clone() for _, value in gathered(p.detach() for p in ctx.params)]
            self.grad_batch = ctx.per_param(GRAD_BATCH)
            if stepped_from is None:
                self._watch_optimizer(ctx.params)
            else:  # the update is known now: no step to wait for
                self._tracked, self._stepped = ctx.params, True
                with torch.no_grad():
                    self.project_if_stepped()

    def state_dict(self):
        """What the end needs, in plain types and CPU tensors (the learning rates served
        :meth:`observe` alone, which has run by then)."""
        observed = self.observation is not None
        state = plain_state(
            {
                "sgd": self.sgd,
                "directions": self.directions,
                "observation": vars(self.observation) if observed else None,
                "rank_sizes": self.rank_sizes if observed else None,
                "params": self.params,
                "gradient_changed": self.gradient_changed,
            }
        )
        # Kept individual gradients are this process's samples', in its share of the batch.
        state["rank_share"] = None if not observed else self.rank_share if self.sgd else this_process(self.rank_share)
        state["grad_batch"] = None if self.grad_batch is None else [this_process(kept.state()) for kept in self.grad_batch]
        state["kept_dots"] = None if self.kept_dots is None else [this_process(dots) for dots in self.kept_dots]
        return state

    @classmethod
    def restored(cls, state, params):
        """The start saved by :meth:`state_dict`, its tensors on the devices of ``params``."""
        start = cls(None)
        start.sgd = state["sgd"]
        start.gradient_changed = state.get("gradient_changed", False)
        start.directions = {i: restored_state(d, params[i].device, params[i]) for i, d in state["directions"].items()}
        if state["observation"] is not None:
            start.observation = _Observation.restored(state["observation"], params[0].device)
            start.rank_sizes, start.rank_share = state["rank_sizes"], restored_state(state["rank_share"])
        if state["params"] is not None:
            start.params = restored_per_param(state["params"], params)
        if state["grad_batch"] is not None:
            start.grad_batch = [Kept.from_state(kept) for kept in restored_per_param(state["grad_batch"], params)]
        if state.get("kept_dots") is not None:
            start.kept_dots = restored_per_param(state["kept_dots"], params)
        return start


SAME_UPDATE = 1e-5
"""How far (relative, in norm) the update SGD made may be from -lr times the step's gradient and
still be taken for it: the rounding of the processes' reduction (DistributedDataParallel's average
of their gradients against the cockpit's global mean, about 1e-7 in float32) passes; a clip by
a factor below 1 - 1e-5 does not. (Where FSDP2 reduces in a coarser dtype, twice its eps.)"""
_WAITING = weakref.WeakSet()
"""The starts waiting for their update (weakly: a cockpit let go takes its own)."""
_CHECKING = weakref.WeakSet()
"""The SGD starts whose gradients are checked when SGD steps."""
_INSIDE = weakref.WeakSet()
"""The starts whose step's ``with`` block is open (an optimizer may step inside it)."""
_watching = []
_next_module_call = []


def _watch_optimizer_steps():
    """Register :func:`_optimizer_steps` and :func:`_optimizer_stepped` for every optimizer's
    steps, once a process."""
    if not _watching:
        _watching.append(register_optimizer_step_pre_hook(_optimizer_steps))
        _watching.append(register_optimizer_step_post_hook(_optimizer_stepped))


@torch.compiler.disable
def _optimizer_steps(optimizer, args, kwargs):
    """Before any optimizer's step: the starts whose ``with`` block is open and whose parameters
    it owns keep what it steps from (a step inside the block comes before their observation)."""
    if not _INSIDE:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for start in list(_INSIDE):
        start.before_step_inside(owned)


@torch.compiler.disable  # (a compiled function stepping the optimizer runs the hooks too)
def _optimizer_stepped(optimizer, args, kwargs):
    """After any optimizer's step (a wrapper's, as Accelerate's or Lightning's, steps the one
    it wraps, which this sees): the starts whose block is open take it as a step inside it; the
    SGD starts whose parameters it owns check the gradients it stepped with; the waiting starts
    whose parameters it owns project at the next module call."""
    if not _WAITING and not _CHECKING and not _INSIDE:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for start in list(_INSIDE):
        start.after_step_inside(owned)
    for start in list(_CHECKING):
        start.check_stepped_gradients(owned)
    stepped = [start.optimizer_stepped(owned) for start in list(_WAITING)]
    if any(stepped) and not _next_module_call:
        _next_module_call.append(register_module_forward_pre_hook(_project_stepped))


@torch.compiler.disable
def _project_stepped(module, args):
    """The first module call after an optimizer's step: the stepped starts project, in their
    own dtypes (outside the caller's autocast) and outside autograd."""
    _next_module_call.pop().remove()
    for start in list(_WAITING):
        with torch.no_grad(), outside_autocast(start._tracked):
            start.project_if_stepped()


def _alpha(update_size, losses, projected_gradients, loss_variances, gradient_variances):
    """α from the fitted quadratic, with -1 for concave fits or a zero step, None if it failed."""
    mu = _fit_quadratic(update_size, losses, projected_gradients, loss_variances, gradient_variances)
    if mu is None:
        return -1 if update_size == 0.0 else None
    if mu[2] < 0:
        return -1
    # The fit's far point at equal height is at -mu1/mu2; rescale so the minimum is 0 and it is 1.
    return 2 * update_size / (-mu[1] / mu[2]) - 1


def _fit_quadratic(t, fs, dfs, fs_var, dfs_var):
    """Maximum-likelihood quadratic w0 + w1 x + w2 x² from values and slopes at 0 and t.

    Observations are weighted by their inverse variances; zero variances become 1e-10.
    Returns None (and warns) if the system is singular.
    """
    tiny = 1e-10
    if 0 in fs_var:
        warnings.warn("The variance of f is 0, using a small value instead.", stacklevel=3)
        fs_var = [tiny if v == 0 else v for v in fs_var]
    if 0 in dfs_var:
        warnings.warn("The variance of df is 0, using a small value instead.", stacklevel=3)
        dfs_var = [tiny if v == 0 else v for v in dfs_var]
    if t == 0.0:
        warnings.warn("The two observations were (almost) at the same point.", stacklevel=3)
    # Rows: f(0), f(t), f'(0), f'(t) as linear functions of (w0, w1, w2).
    design = np.array([[1, 0, 0], [1, t, t**2], [0, 1, 0], [0, 1, 2 * t]])
    precision = np.diag(1.0 / np.array(fs_var + dfs_var))
    observed = np.array(fs + dfs)
    try:
        normal = design.T @ precision @ design
        return np.linalg.inv(normal) @ design.T @ precision @ observed
    except np.linalg.LinAlgError:
        warnings.warn("Couldn't compute a quadratic fit due to Singular matrix, returning None", stacklevel=3)
        return None
