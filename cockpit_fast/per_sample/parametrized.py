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
module's own ``weight_g`` and ``weight_v``) is chained alike. A weight norm (the legacy
one, or alone in its ``ParametrizationList``) has its vjp in closed form
(:class:`WeightNormVjp`): vmap batches torch's own by a loop over samples.

The parametrization is evaluated as autograd saw it, without side effects: in eval mode (a
spectral norm's power iteration is not differentiated, its ``u`` and ``v`` are constants) and
with the buffers it had when the layer was called (:func:`buffers_in_use`); the chaining never
changes its buffers.
"""

import contextlib
from functools import cached_property, partial
from types import SimpleNamespace

import torch
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm
from torch.nn.utils.weight_norm import WeightNorm

from cockpit_fast.per_sample import grads
from cockpit_fast.per_sample.grads import FactoredGrads, PerSampleGrads

PREFIX = "parametrizations."


def evaluates_a_parametrization(module, caller):
    """Whether a call of ``module`` made inside a call of ``caller`` evaluates a parametrization
    (a ``ParametrizationList``, or a parametrization it calls)."""
    return isinstance(module, parametrize.ParametrizationList) or isinstance(caller, parametrize.ParametrizationList)


def _parametrizations(module):
    """``{tensor name: ParametrizationList}`` of ``module``; {} for a module without any."""
    # Not getattr: Module.__getattr__ is slow where it misses. (A ScriptModule's _modules has no get.)
    lists = module._modules["parametrizations"] if "parametrizations" in module._modules else None
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
    for tensor, behind, evaluate, closed_vjp in _chains(module, buffers):
        wanted = {name: inner for name, (inner, _) in behind.items() if name in names}
        if tensor in made and wanted:
            linearized = Linearized(evaluate, dict(behind.values()), list(wanted.values()), closed_vjp)
            found.update({name: ChainedGrads(made[tensor], linearized, inner) for name, inner in wanted.items()})
    return found


def _chains(module, buffers):
    """``(tensor name, {name in module: (name in evaluate's values, parameter)}, evaluate,
    closed_vjp)`` of each tensor ``module`` computes from parameters, ``evaluate(values) ->
    tensor``, ``closed_vjp(values)`` the parametrization's vjp in closed form or None."""
    for tensor, plist in _parametrizations(module).items():

        def evaluate(values, plist=plist, state=buffers.get(tensor, {})):
            with _eval_mode([plist]):
                return functional_call(plist, {**values, **state}, ())

        alone = plist[0] if len(plist) == 1 else None
        closed_vjp = None
        if isinstance(alone, _WeightNorm):
            closed_vjp = partial(WeightNormVjp, g_name="original0", v_name="original1", dim=alone.dim)
        yield tensor, {f"{PREFIX}{tensor}.{inner}": (inner, p) for inner, p in plist.named_parameters()}, evaluate, closed_vjp
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):  # the legacy torch.nn.utils.weight_norm: from name_g and name_v

            def evaluate(values, hook=hook):
                return hook.compute_weight(SimpleNamespace(**values))  # reads the two as attributes

            g, v = (f"{hook.name}_{part}" for part in "gv")
            behind = {name: getattr(module, name) for name in (g, v)}
            closed_vjp = partial(WeightNormVjp, g_name=g, v_name=v, dim=hook.dim)
            yield hook.name, {name: (name, p) for name, p in behind.items()}, evaluate, closed_vjp


class WeightNormVjp:
    """The vjp of ``w = g v / ||v||`` (``torch._weight_norm``: norms over every dimension but
    ``dim``, or the whole tensor for ``dim == -1``) at ``values``, for a chunk of cotangents
    ``C``: ``<C, v / ||v||>`` per norm for ``g``, ``g / ||v|| (C - v / ||v|| <C, v / ||v||>)``
    for ``v``."""

    def __init__(self, values, g_name, v_name, dim):
        self.g_name, self.v_name = g_name, v_name
        g, v = values[g_name].detach(), values[v_name].detach()
        self.kept = dim % v.dim() if dim != -1 else None
        self.summed = tuple(d for d in range(v.dim()) if d != self.kept)
        norm = torch.linalg.vector_norm(v, dim=self.summed, keepdim=True)
        self.direction, self.scale, self.g_shape = v / norm, g.reshape(norm.shape) / norm, g.shape
        self._along = {}  # id(form) -> its closed form of <G_n, v / ||v||> per norm, or None

    def along(self, form):
        """``<G_n, v / ||v||>`` per norm (N, *g's shape) from the closed forms of ``form``
        (``G_n``), or None: a dot product per row of a weight gradient from its factors."""
        if id(form) not in self._along:
            found = form.dot(self.direction) if self.kept is None else None
            found = form.row_dots(self.direction) if self.kept == 0 else found
            self._along[id(form)] = None if found is None else found.reshape(-1, *self.g_shape)
        return self._along[id(form)]

    def __call__(self, cotangents, in_place, along=None, scaled=False):
        """``{name: (c, *shape)}``; ``in_place``: ``cotangents`` may be overwritten; ``along``:
        their :meth:`along` if known (else read from them, a product as large as they are);
        ``scaled``: ``cotangents`` come with ``g / ||v||`` in them (:meth:`scaled_range`)."""
        if along is None:
            along = (cotangents * self.direction).sum([d + 1 for d in self.summed])
        along = along.to(cotangents.dtype)
        by_norm = along.reshape(-1, *self.scale.shape)
        grad_v = cotangents.addcmul_ if in_place else partial(torch.addcmul, cotangents)
        if scaled:
            grad = grad_v(self.direction, by_norm * self.scale, value=-1)
        else:
            grad = grad_v(self.direction, by_norm, value=-1).mul_(self.scale)
        return {self.g_name: self.of_g(along, cotangents.dtype), self.v_name: grad}

    def scaled_range(self, form, start, stop, scratch):
        """The gradients ``G_n`` of samples ``start`` to ``stop`` of ``form`` times ``g / ||v||``
        (in ``scratch`` where given), formed with the scale in the factor of the rows it
        scales: no pass over them of its own. None where ``form`` is no weight's factors whose
        rows the norms keep."""
        if type(form) is not FactoredGrads or self.kept != 0 or form.left_size != self.scale.shape[0]:
            return None
        dtype = torch.promote_types(torch.promote_types(form.left.dtype, form.right.dtype), self.scale.dtype)
        left, right = (factor[start:stop].to(dtype) for factor in (form.left, form.right))
        part = FactoredGrads(left * self.scale.reshape(-1), right, form.shape)
        return part.dense_range(0, stop - start) if scratch is None else part.range_in(0, stop - start, scratch)

    def of_g(self, along, dtype):
        """``g``'s gradients (a new tensor) from their :meth:`along`: no cotangent needed."""
        return along.to(dtype, copy=True).reshape(-1, *self.g_shape)


class Linearized:
    """A tensor computed from parameters, evaluated at their current values, its graph kept:
    the vjp and jvp of its Jacobian there, for all parameters at once.

    The vjp of a chunk of cotangents is its closed form where there is one, else one batched
    backward pass (``torch.autograd.grad`` with ``is_grads_batched``, which vmaps the backward):
    measured faster than ``torch.func.vmap`` of a ``torch.func.vjp`` pullback. The jvp comes from the same graph by a double backward (a
    weight norm has no forward-mode derivative).

    Args:
        evaluate (callable): ``{name: value}`` of the parameters -> the tensor.
        params (dict): ``{name: parameter}``.
        wanted (list[str]): The parameters whose per-sample gradients are asked for, one at a time.
        closed_vjp (callable): ``values ->`` the vjp in closed form there
            (:class:`WeightNormVjp`), or None.
    """

    def __init__(self, evaluate, params, wanted, closed_vjp=None):
        values = {name: p.detach().requires_grad_() for name, p in params.items()}
        with torch.enable_grad():
            self.tensor = evaluate(values)
        self._closed_vjp = closed_vjp and closed_vjp(values)
        self.names, self.inputs = list(values), list(values.values())
        self.size = sum(p.numel() for p in self.inputs)
        self._wanted = set(wanted)
        self._kept, self._kept_values = {}, 0  # (id(form), start, stop, name) -> gradients not handed out yet

    def vjp(self, cotangents, fresh=False, along=None):
        """``{name: (c, *shape)}``: ``J^T`` of each of the ``(c, *tensor shape)`` cotangents
        (``fresh``: the caller's to overwrite; ``along``: their :meth:`WeightNormVjp.along`,
        where known, for the closed form)."""
        converted = cotangents.to(self.tensor.dtype)
        if converted.shape[0] == 0:
            return {name: p.new_zeros(0, *p.shape) for name, p in zip(self.names, self.inputs)}
        if self._closed_vjp is not None:
            return self._closed_vjp(converted, fresh or converted is not cotangents, along)
        cotangents = converted
        grad = lambda c, batched: torch.autograd.grad(  # noqa: E731
            self.tensor, self.inputs, c, retain_graph=True, is_grads_batched=batched, materialize_grads=True
        )
        try:
            found = grad(cotangents, True)
        except RuntimeError:  # an op that vmap cannot batch: one sample at a time
            found = [torch.stack(rows) for rows in zip(*(grad(c, False) for c in cotangents))]
        return dict(zip(self.names, found))

    def vjp_range(self, form, start, stop, name, scratch=None):
        """The gradients of parameter ``name`` for samples ``start`` to ``stop`` of ``form`` (the
        tensor's; formed in ``scratch``, a :class:`~cockpit_fast.per_sample.grads.Scratch`, where
        given). One pass gives every parameter's: the other wanted ones are kept for their
        turn (the statistics go through one parameter's chunks after another's), up to
        :data:`~cockpit_fast.per_sample.grads.CHUNK_VALUES` values."""
        kept = self._kept.pop((id(form), start, stop, name), None)
        if kept is not None:
            self._kept_values -= kept.numel()
            return kept  # handed out once: its caller may change it in place
        along = self._closed_vjp.along(form) if self._closed_vjp is not None else None
        if along is not None and name == self._closed_vjp.g_name:  # nothing to form
            return self._closed_vjp.of_g(along[start:stop], self.tensor.dtype)
        if along is None and len(self._wanted) > 1:
            scratch = None  # the other parameters' gradients are kept for their turn: not in memory the next chunk takes
        scaled = None if along is None else self._closed_vjp.scaled_range(form, start, stop, scratch)
        if scaled is not None:  # (fresh, in the dtype of the closed form's tensors)
            return self._closed_vjp(scaled, True, along[start:stop], scaled=True)[name]
        cotangents = form.dense_range(start, stop) if scratch is None else form.range_in(start, stop, scratch)
        found = self.vjp(cotangents, form.FRESH_RANGES, None if along is None else along[start:stop])
        kept_for_their_turn = found if along is None else {}  # (with along, g's come from it at its turn)
        for other, values in kept_for_their_turn.items():
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

    def range_in(self, start, stop, scratch):
        return self.linearized.vjp_range(self.form, start, stop, self.name, scratch)

    def dot(self, direction):
        """``<J^T G_n, d> = <G_n, J d>``: the tensor's closed form, where it has one."""
        if type(self.form).dot is PerSampleGrads.dot:  # none: no jvp to waste
            return None
        return self.form.dot(self.linearized.jvp(direction, self.name))
