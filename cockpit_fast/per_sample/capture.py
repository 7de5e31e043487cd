"""Capturing the module calls behind per-sample gradients, for any model, without BackPACK.

A :class:`Capture` watches every module call of the process (global forward hooks) while it
lives. A call of a module that uses tracked parameters (its own, or those of submodules it
reads without calling them, as ``nn.MultiheadAttention`` reads its ``out_proj``) becomes a
:class:`Call`: its inputs and a hook on its outputs. When the outputs' gradients arrive during
a backward pass that the capture is armed for, the call and the gradients are kept; from them
:meth:`Call.forms` gives each parameter's per-sample gradients, by the module's rule
(:mod:`cockpit_fast.per_sample.rules`) or by replaying the call
(:mod:`cockpit_fast.per_sample.generic`). Uses of one parameter in several calls (a module
applied twice, weights tied across modules) add up.

The hook on the outputs holds the inputs: they live as long as the graph does, no longer.
"""

import weakref
from collections import defaultdict

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from cockpit_fast.per_sample import rules
from cockpit_fast.per_sample.generic import ModuleVjpGrads, replay_grads
from cockpit_fast.per_sample.grads import HookedGrads, combine


_replaying = [0]  # > 0 while a call is replayed: its inner calls are not new calls


class Call:
    """One call of a module that uses tracked parameters.

    Args:
        module: The module called.
        params (dict): Name in ``module`` -> tracked parameter the call uses.
        direct (set[str]): Which of them are the module's own (a rule serves only those).
        args, kwargs: The call's inputs.
        outputs (list[torch.Tensor]): Its tensor outputs that require grad.
    """

    def __init__(self, module, params, direct, args, kwargs, outputs, time_first=False):
        self.module, self.params, self.direct = module, params, direct
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        self.args = tuple(detach(a) for a in args)
        self.kwargs = {k: detach(v) for k, v in kwargs.items()}
        self.output_shapes = [torch.empty(o.shape, device="meta") for o in outputs]
        # Modules given sequences time-first (batch_first=False), and the modules they call,
        # keep their samples along dimension 1.
        self.sample_dim = 1 if time_first else 0
        first = outputs[0]
        self.batch_size = first.shape[self.sample_dim] if first.dim() > self.sample_dim else first.shape[0]
        self._replayed = None

    def needs_replay(self):
        """Whether some parameter of the call may take the generic route (no rule covers it)."""
        return rules.rule_for(self.module) is None or bool(set(self.params) - self.direct)

    def replays_randomness(self):
        """Whether replaying the call would draw random numbers (dropout in training mode)."""
        return any(
            isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in self.module.modules()
        ) or bool(getattr(self.module, "training", False) and getattr(self.module, "dropout", 0))

    def replay(self, start, stop, output_grads):
        """Per-sample gradients of every parameter of the call, samples ``start`` to ``stop``."""
        if self._replayed is None or self._replayed[0] != (start, stop):
            _replaying[0] += 1
            try:
                values = replay_grads(
                    self.module, self.params, self.args, self.kwargs, self.output_shapes, output_grads,
                    self.sample_dim, self.batch_size, start, stop,
                )
            finally:
                _replaying[0] -= 1
            self._replayed = ((start, stop), values)
        return self._replayed[1]

    def forms(self, output_grads):
        """``{name: form}`` of the call's parameters, given its outputs' gradients."""
        grads = [None if g is None else g.detach() for g in output_grads]
        found = {}
        rule = rules.rule_for(self.module)
        if rule is not None and len(grads) == 1 and grads[0] is not None and self.args:
            # Rules take the samples along dimension 0.
            first = lambda t: t.movedim(self.sample_dim, 0) if isinstance(t, torch.Tensor) and t.dim() > 1 else t  # noqa: E731
            # Inputs shared by every sample (a batch of one, broadcast) reach each of them.
            inputs = tuple(_broadcast(first(a), self.batch_size) for a in self.args)
            found = {name: form for name, form in (rule(self.module, inputs, first(grads[0])) or {}).items() if name in self.params}
        for name in self.params:
            if name not in found:
                found[name] = ModuleVjpGrads(self, name, grads)
        return found


def _broadcast(t, n):
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1 and n > 1:
        return t.expand(n, *t.shape[1:])
    return t


