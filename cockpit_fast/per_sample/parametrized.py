"""Per-sample gradients of the parameters behind a parametrization, chained through it.

A layer with a parametrization (``torch.nn.utils.parametrize.register_parametrization``;
``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``) computes a
tensor, its ``weight`` say, from the parameters of a ``ParametrizationList`` (``original``, or
``original0``, ``original1``, ..., and those of the parametrizations themselves) each time it
reads it. That inner call computes one tensor shared by every sample, so it is no call of its
own (:func:`evaluates_a_parametrization`): its parameters are left to the enclosing call. Where
the layer's rule gives the per-sample gradients ``G_n`` of the tensor, those of each parameter
behind it are ``J^T G_n``, ``J`` the Jacobian of the parametrization where the forward pass
evaluated it, the same for every sample (:class:`ChainedGrads`, :func:`chained_forms`). The
legacy ``torch.nn.utils.weight_norm`` (a forward pre-hook computing ``weight`` from the
module's own ``weight_g`` and ``weight_v``) is chained alike.

The parametrization is evaluated as autograd saw it, without side effects: in eval mode (a
spectral norm's power iteration is not differentiated, its ``u`` and ``v`` are constants) and
with the buffers it had when the layer was called (:func:`buffers_in_use`); the chaining never
changes its buffers.
"""

import contextlib
from functools import cached_property
from types import SimpleNamespace

import torch
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

from cockpit_fast.per_sample import grads
from cockpit_fast.per_sample.grads import PerSampleGrads

PREFIX = "parametrizations."


def evaluates_a_parametrization(module, caller):
    """Whether a call of ``module`` made inside a call of ``caller`` evaluates a parametrization
    (a ``ParametrizationList``, or a parametrization it calls)."""
    return isinstance(module, parametrize.ParametrizationList) or isinstance(caller, parametrize.ParametrizationList)


def _parametrizations(module):
    """``{tensor name: ParametrizationList}`` of ``module``; {} for a module without any."""
    lists = module._modules.get("parametrizations")  # not getattr: Module.__getattr__ is slow where it misses
    return lists if isinstance(lists, torch.nn.ModuleDict) else {}


def buffers_in_use(module):
    """``{tensor name: {buffer name: copy}}`` of the buffers of ``module``'s parametrizations as
    they are now, right after a call (a spectral norm's ``u`` and ``v`` change at every call in
    training mode); {} for a module without parametrizations."""
    lists = _parametrizations(module)
    return {tensor: {name: b.clone() for name, b in plist.named_buffers()} for tensor, plist in lists.items()}


def chained_names(module, names):
    """Those of ``names`` (parameters of a call of ``module``) behind ``module``'s parametrizations."""
    return {name for name in names if name.startswith(PREFIX)} if _parametrizations(module) else set()


@contextlib.contextmanager
def evaluated_as_in_forward(module):
    """Reads of ``module``'s parametrized tensors (by its rule) without side effects: its
    parametrizations in eval mode, each evaluated once (``parametrize.cached``)."""
    lists = _parametrizations(module)
    if not lists:
        yield
        return
    with _eval_mode(lists.values()), parametrize.cached():
        yield


@contextlib.contextmanager
def _eval_mode(modules):
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for m, _ in modes:
            m.training = False
        yield
    finally:
        for m, training in modes:
            m.training = training


def chained_forms(module, made, names, buffers):
    """``{name: ChainedGrads}`` of the ``names`` (a call's parameters) behind a tensor of
    ``module`` whose form its rule gave (``made``: ``{tensor name: form}``), the
    parametrizations evaluated with ``buffers`` (:func:`buffers_in_use` of that call)."""
    found = {}
    for tensor, behind, evaluate in _chains(module, buffers):
        wanted = {name: inner for name, (inner, _) in behind.items() if name in names}
        if tensor in made and wanted:
            linearized = Linearized(evaluate, dict(behind.values()), list(wanted.values()))
            found.update({name: ChainedGrads(made[tensor], linearized, inner) for name, inner in wanted.items()})
    return found


def _chains(module, buffers):
    """``(tensor name, {name in module: (name in evaluate's values, parameter)}, evaluate)`` of
    each tensor ``module`` computes from parameters, ``evaluate(values) -> tensor``."""
    for tensor, plist in _parametrizations(module).items():

        def evaluate(values, plist=plist, state=buffers.get(tensor, {})):
            with _eval_mode([plist]):
                return functional_call(plist, {**values, **state}, ())

        yield tensor, {f"{PREFIX}{tensor}.{inner}": (inner, p) for inner, p in plist.named_parameters()}, evaluate
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):  # the legacy torch.nn.utils.weight_norm: from name_g and name_v

            def evaluate(values, hook=hook):
                return hook.compute_weight(SimpleNamespace(**values))  # reads the two as attributes

            behind = {f"{hook.name}_{part}": getattr(module, f"{hook.name}_{part}") for part in "gv"}
            yield hook.name, {name: (name, p) for name, p in behind.items()}, evaluate


