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

import contextlib
import sys
import types
import weakref
from collections import Counter, defaultdict

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from cockpit_fast.fsdp import Unsharded
from cockpit_fast.per_sample import parametrized, rules, shared
from cockpit_fast.per_sample.generic import ModuleVjpGrads, graph_nodes, replay_grads, replayed_by_autograd
from cockpit_fast.per_sample.grads import DenseGrads, HookedGrads, combine, samples_per_chunk


_replaying = [0]  # > 0 while a call is replayed: its inner calls are not new calls
_OWN_PASSES = []  # the captures whose engine runs a backward pass of its own, innermost last


def in_own_pass():
    """Whether the backward pass under way is one an engine runs itself (:func:`own_pass`): no
    step's gradient."""
    return bool(_OWN_PASSES)


@contextlib.contextmanager
def own_pass(capture):
    """A backward pass ``capture``'s engine runs (checks, proof, whole graph): no other capture,
    armed for its user's pass (a second cockpit's), keeps what the pass reaches."""
    _OWN_PASSES.append(capture)
    try:
        yield
    finally:
        _OWN_PASSES.pop()


class Call:
    """One call of a module that uses tracked parameters.

    Args:
        module: The module called.
        params (dict): Name in ``module`` -> tracked parameter the call uses.
        direct (set[str]): Which of them are the module's own (a rule serves only those).
        args, kwargs: The call's inputs.
        outputs (list[torch.Tensor]): Its tensor outputs that require grad.
        positions (list[int]): Where each of them is among all its tensor outputs.
        made (tuple[int, int]): The numbers autograd's nodes got in the call's thread while it ran
            (:func:`_own_nodes`).
    """

    def __init__(self, module, params, direct, args, kwargs, outputs, positions, made, time_first=False, inferred=False, unknown=False, guessed=False):
        self.module, self.params, self.direct = module, params, direct
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
        self.args = tuple(detach(a) for a in args)
        self.kwargs = {k: detach(v) for k, v in (kwargs or {}).items()}
        self.output_shapes = [o.shape for o in outputs]
        self.output_positions = positions
        self.rule = rules.rule_for(module)
        # Kept only for a rule that reads them (a recurrent layer's states): attention weights, say, can be large.
        self.outputs = [o.detach() for o in outputs] if getattr(self.rule, "reads_outputs", False) else None
        # Versions (counters shared with the caller's tensors) of what the forms read later and
        # autograd does not guard: a replay's or a raw rule's inputs, wherever they sit, and a
        # replay's parameters and buffers (a plain rule reads what autograd saved for the
        # parameters' gradients, which autograd refuses to see changed); the kept outputs; and
        # the outputs viewing another tensor whose hooks sit on them.
        replays = self.needs_replay()
        read = tree_flatten((self.args, self.kwargs))[0] if replays or self.rule.raw else []
        read += [*params.values(), *module.buffers()] if replays else []
        self._inputs_read = [(t, t._version) for t in read if _versioned(t)]
        self._kept_versions = [o._version for o in self.outputs] if self.outputs is not None else None
        self.hooked_views = []  # (the output, detached, its version): the caller may drop its own
        self.changed = None  # why what the forms read was changed in place since (changed_in_place())
        # Modules given sequences time-first (batch_first=False), and the modules they call,
        # keep their samples along dimension 1.
        self.sample_dim = 1 if time_first else 0
        first = outputs[0]
        packed = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.nn.utils.rnn.PackedSequence)]
        self.packed = bool(packed)
        if packed:  # a recurrent layer's: its data (tokens, features) has no dimension of samples
            self.batch_size = int(packed[0].batch_sizes[0])
        else:
            self.batch_size = first.shape[self.sample_dim] if first.dim() > self.sample_dim else first.shape[0]
        self.values = params  # what a replay computes with: the tensors the call used
        # Autocast as the call ran: its replays run under it too, and its gradients were rounded there.
        self.autocast = _autocast_state(outputs[0].device.type)
        self.computed_in = _computed_in(args, outputs, self.autocast)
        self._replayed = None
        self._replays = set()  # names whose forms replay the call
        self.spent = False  # a tracked backward pass went through it: no later step's (spend())
        # Why no hook on its outputs can take its parameters' gradients sample by sample (None: one
        # can), and which outputs the forms leave out (computed from others alone). A rule knows how
        # its module's outputs come about (a packed LSTM's own nodes, a thousand, cost more to
        # walk than its forward pass, and the objects made collections).
        self.outputs_entangled, self.derived_outputs = (None, ()) if self.rule is not None else _outputs_apart(module, outputs, made)
        self.shared = False  # made once for every sample: its gradients come from broadcasts
        self.rows_per_sample = False  # broadcast to rows that are several of each sample's (taken sample-major)
        self.routed = None  # a routed.Regrouping where its rows are not the batch's samples
        self.ungrouped_from = None  # the Regrouping routed.ungroup took back (gradients taken under it)
        self.layout_inferred = inferred  # its sample dimension read from sizes (or the proof): no batch_first said it
        self.layout_unknown = unknown  # as many positions as samples, of a module found both ways
        self.layout_guessed = guessed  # as many positions as samples, of a module never found either way
        first_input = next((a for a in args if isinstance(a, torch.Tensor)), None)
        # Where its rows came from (routed tokens, flattened ones): routed.regroup reads it.
        has_graph = first_input is not None and first_input.grad_fn is not None
        self.input_node = (first_input.grad_fn, first_input.output_nr) if has_graph else None

    def spend(self):
        """A tracked backward pass went through the call: the next step's forward pass is
        another (a later pass through a graph the user keeps still fires its hooks)."""
        self.spent = True

    def changed_in_place(self):
        """Before the backward pass: why the call's forms cannot be taken from what it kept
        (:attr:`changed`, None where they can). An input changed in place since the call ran
        would be read changed (by a replay, a recurrent layer's or attention's rule: autograd
        refuses only where it saved the input itself); so would its outputs, which a recurrent
        layer's rule then computes again; and an output viewing another tensor, hooked on
        itself, no longer reaches its hook once changed."""
        if self.outputs is not None and [o._version for o in self.outputs] != self._kept_versions:
            self.outputs = None
        if any(t._version != version for t, version in self._inputs_read):
            self.changed = (
                "an input, parameter or buffer of its call was changed in place after the call (its forms would read the "
                "changed values)"
            )
        elif any(view._version != version for view, version in self.hooked_views):
            self.changed = "an output of its call, a view of another tensor, was changed in place after the call (no hook follows it)"
        return self.changed

    def share(self, n, rows_per_sample=False):
        """Take the call as made once for each of ``n`` samples, its output broadcast to them
        (:mod:`cockpit_fast.per_sample.shared` gives its output gradient sample by sample;
        ``rows_per_sample``: to rows that are several of each sample's)."""
        expand = lambda t: t.unsqueeze(0).expand(n, *t.shape) if isinstance(t, torch.Tensor) else t  # noqa: E731
        self.args = tuple(expand(a) for a in self.args)
        self.kwargs = {k: expand(v) for k, v in self.kwargs.items()}
        self.output_shapes = [torch.Size((n, *shape)) for shape in self.output_shapes]
        self.outputs = None  # made once: not each sample's
        self.sample_dim, self.batch_size, self.shared, self._replayed = 0, n, True, None
        self.rows_per_sample = rows_per_sample

    @property
    def layout_found(self):
        """Whether where its samples are was found (:attr:`layout_inferred`, a tensor with
        positions besides the samples and features), not told or taken apart."""
        return self.layout_inferred and len(self.output_shapes[0]) > 2 and not self.shared and self.routed is None

    def may_be_time_first(self, n):
        """Whether the call's samples may be along dimension 1 where they were taken along 0: its
        output holds ``n`` along both (as many positions as samples, T == N) and neither its
        module nor a caller says (``batch_first``)."""
        shape = self.output_shapes[0]
        return self.layout_found and self.sample_dim == 0 and not self.packed and _as_many_positions_as_samples(shape, n)

    def take_time_first(self):
        """Take the call's samples along dimension 1 (:meth:`may_be_time_first`)."""
        self.sample_dim, self._replayed = 1, None

    @property
    def size(self):
        """How many values the call's parameters hold: what a replay forms per sample."""
        return sum(p.numel() for p in self.params.values())

    def served_by_rule(self, names):
        """Whether the module's rule alone gives the forms of its parameters ``names``, from
        tensors at hand inside the backward pass (no replay, no parametrization chained; a
        rule may still decline the call, leaving :attr:`_replays` after :meth:`forms`)."""
        return self.rule is not None and set(names) <= self.direct

    def needs_replay(self):
        """Whether some parameter of the call may take the generic route (no rule covers it)."""
        chained = parametrized.chained_names(self.module, self.params)  # the rule's, through a parametrization
        return self.rule is None or bool(set(self.params) - self.direct - chained)

    def sample_dim_of(self, index):
        """Where the call's ``index``-th tensor output holds its samples; None where it holds
        none (a packed sequence's data: tokens of every sample)."""
        if isinstance(self.module, torch.nn.RNNBase) and not self.shared and self.routed is None:
            if index == 0:
                return None if self.packed else (0 if self.module.batch_first else 1)
            return 1  # the final states, (layers * directions, N, hidden) whatever batch_first says
        return self.sample_dim

    def route_of(self, name):
        """How the call gives parameter ``name`` its per-sample gradients, in words."""
        replayed = "one sample at a time by autograd" if replayed_by_autograd(self.module) else "with torch.func"
        how = f"replayed {replayed}" if name in self._replays else "rule"
        how += ", rows regrouped by sample" if self.routed is not None else ""
        return f"module-local: {type(self.module).__name__} {how}"

    def replays_randomness(self):
        """Whether replaying the call would draw random numbers (dropout in training mode)."""
        return any(
            isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in self.module.modules()
        ) or (self.module.training and isinstance(getattr(self.module, "dropout", None), float) and self.module.dropout > 0)

    def as_it_ran(self):
        """The autocast state the call ran under, for computing again what it computed."""
        return torch.autocast(*self.autocast) if self.autocast else contextlib.nullcontext()

    def replay(self, start, stop, output_grads):
        """Per-sample gradients of every parameter of the call, samples ``start`` to ``stop``."""
        if self._replayed is None or self._replayed[0] != (start, stop):
            _replaying[0] += 1
            try:
                with self.as_it_ran():
                    values = replay_grads(
                        self.module, self.values, self.args, self.kwargs,
                        [torch.empty(shape, device="meta") for shape in self.output_shapes], self.output_positions,
                        output_grads, self.sample_dim, self.batch_size, start, stop,
                        rows=self.routed is not None or self.shared,  # (a shared call's: its inputs as they were)
                    )
            finally:
                _replaying[0] -= 1
            self._replayed = ((start, stop), values)
        return self._replayed[1]

    def forms(self, output_grads):
        """``{name: form}`` of the call's parameters, given its outputs' gradients."""
        grads = [None if g is None or i in self.derived_outputs else g.detach() for i, g in enumerate(output_grads)]
        args, grads = _in_narrowest_dtype(self.args, grads)
        made, rule = {}, self.rule
        # A rule reading a parametrized tensor, and the chaining, evaluate parametrizations: no new calls.
        _replaying[0] += 1
        try:
            with parametrized.evaluated_as_in_forward(self.module), self.as_it_ran():
                if rule is not None and rule.raw:
                    made = rule(self.module, args, self.kwargs, self.outputs, grads, self.sample_dim) or {}
                elif rule is not None and len(grads) == 1 and grads[0] is not None and args:
                    # Rules take the samples along dimension 0.
                    first = lambda t: t.movedim(self.sample_dim, 0) if isinstance(t, torch.Tensor) and t.dim() > 1 else t  # noqa: E731
                    # Inputs shared by every sample (a batch of one, broadcast) reach each of them.
                    inputs = tuple(_broadcast(first(a), self.batch_size) for a in args)
                    if self.routed is not None and rule.channel_first:  # (N, P, C, ...): on the rows, summed
                        made = _summed_by_sample(rule, self.module, inputs, grads[0], self.routed)
                    else:
                        made = rule(self.module, inputs, first(grads[0])) or {}
            found = {name: form for name, form in made.items() if name in self.params}
            found.update(parametrized.chained_forms(self.module, made, self.params, self.parametrization_buffers))
        finally:
            _replaying[0] -= 1
        self._replays = {name for name in self.params if name not in found}
        for name in self._replays:
            found[name] = ModuleVjpGrads(self, name, grads)
        return found