class Capture:
    """Captures the calls that use ``params`` while it lives.

    Args:
        params (list[torch.Tensor]): The tracked parameters.
    """

    def __init__(self, params):
        self._tracked = {id(p): p for p in params}
        self._frames = []  # (module, parameter ids claimed inside it, time-first) of every call under way
        self._batch = 1  # samples of the outermost call under way, once a call shows more than one
        self._owned = weakref.WeakKeyDictionary()  # module -> [(name, owner, param)] tracked within
        self._fired = None  # (call, output gradients) of the armed backward pass
        self.fired = []  # the same, of the last backward pass it was armed for
        self.hooked = set()  # ids of parameters with the user's hooks, when armed
        self.recent = weakref.WeakSet()  # calls whose graph is alive, for planning a step
        self.mixing = weakref.WeakSet()  # modules whose samples interact, seen since the last step
        me = weakref.ref(self)
        handles = [
            register_module_forward_pre_hook(lambda m, a: _call(me, "_enter", m)),
            register_module_forward_hook(lambda m, a, k, o: _call(me, "_exit", m, a, k, o), with_kwargs=True),
        ]
        weakref.finalize(self, lambda: [h.remove() for h in handles])

    def _enter(self, module):
        if not self._frames:
            self._batch = 1
        time_first = getattr(module, "batch_first", None) is False or (bool(self._frames) and self._frames[-1][2])
        self._frames.append((module, set(), time_first))

    def _exit(self, module, args, kwargs, output):
        while self._frames and self._frames[-1][0] is not module:  # a call that raised
            self._frames.pop()
        if not self._frames:
            return
        _, claimed_inside, time_first = self._frames.pop()
        params = {}
        if not _replaying[0] and torch.is_grad_enabled():
            if rules.mixes_samples(module):
                self.mixing.add(module)
            # Its own parameters, and its submodules' that no call inside it has claimed.
            params = {
                name: p for name, owner, p in self._owned_by(module) if owner is module or id(p) not in claimed_inside
            }
        outputs = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outputs:
            params = {}
        if self._frames:
            self._frames[-1][1].update(claimed_inside, (id(p) for p in params.values()))
        if not params:
            return None
        sample_dim = 1 if time_first else 0
        replaced = None
        if isinstance(output, torch.Tensor) and output.dim() > sample_dim:
            if output.shape[sample_dim] == 1 and self._batch > 1 and rules.rule_for(module) is not None:
                # One call shared by every sample (positions looked up once, broadcast): its output,
                # expanded, takes each sample's gradient; the expansion sums them as broadcasting did.
                replaced = output.expand(*output.shape[:sample_dim], self._batch, *output.shape[sample_dim + 1 :])
                outputs = [replaced]
            self._batch = max(self._batch, outputs[0].shape[sample_dim])
        direct = {name for name, owner, _ in self._owned_by(module) if owner is module}
        call = Call(module, params, direct, args, kwargs, outputs, time_first)
        self.recent.add(call)
        me = weakref.ref(self)
        torch.autograd.graph.register_multi_grad_hook(outputs, lambda grads: _call(me, "_fire", call, grads))
        return replaced

    def _owned_by(self, module):
        if module not in self._owned:
            self._owned[module] = [
                (name, owner, p)
                for owner_name, owner in module.named_modules(remove_duplicate=False)
                for short, p in owner.named_parameters(recurse=False)
                if id(p) in self._tracked and p.requires_grad
                for name in [f"{owner_name}.{short}" if owner_name else short]
            ]
        return self._owned[module]

    def _fire(self, call, grads):
        if self._fired is not None:
            self._fired.append((call, list(grads)))

    def arm(self):
        """Keep the calls whose outputs get gradients in the next backward pass."""
        self._fired = []
        # The user's hooks on parameters, applied to each sample's gradient (not ours, added later).
        self.hooked = {id(p) for p in self._tracked.values() if p._backward_hooks}

    def disarm(self, skip=()):
        """Stop keeping calls; returns ``{id(param): form}`` of what the backward pass reached,
        but for the parameters whose ids are in ``skip``."""
        fired, self._fired = self._fired or [], None
        self.fired = fired
        self.mixing = weakref.WeakSet()
        parts = defaultdict(list)
        for call, grads in fired:
            if all(id(p) in skip for p in call.params.values()):
                continue
            for name, form in call.forms(grads).items():
                parts[id(call.params[name])].append(form)
        forms = {}
        for key, found in parts.items():
            if key in skip:
                continue
            form = combine(found)
            if key in self.hooked:
                form = HookedGrads(form, list(self._tracked[key]._backward_hooks.values()))
            forms[key] = form
        return forms

    def owners(self):
        """Every live call's module and the ids of the tracked parameters it uses."""
        return [(call.module, {id(p) for p in call.params.values()}, call) for call in list(self.recent)]


def _call(ref, method, *args):
    capture = ref()
    return None if capture is None else getattr(capture, method)(*args)