class Linearized:
    """A tensor computed from parameters, evaluated at their current values, its graph kept:
    the vjp and jvp of its Jacobian there, for all parameters at once.

    The vjp of a chunk of cotangents is one batched backward pass (``torch.autograd.grad`` with
    ``is_grads_batched``, which vmaps the backward): measured faster than ``torch.func.vmap`` of
    a ``torch.func.vjp`` pullback. The jvp comes from the same graph by a double backward (a
    weight norm has no forward-mode derivative).

    Args:
        evaluate (callable): ``{name: value}`` of the parameters -> the tensor.
        params (dict): ``{name: parameter}``.
        wanted (list[str]): The parameters whose per-sample gradients are asked for, one at a time.
    """

    def __init__(self, evaluate, params, wanted):
        values = {name: p.detach().requires_grad_() for name, p in params.items()}
        with torch.enable_grad():
            self.tensor = evaluate(values)
        self.names, self.inputs = list(values), list(values.values())
        self.size = sum(p.numel() for p in self.inputs)
        self._wanted = set(wanted)
        self._kept, self._kept_values = {}, 0  # (id(form), start, stop, name) -> gradients not handed out yet

    def vjp(self, cotangents):
        """``{name: (c, *shape)}``: ``J^T`` of each of the ``(c, *tensor shape)`` cotangents."""
        cotangents = cotangents.to(self.tensor.dtype)
        if cotangents.shape[0] == 0:
            return {name: p.new_zeros(0, *p.shape) for name, p in zip(self.names, self.inputs)}
        grad = lambda c, batched: torch.autograd.grad(  # noqa: E731
            self.tensor, self.inputs, c, retain_graph=True, is_grads_batched=batched, materialize_grads=True
        )
        try:
            found = grad(cotangents, True)
        except RuntimeError:  # an op that vmap cannot batch: one sample at a time
            found = [torch.stack(rows) for rows in zip(*(grad(c, False) for c in cotangents))]
        return dict(zip(self.names, found))

    def vjp_range(self, form, start, stop, name):
        """The gradients of parameter ``name`` for samples ``start`` to ``stop`` of ``form`` (the
        tensor's). One pass gives every parameter's: the other wanted ones are kept for their
        turn (the statistics go through one parameter's chunks after another's), up to
        :data:`~cockpit_fast.per_sample.grads.CHUNK_VALUES` values."""
        kept = self._kept.pop((id(form), start, stop, name), None)
        if kept is not None:
            self._kept_values -= kept.numel()
            return kept  # handed out once: its caller may change it in place
        found = self.vjp(form.dense_range(start, stop))
        for other, values in found.items():
            if other != name and other in self._wanted and self._kept_values + values.numel() <= grads.CHUNK_VALUES:
                self._kept[(id(form), start, stop, other)] = values
                self._kept_values += values.numel()
        return found[name]

    def jvp(self, direction, name):
        """``J d`` for a direction ``d`` of parameter ``name`` alone: the derivative of
        ``<J^T c, d>`` in ``c``."""
        index = self.names.index(name)
        with torch.enable_grad():
            probe = torch.zeros_like(self.tensor, requires_grad=True)
            pulled = torch.autograd.grad(self.tensor, self.inputs[index], probe, retain_graph=True, create_graph=True)[0]
            return torch.autograd.grad(pulled, probe, direction.to(pulled.dtype), materialize_grads=True, allow_unused=True)[0]


class ChainedGrads(PerSampleGrads):
    """Per-sample gradients ``J^T G_n`` of a parameter behind a parametrization, from the form of
    ``G_n``, the per-sample gradients of the tensor the parametrization computes.

    Args:
        form (PerSampleGrads): ``G_n``, the tensor's.
        linearized (Linearized): The parametrization, linearized where the forward pass evaluated it.
        name (str): The parameter's name there (``original``, ``original1``, ``weight_g``, ...).
    """

    FRESH_RANGES = True

    def __init__(self, form, linearized, name):
        self.form, self.linearized, self.name = form, linearized, name
        self.batch_size = form.batch_size
        self.shape = linearized.inputs[linearized.names.index(name)].shape

    @property
    def formed_per_sample(self):
        # A chunk forms the tensor's gradients, then those of every parameter behind it.
        return self.form.formed_per_sample + self.linearized.size

    @cached_property
    def grad(self):  # linear in G_n: J^T of the tensor's mini-batch gradient
        return self.linearized.vjp(self.form.grad.unsqueeze(0))[self.name][0]

    def dense_range(self, start, stop):
        return self.linearized.vjp_range(self.form, start, stop, self.name)

    def dot(self, direction):
        """``<J^T G_n, d> = <G_n, J d>``: the tensor's closed form, where it has one."""
        if type(self.form).dot is PerSampleGrads.dot:  # none: no jvp to waste
            return None
        return self.form.dot(self.linearized.jvp(direction, self.name))