def _summed_by_sample(rule, module, inputs, output_grad, regrouping):
    """Forms of a channel-first rule's parameters on a call whose rows were regrouped by sample:
    the rule runs on the call's own rows (a batch norm's statistics are theirs, no padding),
    a chunk of rows at a time where rows do not interact, and each sample's rows are summed."""
    inputs, output_grad = tuple(regrouping.rows_of(a) for a in inputs), regrouping.rows_of(output_grad)
    samples, rows = regrouping.samples, output_grad.shape[0]
    values_per_row = sum(p.numel() for p in module.parameters(recurse=False))
    size = max(1, rows) if rules.mixes_samples(module) else samples_per_chunk(values_per_row)
    summed = {}
    for start in range(0, max(1, rows), size):  # (once where no row holds a sample: zeros)
        part = lambda t: t[start : start + size] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows else t  # noqa: E731
        for name, form in (rule(module, tuple(part(a) for a in inputs), part(output_grad)) or {}).items():
            values = form.dense()
            if name not in summed:
                summed[name] = values.new_zeros(regrouping.n, *values.shape[1:])
            summed[name].index_add_(0, samples[start : start + size], values)
    return {name: DenseGrads(values) for name, values in summed.items()}


def _in_narrowest_dtype(args, grads):
    """A call's inputs and output gradients in the narrowest floating dtype among them: under
    autocast a layer computes in it (a float32 input, a bfloat16 output gradient)."""
    floating = [t for t in (*args, *grads) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    narrowest = min((t.dtype for t in floating), key=lambda d: torch.finfo(d).bits, default=None)
    if all(t.dtype == narrowest for t in floating):
        return args, grads
    cast = lambda t: t.to(narrowest) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return tuple(cast(a) for a in args), [cast(g) for g in grads]


def _as_many_positions_as_samples(shape, n):
    """Whether an output of ``shape`` holds ``n`` along its first two dimensions besides its
    features (T == N): its sizes cannot tell where its samples are."""
    return len(shape) > 2 and shape[0] == shape[1] == n


def least_precise(dtypes):
    """The floating dtype of the largest machine epsilon among ``dtypes`` (None where none)."""
    return max((d for d in dtypes if d is not None), key=lambda d: torch.finfo(d).eps, default=None)


def _autocast_state(device):
    """``(device, dtype, enabled)`` as autocast stands for ``device`` now (None where the device
    has no autocast: meta tensors)."""
    try:
        return device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
    except RuntimeError:
        return None


def outside_autocast(params):
    """Autocast off on the devices of ``params`` (and the CPU): the engine's and the statistics'
    own arithmetic in the dtypes they pick, wherever the caller's step runs (inside autocast,
    CUDA would sum a bf16 gradient in float32 and multiply float32 factors in bf16); the calls'
    rules and replays compute under the autocast each call ran under (:meth:`Call.as_it_ran`).
    A context manager; where autocast is off already, one that does nothing (entered once or
    twice a parameter in the backward pass: its cost counts)."""
    on = [device for device in {"cpu", *(p.device.type for p in params)} if _autocast_on(device)]
    return _autocast_off(on) if on else contextlib.nullcontext()


@contextlib.contextmanager
def _autocast_off(devices):
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _autocast_on(device):
    """Whether autocast is on for the device type ``device`` (never for those without it: meta)."""
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:
        return False


def _computed_in(args, outputs, autocast):
    """The least precise dtype a call computed in: its floating tensors', or autocast's where it
    was on (its gradient is rounded there, whatever dtype the call returns)."""
    dtypes = [t.dtype for t in (*args, *outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if autocast is not None and autocast[2]:
        dtypes.append(autocast[1])
    return least_precise(dtypes)


def _own_nodes(starts, made, stops=frozenset()):
    """The autograd nodes a call made, from those in ``starts`` (its outputs') down, and the
    leaves they reach, not going past the edges ``stops`` (its other outputs): autograd numbers
    the nodes a thread makes in order, and ``made`` is the range of numbers the call's thread
    gave while it ran (its inputs' numbers cannot tell: another thread, numbering on its own,
    may have made them, and the call may change one in place)."""
    first, last = made
    seen, stack = set(), list(starts)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        number = node._sequence_nr()
        if not (first <= number < last or number == _LEAF):
            continue
        seen.add(node)
        stack += [next_node for next_node, nr in node.next_functions if (next_node, nr) not in stops]
    return seen


_LEAF = 2**64 - 1
"""The number autograd gives the nodes of leaves (AccumulateGrad): after every other."""


def _versioned(value):
    """Whether ``value`` is a tensor that counts its changes in place (not an inference tensor)."""
    return isinstance(value, torch.Tensor) and not value.is_inference()


def _computed_inside(node, made):
    """The least precise floating dtype among the values of a call's own autograd nodes, from
    its output's ``node`` down (:func:`_own_nodes`): a cast inside its forward, as Gemma's norm
    computes a float64 model's values in float32, rounds its parameters' gradients there; and
    whether one of them is cuDNN's (a convolution or a recurrent layer, :func:`_float32_on_gpu`)."""
    nodes = _own_nodes([node], made)
    dtypes = [meta.dtype for node in nodes for meta in node._input_metadata if meta.dtype.is_floating_point]
    cudnn = any(type(node).__name__.startswith(("Convolution", "CudnnRnn", "CudnnConvolution")) for node in nodes)
    return least_precise(dtypes), cudnn


def _outputs_apart(module, outputs, made):
    """``(why, derived)``: why the hooks on a call's several outputs cannot give its parameters'
    gradients sample by sample (None where they can), and the indices of the outputs computed
    from others it returns alone (a view or function of them, as the call's own nodes show,
    as a router's weights are of its logits), whose gradients the hooks on those others get too:
    their forms leave them out, not counting them twice. An output that is one of its
    parameters is used by its caller, outside the call; one computed from another that the
    parameters reach, and from the parameters by a way of its own, cannot be told apart."""
    if len(outputs) == 1 and outputs[0].grad_fn is not None:  # (most calls)
        return None, ()
    own = {id(p) for p in module.parameters()}
    if any(o.grad_fn is None and id(o) in own for o in outputs):
        return "returns one of its parameters itself (its caller uses it outside the call)", ()
    edges = {(o.grad_fn, o.output_nr) for o in outputs if o.grad_fn is not None}
    derived = []
    for index, output in enumerate(outputs):
        if output.grad_fn is None:
            continue
        others = edges - {(output.grad_fn, output.output_nr)}
        reached = _own_nodes([output.grad_fn], made, others)
        sources = {edge for node in reached for edge in node.next_functions if edge in others}
        if not any(id(getattr(node, "variable", None)) in own for node in _own_nodes([node for node, _ in sources], made)):
            continue  # computed from no other output the parameters reach
        if any(id(getattr(node, "variable", None)) in own for node in reached):
            return (
                "returns an output computed from another it returns (a view or function of it) and from its "
                "parameters by a way of its own, whose gradients no hook tells apart"
            ), ()
        derived.append(index)
    return None, tuple(derived)


TF32 = torch.float16
"""Stands for TF32 where only the machine epsilon counts (the sum check's): TF32 keeps 10 bits
of float32's mantissa, as float16 does."""


def _float32_on_gpu(dtype, device, cudnn):
    """The precision a GPU multiplies a call's float32 values in, as a dtype of its epsilon,
    where it is below float32 (None elsewhere): TF32 in cuDNN's convolutions and recurrent
    layers (``cudnn``) unless ``torch.backends.cudnn.allow_tf32`` is off (it is on by default:
    their parameters' gradients are rounded there), and in matrix products as
    ``torch.set_float32_matmul_precision`` allows (bfloat16's where it says "medium")."""
    if dtype != torch.float32 or device.type != "cuda":
        return None
    if cudnn and torch.backends.cudnn.allow_tf32:
        return TF32
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return torch.bfloat16
    return TF32 if precision == "high" or torch.backends.cuda.matmul.allow_tf32 else None


def _broadcast(t, n):
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == 1 and n > 1:
        return t.expand(n, *t.shape[1:])
    return t


class Capture:
    """Captures the calls that use ``params`` while it lives.

    Args:
        params (list[torch.Tensor]): The tracked parameters.
        unsharded (Unsharded, optional): The tensors FSDP2 computes the tracked parameters
            with, where it shards them (by default found here).
    """

    def __init__(self, params, unsharded=None):
        self._tracked = {id(p): p for p in params}
        self.unsharded = Unsharded(params) if unsharded is None else unsharded
        self._frames = []  # (module, parameter ids claimed inside it, time-first) of every call under way
        self._batch = 1  # samples of the outermost call under way, once a call shows more than one
        self._owned = weakref.WeakKeyDictionary()  # module -> [(name, owner, param, short name, held)] tracked within
        self._setups = weakref.WeakKeyDictionary()  # module -> its module_setup at its last call
        # A module called since the engine's last checks was set up otherwise than at its call before.
        self.set_up_otherwise = False
        self._casts_inside = weakref.WeakKeyDictionary()  # module -> {device type: (least precise dtype of its own nodes, cuDNN's?)}
        self._fired = None  # (call, output gradients) of the armed backward pass
        self._reached = {}  # call -> its output gradients in the armed pass, of a call with several outputs
        # id(output gradients of a fire) -> the forms of its call's parameters not taken yet in the armed pass
        # (take()); by fire, not by call: a call shared by every sample fires at each place it is broadcast.
        self._formed = {}
        self._holding = {}  # id(param) -> the (call, output gradients) of the armed pass that use it
        self._handed_out = set()  # ids of the parameters whose forms take() gave in the armed pass
        self._root = None  # the outermost module with tracked parameters last called, for names
        self._keep = None
        self.hooked = set()  # ids of parameters with the user's hooks, when armed
        self.recent = weakref.WeakSet()  # calls whose graph is alive, for planning a step
        self._mixing = weakref.WeakSet()  # calls of modules whose samples interact, graph alive
        # module -> the dimensions its calls were found to hold their samples along, by sizes or the
        # proof, where neither it nor a caller says (batch_first): read where sizes cannot tell (T == N).
        self.layouts = weakref.WeakKeyDictionary()
        me = weakref.ref(self)
        # Python bookkeeping, hidden from torch.compile: compiled models call it between graphs.
        self._enter_hook = torch.compiler.disable(lambda m, a: _call(me, "_enter", m, a))
        self._leave_hook = torch.compiler.disable(lambda m, a, *rest: _call(me, "_exit", m, a, *rest))
        self._handles = []  # the global hooks while watching (one list: the finalizer removes what it holds)
        self.watch(True)
        weakref.finalize(self, lambda handles=self._handles: [h.remove() for h in handles])

    @property
    def watching(self):
        """Whether module calls are recorded (every forward pass pays torch's hook path then)."""
        return bool(self._handles)

    def watch(self, on):
        """Record module calls from now on, or stop: forward passes that no backward pass needs
        per-sample gradients of then cost what they cost without a capture."""
        if on and not self._handles:
            self._handles.extend([
                register_module_forward_pre_hook(self._enter_hook),
                # always_call: a forward that raises must not leave its frame behind.
                register_module_forward_hook(self._leave_hook, with_kwargs=True, always_call=True),
            ])
        elif not on:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._frames.clear()

    def _enter(self, module, args):
        # __dict__: plain attributes only, without Module.__getattr__'s slow path on every call.
        time_first = module.__dict__.get("batch_first") is False or (bool(self._frames) and self._frames[-1][2])
        if not self._frames:  # the model's input shows its samples (a first call may not: positions looked up)
            self._batch = _samples_in(args or tuple(_keyword_inputs().values()), 1 if time_first else 0)
        self._frames.append((module, set(), time_first, torch._C._autograd._get_sequence_nr()))

    def _exit(self, module, args, kwargs=None, output=None):  # no output: the forward raised
        while self._frames and self._frames[-1][0] is not module:  # a call that raised
            self._frames.pop()
        if not self._frames:
            return
        _, claimed_inside, time_first, made_from = self._frames.pop()
        made = (made_from, torch._C._autograd._get_sequence_nr())
        if _replaying[0] or not torch.is_grad_enabled():
            return None
        setup = module_setup(module)
        if self._setups.setdefault(module, setup) != setup:  # (any module: a hook that mixes samples on an activation)
            self._setups[module] = setup
            self.set_up_otherwise = True
            self._owned.pop(module, None)
        # Whether a parameter is trained may change between steps (gradual unfreezing).
        owned = [entry[:3] for entry in self._owned_by(module) if entry[2].requires_grad]
        mixing = rules.mixes_samples(module)
        if not owned and not mixing:  # nothing to see: the common case
            if self._frames:
                self._frames[-1][1].update(claimed_inside)
            return None
        if not self._frames and owned and torch._C._current_graph_task_id() == -1:
            # The model, whose names the engine reports (not a block that activation
            # checkpointing recomputes alone in the backward pass).
            self._root = weakref.ref(module)
        if owned and module.__dict__.get("sparse") is True:
            raise ValueError(
                f"{type(module).__name__}(sparse=True) gives its weight a sparse gradient, which the per-sample "
                "statistics do not read: track it with sparse=False (the same gradient, dense)"
            )
        if self._frames and parametrized.evaluates_a_parametrization(module, self._frames[-1][0]):
            # One tensor for every sample: its parameters are left to the enclosing call, whose
            # rule's forms are chained through the parametrization.
            self._frames[-1][1].update(claimed_inside)
            return None
        tensors = [o for o in tree_flatten(output)[0] if isinstance(o, torch.Tensor)]
        positions = [i for i, o in enumerate(tensors) if o.requires_grad]  # (a mask returned first: not one)
        outputs = [tensors[i] for i in positions]
        if mixing and outputs:
            token = _Mixing(module)  # lives as long as the graph through this call
            self._mixing.add(token)
            outputs[0].register_hook(lambda grad, token=token: None)
        # Its own parameters, and its submodules' that no call inside it has claimed; not those
        # it is handed, or views of them (DBRX's experts hand their GLU each expert's slice of
        # its weights): the caller uses them, and its call claims them.
        handed = {id(a if a._base is None else a._base) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        params = {
            name: p for name, owner, p in owned if (owner is module or id(p) not in claimed_inside) and id(p) not in handed
        } if outputs else {}
        if self._frames:
            self._frames[-1][1].update(claimed_inside, (id(p) for p in params.values()))
        if not params:
            return None
        sample_dim = 1 if time_first else 0
        inferred = not time_first and "batch_first" not in module.__dict__  # (neither it nor a caller says)
        layout_unknown = layout_guessed = False
        replaced = None
        if shared.is_shared_lookup(module, args, output, sample_dim, self._batch):
            # Positions looked up once, (1, T), and broadcast over the samples: the output, expanded
            # (a view), takes each sample's gradient, and the expansion sums them as broadcasting did.
            replaced = output.expand(self._batch, *output.shape[1:])
            outputs = [replaced]
        elif self._batch == 1 and outputs[0].dim() > sample_dim:
            self._batch = outputs[0].shape[sample_dim]  # the first call of the forward pass sets it
        elif not time_first and outputs[0].dim() > 2 and outputs[0].shape[0] != self._batch == outputs[0].shape[1]:
            # Sequences time-first from a parent that says nothing (nn.TransformerEncoderLayer's
            # feed-forward); the proof of the first step confirms it. (Not (rows, features):
            # routed tokens' rows with as many features as samples.)
            time_first = True
        elif inferred and _as_many_positions_as_samples(outputs[0].shape, self._batch):
            # As many positions as samples (T == N): as the module's calls were found before;
            # a guess (batch first) where they never were.
            found = self.layouts.get(module)
            time_first, layout_unknown, layout_guessed = found == {1}, found == {0, 1}, found is None
        direct = {name for name, owner, _ in owned if owner is module}
        call = Call(module, params, direct, args, kwargs, outputs, positions, made, time_first, inferred, layout_unknown, layout_guessed)
        inside = self._casts_inside.setdefault(module, {})
        device = outputs[0].device
        if device.type not in inside:  # (its code's casts: read once per device, on its first call there)
            inside[device.type] = _computed_inside(outputs[0].grad_fn, made)
        cast, cudnn = inside[device.type]
        computed_in = least_precise([call.computed_in, cast])
        call.computed_in = least_precise([computed_in, _float32_on_gpu(computed_in, device, cudnn)])
        if self.unsharded.active and call.needs_replay():
            # FSDP2 frees the unsharded values after the pass: a replay keeps its own (norms' weights, mostly).
            call.values = {name: module.get_parameter(name).detach().clone() for name in params}
        if outputs[0].grad_fn is not None:  # found there if the call turns out shared by every sample
            _tag(outputs[0].grad_fn, shared.CALL_TAG, call)
        call.parametrization_buffers = parametrized.buffers_in_use(module)  # as this call used them
        self.recent.add(call)
        me = weakref.ref(self)
        wanted = lambda: _call(me, "_wants", call)  # noqa: E731
        # None on a leaf (a parameter handed out): the hook would stay on it.
        if len(outputs) == 1 and outputs[0].grad_fn is not None:
            _hook_output_grad(call, outputs[0], (), made, lambda grad: _call(me, "_fire", call, [grad]), wanted)
        elif len(outputs) > 1:  # (not torch's multi-grad hook: it and the outputs' nodes hold each other, a reference cycle)
            for index, out in enumerate(outputs):
                if out.grad_fn is not None:
                    others = outputs[:index] + outputs[index + 1 :]
                    fire = lambda grad, index=index: _call(me, "_fire_output", call, index, grad)  # noqa: E731
                    _hook_output_grad(call, out, others, made, fire, wanted)
        return replaced

    @property
    def root(self):
        """The outermost module with tracked parameters last called (None: none yet, or gone)."""
        return None if self._root is None else self._root()

    @property
    def mixing(self):
        """Modules whose samples interact, in a graph still alive."""
        return [token.module for token in self._mixing]

    def _owned_by(self, module):
        """``[(name, owner, tracked parameter, short name, tensor held)]`` of the tracked
        parameters ``module`` holds (under FSDP2, the unsharded tensors it holds while it runs
        stand for them), as its submodules hold them now (a pruning registered since renames a
        weight, also on a submodule it reads without calling; its own setup's changes drop the
        entry in :meth:`_exit`)."""
        found = self._owned.get(module)
        if found is not None and all(_parameter(owner, short) is p for _, owner, _, short, p in found):
            return found
        if found is not None:  # (a submodule's parameters renamed, moved or replaced: it is checked again)
            self.set_up_otherwise = True
        entries = [
            (name, owner, tracked, short, p)
            for owner_name, owner in module.named_modules(remove_duplicate=False)
            for short, p in owner.named_parameters(recurse=False)
            for tracked in [self._tracked[id(p)] if id(p) in self._tracked else self.unsharded.tracked(p)]
            if tracked is not None
            for name in [f"{owner_name}.{short}" if owner_name else short]
        ]
        self._owned[module] = entries
        return entries

    def fire_broadcast(self, call, grads):
        """The output gradients of a call shared by every sample, from where it is broadcast."""
        self._fire(call, grads, broadcast=True)

    def _fire(self, call, grads, broadcast=False):
        # A shared call's output gets the samples' gradients summed: its broadcasts' count instead.
        if self.armed and call.shared == broadcast:
            self._add_fired(call, [self._taken(call, g, i) for i, g in enumerate(grads)])

    def _wants(self, call):
        """Whether the pass under way keeps ``call``'s own output gradients (:meth:`_fire`)."""
        return self.armed and not call.shared

    def _fire_output(self, call, index, grad):
        """The gradient of one of a call's several outputs, gathered with the others the pass
        gives it (None for those it does not reach)."""
        if self._wants(call):
            grads = self._reached.get(call)
            if grads is None:
                grads = self._reached[call] = [self._taken(call, None, i) for i in range(len(call.output_shapes))]
                self._add_fired(call, grads)
            grads[index] = self._taken(call, grad, index)

    def _add_fired(self, call, grads):
        self._fired.append((call, grads))
        for p in call.params.values():  # (take() looks them up by parameter)
            self._holding.setdefault(id(p), []).append((call, grads))

    def _taken(self, call, grad, index):
        if grad is not None and call.routed is not None:  # rows that are not the samples, regrouped as its inputs were
            grad = call.routed(grad)
        return self._keep(call, grad, index) if self._keep else grad

    @property
    def armed(self):
        """Whether the backward pass under way keeps the calls' gradients (:meth:`arm`): not
        where another capture's engine runs it (:func:`own_pass`)."""
        return self._fired is not None and (not _OWN_PASSES or _OWN_PASSES[-1] is self)

    def arm(self, keep=None):
        """Keep the calls whose outputs get gradients in the next backward pass, and those
        gradients (or what ``keep(call, gradient, output index)`` makes of each)."""
        self._fired, self._keep, self._reached, self._formed, self._handed_out = [], keep, {}, {}, set()
        self._holding = {}
        # The user's hooks on parameters, applied to each sample's gradient.
        self.hooked = {id(p) for p in self._tracked.values() if users_hooks(p)}

    def disarm(self, skip=(), forms=True):
        """Stop keeping calls; returns ``{id(param): form}`` of what the backward pass reached
        (none without ``forms``), but for the parameters whose ids are in ``skip``, and the
        ``(call, output gradients)`` it reached."""
        fired, self._fired, self._reached, self._holding = self._fired or [], None, {}, {}
        skip = {*skip, *self._handed_out}
        formed, self._formed, self._handed_out = self._formed, {}, set()
        if self._keep is not None or not forms:  # fingerprints, or a pass that failed: no forms
            self._keep = None
            return {}, fired
        parts, computed_in = defaultdict(list), defaultdict(list)
        for call, grads in fired:
            if all(id(p) in skip for p in call.params.values()):
                continue
            for name, form in (formed.get(id(grads)) or call.forms(grads)).items():
                parts[id(call.params[name])].append(form)
                computed_in[id(call.params[name])].append(call.computed_in)
        forms = {key: self._form(key, found, computed_in[key]) for key, found in parts.items() if key not in skip}
        return forms, fired

    def _form(self, key, parts, computed_in):
        """Parameter ``key``'s form from its calls' ``parts``, computed in those dtypes."""
        form = combine(parts)
        form.computed_in = least_precise(computed_in)
        return HookedGrads(form, users_hooks(self._tracked[key])) if key in self.hooked else form

    def take(self, key):
        """While armed, once tracked parameter ``key``'s gradient in the backward pass under way
        is final (every call using it fired before): its form as :meth:`disarm` would give it,
        which disarm then leaves out; the output gradients of a call whose parameters are all
        taken are let go. None where its forms wait for disarm: no call fired holds it, or one
        replays its module, chains through a parametrization or reads the user's hooks (those
        run after the backward pass, outside it)."""
        holding = self._holding.get(key)
        if not holding or key in self._handed_out or key in self.hooked or self._keep is not None:
            return None
        if not all(call.served_by_rule(name for name, p in call.params.items() if id(p) == key) for call, _ in holding):
            return None
        parts = []
        for call, grads in holding:
            formed = self._formed.get(id(grads))
            if formed is None:
                formed = self._formed[id(grads)] = call.forms(grads)
            if call._replays:
                return None
            parts += [form for name, form in formed.items() if id(call.params[name]) == key]
        self._handed_out.add(key)
        for call, grads in holding:
            if all(id(p) in self._handed_out for p in call.params.values()):
                grads[:] = [None] * len(grads)  # (the list the pass keeps: the gradients go, the call stays)
                self._formed.pop(id(grads), None)
        return self._form(key, parts, [call.computed_in for call, _ in holding])

    def calls(self):
        """The calls whose graph is alive and that no tracked backward pass went through: the
        forward pass the next backward pass goes through."""
        return [call for call in self.recent if not call.spent]


HOOKED_TAG = "cockpit_fast_hooked"
"""Key of a backward node's metadata: weak references to the calls whose output gradient a hook
on it takes (an output's node, or where a view's product's gradient arrives)."""


def _parameter(module, name):
    """``module``'s own parameter ``name``, or None. (A ScriptModule's parameters: a dict without get.)"""
    return module._parameters[name] if name in module._parameters else None


def module_setup(module):
    """What of ``module`` decides how its calls compute, beyond its class: its own parameters
    (a pruning or a parametrization registered or removed renames or moves them, an assignment
    replaces one), the user's hooks on them (one may clip) and its forward hooks (one may mix
    the samples)."""
    parameters = tuple((name, id(p)) for name, p in module._parameters.items())
    hooks = tuple(id(hook) for p in module._parameters.values() if p is not None for hook in users_hooks(p))
    return type(module), parameters, hooks, frozenset(module._forward_pre_hooks), frozenset(module._forward_hooks)


def _tag(node, key, call):
    """Files a weak reference to ``call`` under ``key`` in autograd ``node``'s metadata."""
    node.metadata.setdefault(key, []).append(weakref.ref(call))


def in_graph(root, calls):
    """Those of ``calls`` some of whose hooked nodes are in the graph of ``root`` (a backward
    node): a backward pass from there reaches their hooks."""
    wanted, found = {id(call) for call in calls}, set()
    for node in graph_nodes(root):
        if len(found) == len(wanted):
            break
        found.update(id(ref()) for ref in node.metadata.get(HOOKED_TAG, ()) if id(ref()) in wanted)
    return [call for call in calls if id(call) in found]


def mixed_calls(capture, losses, inputs, grad_outputs, reference=None):
    """The calls whose samples are not told apart, from backward passes of ``losses`` weighted
    by ``grad_outputs`` (``reference``: the ``(call, fingerprints)`` of one already made, each
    output's :func:`fingerprint`)
    and by random positive weights per sample on top: the second must give each call's output
    gradients weighted sample by sample, unless a sample's loss reaches another sample's
    outputs (samples that interact, samples not along the dimension taken for them, a call
    shared by every sample). The passes keep only a few sums per sample and call (their
    fingerprints), not the gradients. Exact but for a combination that cancels, or samples
    that interact only with samples of the same weight (for more than 8 samples).

    Kernels whose order of summation is not fixed (a GPU's attention backward under bf16: 1e-4
    of the absolute sums from one pass to the next, benchmarks/RESULTS.md) round their own way
    in each pass: where calls deviate, the unweighted pass runs again, and what it deviates by
    (the most of any call and sample, up to ``NOISE_CAP``) is allowed ``NOISE_SLACK`` times
    over; a call that deviates by more than ``NOISE_CAP`` from one pass to the next (a random
    draw in the backward pass) cannot be proven."""

    def fingerprints(weights):
        capture.arm(fingerprint)
        with own_pass(capture):
            torch.autograd.grad(losses, inputs, weights, retain_graph=True, allow_unused=True)
        return capture.disarm()[1]

    n = losses.shape[0]
    if reference is None:
        reference = fingerprints(grad_outputs)
    # Powers of two: scaling by one commutes exactly with rounding, so a call whose samples are
    # apart gets its gradients scaled exactly, whatever precision the backward pass runs in (but
    # float16's subnormals): a bf16 call is held to float32's eps (its own, 2^-8, hid samples that
    # interact through a mean over the batch). Distinct for up to 8 samples, so no two samples
    # that interact share one weight.
    exponents = torch.randperm(n, generator=torch.Generator().manual_seed(0)) % 8
    weights = torch.ldexp(torch.ones(n, dtype=torch.float64), exponents).to(device=losses.device, dtype=losses.dtype)
    weighted = fingerprints(weights * grad_outputs)
    mixed = _deviating(reference, weighted, weights)
    if mixed:
        deviations = _deviations(reference, fingerprints(grad_outputs))
        noise = max((d for d in deviations.values() if d <= NOISE_CAP), default=0.0)
        if noise > 0:
            unproven = [call for call in mixed if deviations.get(id(call), 0.0) > NOISE_CAP]
            rounding = [(call, prints) for call, prints in reference if call in mixed and call not in unproven]
            mixed = unproven + _deviating(rounding, weighted, weights, noise)
    return mixed


NOISE_SLACK = 8
"""How many times the deviation of a repeated pass the proof allows (:func:`mixed_calls`); on
an H200 the weighted pass deviated up to 2.4 times what the repeated one did."""

NOISE_CAP = 2.0**-9
"""The most a call's fingerprints may deviate by from one pass to the next, relative to their
absolute sums, and count as rounding (an H200's bf16 attention: up to 3.3e-4); a random draw
in a backward pass (dropout recomputed without its random state) deviates by about 1."""


def _deviating(reference, weighted, weights, noise=0.0):
    """The calls of ``reference`` (``(call, fingerprints)``) whose fingerprints in ``weighted``
    are not theirs times ``weights`` within a few of float32's eps of the absolute sums (and
    ``NOISE_SLACK * noise``, a deviation relative to them)."""
    deviating = []
    for call, pairs in _side_by_side(reference, weighted):
        for (g, eps), (h, _) in pairs:
            if g is None or h is None or g.shape != h.shape or g.shape[1] != weights.shape[0]:
                if not (g is None and h is None):
                    deviating.append(call)
                    break
                continue
            expected = g[:2] * weights.to(g.dtype)
            tolerance = (64 * eps + NOISE_SLACK * noise) * (g[2] * weights.to(g.dtype) + h[2]) + 1e-30
            if ((h[:2] - expected).abs() > tolerance).any():
                deviating.append(call)
                break
    return deviating


def _side_by_side(reference, other):
    """``(call, [(its fingerprint in reference, in other), ...])`` for each call of ``reference``
    (``(call, fingerprints)`` of a pass), beside those of ``other``, another pass (none where it
    did not reach the call). A call fired more than once in a pass (a shared call broadcast in
    several places: T5's position bias, read by every layer) is paired fire by fire, in the
    order the passes fired them."""
    seen = defaultdict(list)
    for call, prints in other:
        seen[id(call)].append(prints)
    fired = Counter()
    pairs = []
    for call, prints in reference:
        theirs = seen[id(call)]
        pairs.append((call, list(zip(prints, theirs[fired[id(call)]] if fired[id(call)] < len(theirs) else []))))
        fired[id(call)] += 1
    return pairs


def _deviations(reference, repeated):
    """``{id(call): deviation}``: the largest deviation of each call's fingerprints in
    ``repeated``, a pass of the same weights as ``reference``, relative to its absolute sums
    (0 where the kernels round alike)."""
    deviations = {}
    for call, pairs in _side_by_side(reference, repeated):
        largest = 0.0
        for (g, _), (h, _) in pairs:
            if g is not None and h is not None and g.shape == h.shape:
                largest = max(largest, float(((h[:2] - g[:2]).abs() / (g[2] + 1e-30)).max()))
        deviations[id(call)] = largest
    return deviations


def fingerprint(call, grad, index):
    """(3, N) sums of each sample's gradient of the call's ``index``-th output, in at least
    float32: plain, against a fixed pattern, absolute; and the machine epsilon the proof holds
    them to. None for an output without samples."""
    dim = call.sample_dim_of(index)
    if grad is None or dim is None or grad.dim() <= dim:
        return None, None
    # float32's in any dtype of its range (float64 models compute some parts in float32, T5's
    # norms; bfloat16); float16's own, whose subnormals (below 6e-5) round a gradient scaled by
    # a power of two otherwise than the gradient.
    eps = torch.finfo(torch.float16 if grad.dtype == torch.float16 else torch.float32).eps
    rows = grad.detach().movedim(dim, 0).reshape(grad.shape[dim], -1)
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    pattern = torch.cos(torch.arange(rows.shape[1], device=rows.device, dtype=rows.dtype))
    # vector_norm: the absolute sums without a tensor of absolute values (the logits' gradient is large).
    return torch.stack([rows.sum(1), rows @ pattern, torch.linalg.vector_norm(rows, 1, dim=1)]), eps


class _Mixing:
    """A call of a module whose samples interact (weakly referenced while its graph lives)."""

    def __init__(self, module):
        self.module = module


OBSERVES_THE_STEP = "_cockpit_fast_observes_the_step"
"""Attribute set on a hook that keeps a parameter's gradient for a cockpit (of this one, or of
another on the same parameters): it reads the step's gradient, not each sample's."""


def users_hooks(param):
    """The hooks on ``param`` that are the user's: those that each sample's gradient passes too."""
    return [hook for hook in (param._backward_hooks or {}).values() if not getattr(hook, OBSERVES_THE_STEP, False)]


# torch's code that runs the global forward pre-hooks, which it hands the positional inputs alone.
_RUNS_PRE_HOOKS = next(
    (c for c in torch.nn.Module._call_impl.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "inner"), None
)


def _keyword_inputs():
    """The keyword inputs of the module call whose global forward pre-hooks run now (a Hugging
    Face model called as ``model(input_ids=...)``), read where torch runs them; {} where not found."""
    frame = sys._getframe(1)
    for _ in range(16):  # (our hook's wrappers: torch.compiler.disable's)
        if frame is None:
            break
        if frame.f_code is _RUNS_PRE_HOOKS:
            return frame.f_locals.get("kwargs") or {}
        frame = frame.f_back
    return {}


def _samples_in(args, sample_dim):
    """The samples the model's first tensor input holds along ``sample_dim`` (1: none told)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first.shape[sample_dim] if first is not None and first.dim() > sample_dim else 1


def _hook_output_grad(call, output, others, made, fire, wanted):
    """``fire(gradient)`` with the gradient of a call's ``output``. An output that views a whole
    tensor the call computed (a Linear's on sequences: its matrix product, reshaped; attention's
    output, transposed to batch first) is hooked where that tensor's gradient arrives: a hook on
    the view itself no longer fires once the view is changed in place (Longformer's
    ``query /= sqrt(d)``, a caller's ``out += residual``), while the tensor's node still
    receives the gradient of the values before the change (mapped to the view where
    ``wanted()``: a transpose copies). Not where the call's ``others`` outputs read that tensor
    too (its gradient there holds their shares; the call's own nodes: :func:`_own_nodes`): a
    view hooked on itself is watched for changes (:meth:`Call.changed_in_place`)."""
    base = output._base  # (the tensor the chain of views starts from)
    viewed = (
        base is not None
        and base.grad_fn is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and _permutes(output)
        and _views_of(output.grad_fn, (base.grad_fn, base.output_nr))
        and (not others or base.grad_fn not in _own_nodes([o.grad_fn for o in others], made))
    )
    if not viewed:
        output.register_hook(fire)
        _tag(output.grad_fn, HOOKED_TAG, call)
        if base is not None and _versioned(output):  # (rare: most views of a product are whole, above)
            call.hooked_views.append((output.detach(), output._version))
        return
    shape, stride, offset, index = output.shape, output.stride(), output.storage_offset() - base.storage_offset(), base.output_nr

    def hook(grads):
        if grads[index] is not None and wanted():
            grad = grads[index].contiguous()  # (it may start partway into its memory: a slice of a stack's gradient)
            fire(grad.as_strided(shape, stride, grad.storage_offset() + offset).contiguous())

    base.grad_fn.register_prehook(hook)
    _tag(base.grad_fn, HOOKED_TAG, call)


def _permutes(view):
    """Whether ``view``'s elements lie densely, each once (its strides, sorted, those of a
    contiguous tensor): of a contiguous tensor with as many elements, it holds them all in
    another order (not an expansion repeating some)."""
    expected = 1
    for stride, size in sorted((stride, size) for stride, size in zip(view.stride(), view.shape) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _views_of(node, edge, most=8):
    """Whether autograd's ``node`` reaches ``edge`` through nodes of one input each (the views
    between a tensor and its base; an in-place change in between makes a node of two)."""
    for _ in range(most):
        inputs = [next_edge for next_edge in node.next_functions if next_edge[0] is not None]
        if len(inputs) != 1:
            return False
        if inputs[0] == edge:
            return True
        node = inputs[0][0]
    return False


def _call(ref, method, *args):
    capture = ref()
    return None if capture is None else getattr(capture, method)(*args)
