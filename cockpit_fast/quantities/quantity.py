"""Base classes of tracked quantities and the conversion of their results to plain output.

:class:`FastQuantity` is the base of the built-in quantities. :class:`Quantity`,
:class:`SingleStepQuantity`, :class:`TwoStepQuantity` and :class:`ByproductQuantity` keep Cockpit
1.0.2's contract, so that a quantity written for Cockpit runs unchanged once its import names this
module.

Each quantity's ``state_dict()`` / ``load_state_dict()`` hold what it carries from step to step,
in plain types and CPU tensors (:func:`plain_state`), for
:meth:`cockpit_fast.cockpit.Cockpit.state_dict`.
"""

import warnings
from collections import defaultdict

import numpy
import torch
from torch.utils._pytree import tree_map

from cockpit_fast.context import tracking
from cockpit_fast.fsdp import DTensor, full, is_sharded, sharded_as


class FastQuantity:
    """cockpit_fast's own quantity interface, read from the engine's per-parameter statistics:
    the base of the built-in quantities, and what users subclass to write a fast quantity.

    A quantity tells the cockpit, before the backward pass, which per-parameter statistics
    (:mod:`cockpit_fast.statistics`) and extra BackPACK extensions it needs, and turns them into its
    value in :meth:`track` afterwards. Values stay tensors on the device until
    :meth:`get_output` converts them to Cockpit's output types (floats, lists, numpy arrays).

    Args:
        track_schedule (callable): Maps the global step to whether to track at that step.
        verbose (bool, optional): Print what is tracked. Defaults to ``False``.
    """

    RUNS_AFTER_CLEANUP = False
    """Whether :meth:`track` runs after BackPACK's buffers are freed, with BackPACK disabled."""

    READS_BATCH = True
    """Whether it reads the mini-batch (statistics, gradient, loss, curvature): under
    ``torch.distributed`` the steps it computes on combine every process's batch."""

    NEEDS_CALLS = True
    """Whether it may read per-sample statistics or BackPACK's curvatures, both of which need
    the module calls of the forward pass: the cockpit watches its forward passes (which costs
    every module call a little) only if one of its quantities does."""

    def __init__(self, track_schedule, verbose=False):
        self._track_schedule = track_schedule
        self._verbose = verbose
        self._pending = {}  # step -> value as computed, tensors on the device
        self._output = {}  # step -> value converted for output
        self._warned_single_sample = False  # a step of one sample, where a variance is estimated

    def should_compute(self, global_step):
        """Whether this quantity does any work at ``global_step``."""
        return self._track_schedule(global_step)

    def needs_calls(self, global_step):
        """Whether the forward pass of ``global_step`` must be watched (see :attr:`NEEDS_CALLS`)."""
        return self.NEEDS_CALLS and self.should_compute(global_step)

    def reads_batch(self, global_step):
        """Whether it reads the mini-batch at ``global_step`` (see :attr:`READS_BATCH`)."""
        return self.READS_BATCH and self.should_compute(global_step)

    def create_graph(self, global_step):
        """Whether the backward pass must keep the graph (for higher derivatives)."""
        return False

    def reads_micro_batches(self, global_step):
        """Whether it reads each micro-batch's gradient norms at ``global_step``
        (:meth:`~cockpit_fast.statistics.StepContext.micro_batch_norms`)."""
        return False

    def statistics(self, ctx):
        """Per-parameter statistics the hook must compute at ``ctx.global_step`` (``ctx``: the
        step's :class:`~cockpit_fast.statistics.StepPlan`, asked once a step)."""
        return set()

    def extensions(self, global_step):
        """BackPACK extensions needed at ``global_step`` besides those of the statistics."""
        return []

    def extension_hooks(self, global_step):
        """Callables the cockpit runs on each module inside BackPACK's extension hook, before
        the statistics are computed (Cockpit's contract; the built-in quantities need none)."""
        return []

    def protected_savefields(self, global_step):
        """Names of BackPACK buffers the cockpit must leave on the parameters after tracking."""
        return set()

    def _track_step(self, ctx):
        """What the cockpit calls after the backward pass of ``ctx.global_step``."""
        self.track(ctx)

    def track(self, ctx):
        """Compute and store the value at ``ctx.global_step`` if the schedule asks for it."""
        if self.should_compute(ctx.global_step):
            self._store(ctx.global_step, self._compute(ctx))
        elif self._verbose:
            print(f"{self._verbose_prefix(ctx.global_step)}: No computation scheduled")

    def _compute(self, ctx):
        """The value at ``ctx.global_step``, or None if there is none to store."""
        raise NotImplementedError

    def _store(self, step, value):
        if value is None:
            return
        if self._verbose:  # the value itself stays on the device until output is read
            print(f"{self._verbose_prefix(step)}: Store iteration {step}")
        # A DTensor (FSDP2's shards, or a norm of them) becomes the full value now, while every rank stores it.
        self._pending[step] = tree_map(full, value)

    def _verbose_prefix(self, step):
        return f"[Step {step} | {type(self).__name__}]"

    def get_output(self):
        """Results keyed by step, converted to Cockpit's output types (each value once).

        A step whose deferred computation finds no value (a failed fit) is left out, as
        Cockpit leaves out a step whose computation returns None.
        """
        for step in sorted(self._pending):
            value = self._convert(self._pending.pop(step))
            if value is not None:
                self._output[step] = value
        return self._output

    def _convert(self, value):
        """Turn a stored value into its output form; quantities may override."""
        return to_output(value)

    def forget(self, steps):
        """Let go of the output of ``steps`` (a streaming cockpit wrote it)."""
        for step in steps:
            self._output.pop(step, None)

    _made_with = {}  # a subclass's: what settings() returns

    def settings(self):
        """What it was made with that a state restored into it must have been saved with (a
        histogram's bins and range as given): plain types; {} for none."""
        return dict(self._made_with)

    def state_dict(self):
        """What this quantity carries from step to step, in plain types and CPU tensors
        (:func:`plain_state`): here the output recorded so far. Values waiting on the device are
        converted to output first (their output does not depend on when).

        A quantity that keeps more across steps overrides this and :meth:`load_state_dict`,
        adding its own entries to those of ``super()``.
        """
        return {"output": plain_state(self.get_output())}

    def load_state_dict(self, state, params):
        """Restore what :meth:`state_dict` returned.

        Args:
            state (dict): This quantity's :meth:`state_dict`.
            params (list[torch.Tensor]): The cockpit's tracked parameters; restored tensors go to
                their devices.
        """
        self._pending = {}
        self._output = restored_state(state["output"])


class Deferred:
    """A value whose final arithmetic waits until output is read, to keep it off the hot path.

    Args:
        finish (callable): Receives the converted ``inputs`` and returns the value.
        inputs: Tensors or nested lists/tuples of tensors.
    """

    def __init__(self, finish, *inputs):
        self._finish = finish
        self._inputs = inputs

    def result(self):
        """Convert the inputs and finish the computation."""
        return self._finish(*to_output(self._inputs))


def samples_for_variance(quantity, per_sample, global_step):
    """The number of samples behind ``per_sample``, or None on a step of one sample (the last
    batch of an epoch), which an unbiased variance cannot use: Cockpit 1.0.2 divides by zero
    there, this quantity skips the step and says so once (:func:`skip_single_sample`)."""
    n = per_sample.shape[0]
    if n < 2:
        return skip_single_sample(quantity, "samples", global_step)
    return n


def skip_single_sample(quantity, what, global_step):
    """None, for ``quantity``'s step ``global_step`` of one of ``what`` (samples, micro-batches);
    warns the first time."""
    if not quantity._warned_single_sample:
        warnings.warn(
            f"{type(quantity).__name__} needs at least 2 {what} to estimate the gradient's variance: steps with 1 "
            f"are skipped (first at step {global_step})",
            RuntimeWarning,
        )
        quantity._warned_single_sample = True
    return None


def to_output(value):
    """Convert tensors to Python floats (0-dim) or numpy arrays, recursively through containers."""
    if isinstance(value, Deferred):
        return value.result()
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.item() if value.dim() == 0 else value.cpu().numpy()
    if isinstance(value, (list, tuple)):
        if _same_kind_scalars(value):
            floats = torch.stack([v.detach() for v in value]).tolist()  # one transfer for all
            return floats if isinstance(value, list) else tuple(floats)
        return type(value)(to_output(v) for v in value)
    if isinstance(value, dict):
        return {key: to_output(v) for key, v in value.items()}
    if isinstance(value, (int, float, numpy.ndarray, numpy.number, type(None))):
        return value
    raise TypeError(f"no output conversion for {type(value).__name__}")


def _same_kind_scalars(values):
    """Whether ``values`` are 0-dim tensors of one dtype on one device (stackable)."""
    kinds = {(v.dtype, v.device) if isinstance(v, torch.Tensor) and v.dim() == 0 else None for v in values}
    return len(kinds) == 1 and None not in kinds


STATE_VERSION = 3
"""Version of the layout of :meth:`cockpit_fast.cockpit.Cockpit.state_dict` and the quantities'
state dicts: a state dict of another version is refused, not misread (3 added the tags of values
one process keeps for itself, :func:`this_process`; version 2, without them, is read too)."""

READ_VERSIONS = (2, 3)

_NUMPY_ARRAY, _NUMPY_SCALAR = "__numpy_array__", "__numpy_scalar__"
# What one process of several keeps for itself: a DTensor's shard, and values of its own samples.
_SHARD, _THIS_PROCESS = "__shard__", "__this_process__"
_TAGS = (_NUMPY_ARRAY, _NUMPY_SCALAR, _SHARD, _THIS_PROCESS)


def plain_state(value):
    """``value`` in the types ``torch.load(weights_only=True)`` reads back: tensors copied to the
    CPU (sharing nothing with the live ones), a ``DTensor`` (FSDP2's) as this process's shard
    tagged ``{"__shard__": tensor}``, NumPy arrays and scalars as tensors tagged
    ``{"__numpy_array__": tensor}`` / ``{"__numpy_scalar__": tensor}``, lists, tuples and dicts
    item by item. :func:`restored_state` undoes it.

    Raises:
        TypeError: For a value of another type, or a NumPy dtype torch has no tensors of.
        ValueError: For a dict whose only key is one of the tags (it would read back as NumPy).
    """
    if is_sharded(value):
        return {_SHARD: value.to_local().detach().to("cpu", copy=True)}
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (numpy.ndarray, numpy.generic)):  # before float: numpy.float64 is one
        tag = _NUMPY_ARRAY if isinstance(value, numpy.ndarray) else _NUMPY_SCALAR
        try:  # a C-ordered copy: torch.from_numpy shares memory and wants it writable
            return {tag: torch.from_numpy(numpy.array(value, order="C"))}
        except TypeError:
            raise TypeError(f"cannot save a NumPy value of dtype {value.dtype} in a state dict") from None
    if isinstance(value, list):
        return [plain_state(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_state(v) for v in value)
    if isinstance(value, dict):
        if _tag(value) is not None:
            raise ValueError(f"cannot save a dict whose only key is {next(iter(value))!r}: it marks a saved value's kind")
        return {key: plain_state(v) for key, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"cannot save a {type(value).__name__} in a state dict: a quantity keeping one overrides state_dict"
    )


def this_process(value):
    """:func:`plain_state` of a value of this process's own samples (under ``torch.distributed``,
    each process's differs): the cockpit restores it into the same process of as many only."""
    return {_THIS_PROCESS: plain_state(value)}


def restored_state(value, device=None, param=None):
    """Undo :func:`plain_state` (and :func:`this_process`): NumPy values back, tensors copied to
    ``device`` (None: the CPU), a shard as a ``DTensor`` sharded as ``param``, the parameter it
    was saved from a part of."""
    if isinstance(value, torch.Tensor):
        return value.to(device or "cpu", copy=True)
    if isinstance(value, dict):
        tag = _tag(value)
        if tag == _THIS_PROCESS:
            return restored_state(value[tag], device, param)
        if tag == _SHARD:
            if not is_sharded(param):
                raise ValueError("a saved shard of a sharded parameter restored into a cockpit whose parameter is not sharded")
            local = value[tag].to(param.device, copy=True)
            return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
        if tag is not None:
            array = value[tag].numpy()
            return array[()] if tag == _NUMPY_SCALAR else array
        return {key: restored_state(v, device, param) for key, v in value.items()}
    if isinstance(value, list):
        return [restored_state(v, device, param) for v in value]
    if isinstance(value, tuple):
        return tuple(restored_state(v, device, param) for v in value)
    return value


def restored_per_param(values, params):
    """:func:`restored_state` of one value per tracked parameter, each on its parameter's device
    (a parameter's saved shard as a shard of it)."""
    return [restored_state(value, param.device, param) for value, param in zip(values, params)]


def restored_copies(values, params):
    """:func:`restored_per_param` of copies of the parameters, sharded as they are: a copy saved
    unsharded (by one process, or under DDP) restored for a parameter FSDP2 shards as this
    process's shard of it."""
    return [sharded_as(copy, param) for copy, param in zip(restored_per_param(values, params), params)]


def holds_this_process(state, tags=(_SHARD, _THIS_PROCESS)):
    """Whether ``state`` holds values of the process that saved it alone (shards, or values of
    its samples: see :func:`this_process`); ``tags=holds_this_process.SHARDS``: shards."""
    if isinstance(state, dict):
        return _tag(state) in tags or any(holds_this_process(v, tags) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_this_process(v, tags) for v in state)
    return False


holds_this_process.SHARDS = (_SHARD,)


def _tag(state):
    """The tag of a dict :func:`plain_state` made of a NumPy value, a shard, or of
    :func:`this_process`; else None."""
    if len(state) == 1:
        key = next(iter(state))
        if key in _TAGS:
            return key
    return None


class StepCache:
    """Values kept from one step for a later one, keyed by the step that produced them."""

    def __init__(self):
        self._entries = {}

    def put(self, step, value):
        """Keep ``value`` from ``step``."""
        self._entries[step] = value

    def get(self, step):
        """The value kept from ``step``, or None."""
        return self._entries.get(step)

    def pop(self, step):
        """Remove and return the value kept from ``step``, or None."""
        return self._entries.pop(step, None)

    def drop_before(self, step):
        """Forget values from steps before ``step`` (their partner step never came); return them."""
        return [self._entries.pop(old) for old in [s for s in self._entries if s < step]]

    def state_dict(self, save):
        """``{step: save(value)}`` of the values kept."""
        return {step: save(value) for step, value in self._entries.items()}

    def load_state_dict(self, state, restore):
        """Keep ``restore(value)`` for each ``{step: value}`` of ``state`` (what :meth:`state_dict`
        returned), and nothing else."""
        self._entries = {step: restore(value) for step, value in state.items()}


class Quantity(FastQuantity):
    """Cockpit 1.0.2's ``Quantity`` contract on cockpit_fast's cockpit: the base of
    :class:`SingleStepQuantity`, :class:`TwoStepQuantity` and :class:`ByproductQuantity`, and of a
    quantity written for Cockpit against its bare ``Quantity``.

    Such a quantity names its BackPACK extensions and extension hooks, and computes its value
    in ``compute(global_step, params, batch_loss)`` (or overrides ``track(global_step, params,
    batch_loss)`` itself) from the buffers BackPACK left on the parameters (the cockpit frees
    them after tracking), and reads ``info`` through :mod:`cockpit_fast.context`. Values are
    stored in :attr:`output` as Cockpit stores them (tensors become numpy arrays at once). Under
    ``torch.distributed`` it sees its own process's batch, loss and buffers.

    Its :meth:`state_dict` holds :attr:`output` (a :class:`TwoStepQuantity`'s, only while nothing
    is cached for a later step): attributes a subclass adds are its own, and one that carries them
    across steps overrides ``state_dict`` / ``load_state_dict`` to save them, extending ``super()``'s.
    """

    READS_BATCH = False  # it reads BackPACK's buffers, not the cockpit's combined statistics

    def __init__(self, track_schedule, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self.output = defaultdict(dict)

    def extensions(self, global_step):
        """BackPACK extensions needed at ``global_step``; subclasses must say."""
        raise NotImplementedError

    def should_compute(self, global_step):
        """Whether to compute at ``global_step``; subclasses must say."""
        raise NotImplementedError

    def needs_calls(self, global_step):
        # Its own track() may compute at any step, by rules the cockpit cannot ask: always watched.
        return self.NEEDS_CALLS

    def _track_step(self, ctx):
        """Cockpit's call: ``track(global_step, params, batch_loss)`` with the step, the tracked
        parameters and ``info['loss']``, which Cockpit requires on every step and this cockpit on
        the steps that compute."""
        needs_loss = ctx.has_info("loss") or self.should_compute(ctx.global_step)
        loss = ctx.info("loss", self) if needs_loss else None
        with tracking(ctx):  # cockpit_fast.context reads its info, as cockpit.context would
            self.track(ctx.global_step, ctx.params, loss)

    def track(self, global_step, params, batch_loss):
        """Compute if scheduled and store (Cockpit's ``track``)."""
        if not self.should_compute(global_step):
            if self._verbose:
                print(f"{self._verbose_prefix(global_step)}: No computation scheduled")
            return
        iteration, result = self.compute(global_step, params, batch_loss)
        if result is not None:
            if self._verbose:
                print(f"{self._verbose_prefix(global_step)}: Store iteration {iteration}, value {result}")
            self._save(iteration, result)

    def compute(self, global_step, params, batch_loss):
        """``(step to store under, value)`` at ``global_step``; subclasses must say."""
        raise NotImplementedError

    def _save(self, global_step, result):
        self.output[global_step] = self._apply_save_format(result)

    def _apply_save_format(self, value):
        """Tensors (0-dim too) become numpy arrays, containers are converted item by item."""
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
        if isinstance(value, (list, dict)):
            for key in range(len(value)) if isinstance(value, list) else list(value):
                value[key] = self._apply_save_format(value[key])
            return value
        if isinstance(value, tuple):
            return tuple(self._apply_save_format(v) for v in value)
        if isinstance(value, (float, int, numpy.ndarray)):
            return value
        raise NotImplementedError(f"No formatting rule for type {type(value)}")

    def get_output(self):
        """``{step: value}`` of what was stored."""
        return self.output

    def forget(self, steps):
        for step in steps:
            self.output.pop(step, None)

    def state_dict(self):
        """:attr:`output`, of this process's own batch and buffers (:func:`this_process`)."""
        return {"output": this_process(self.get_output())}

    def load_state_dict(self, state, params):
        """Restore :attr:`output` from :meth:`state_dict` (see :meth:`FastQuantity.load_state_dict`)."""
        self.output = defaultdict(dict, restored_state(state["output"]))

    # Cockpit's readers of the buffers BackPACK leaves on the parameters. ``aggregate`` joins
    # the parameters: vectors are concatenated, per-sample values summed.

    @staticmethod
    def _fetch_grad(params, aggregate=False):
        return _joined([p.grad for p in params], aggregate)

    @staticmethod
    def _fetch_grad_l2_squared(params, aggregate=False):
        return _summed([p.grad.pow(2).sum() for p in params], aggregate)

    @staticmethod
    def _fetch_batch_grad(params, aggregate=False):
        grad_batch = [p.grad_batch for p in params]
        return torch.cat([g.flatten(start_dim=1) for g in grad_batch], dim=1) if aggregate else grad_batch

    @staticmethod
    def _fetch_batch_l2_squared(params, aggregate=False):
        return _summed([p.batch_l2 for p in params], aggregate)

    @staticmethod
    def _fetch_batch_l2_squared_via_batch_grad_transforms(params, aggregate=False):
        return _summed([p.grad_batch_transforms["batch_l2"] for p in params], aggregate)

    @staticmethod
    def _fetch_batch_dot(params, aggregate=False):
        return _summed([p.batch_dot for p in params], aggregate)

    @staticmethod
    def _fetch_batch_dot_via_batch_grad_transforms(params, aggregate=False):
        return _summed([p.grad_batch_transforms["batch_dot"] for p in params], aggregate)

    @staticmethod
    def _fetch_sum_grad_squared(params, aggregate=False):
        return _joined([p.sum_grad_squared for p in params], aggregate)

    @staticmethod
    def _fetch_sum_grad_squared_via_batch_grad_transforms(params, aggregate=False):
        return _joined([p.grad_batch_transforms["sum_grad_squared"] for p in params], aggregate)

    @staticmethod
    def _fetch_diag_curvature(params, savefield, aggregate=True):
        return _joined([getattr(p, savefield) for p in params], aggregate)


def merged_hooks(hooks):
    """Extension hooks to run in turn, Cockpit's ``BatchGradTransformsHook``s merged into one.

    Each of those writes its own dict to ``param.grad_batch_transforms``, so a later one would
    replace what an earlier one wrote; Cockpit merges their transforms likewise (found by their
    ``_transforms``). A key taken by two different transforms raises a ``ValueError``.
    """
    transforming = [h for h in hooks if hasattr(h, "_transforms")]
    if len(transforming) < 2:
        return hooks
    transforms = {}
    for h in transforming:
        for key, transform in h._transforms.items():
            if transforms.setdefault(key, transform) is not transform:
                raise ValueError(f"Two different grad_batch transforms are named '{key}'")
    return [h for h in hooks if not hasattr(h, "_transforms")] + [type(transforming[0])(transforms)]


def _joined(tensors, aggregate):
    return torch.cat([t.flatten() for t in tensors]) if aggregate else tensors


def _summed(tensors, aggregate):
    return sum(tensors) if aggregate else tensors


class SingleStepQuantity(Quantity):
    """Cockpit's quantity of one step: subclasses implement ``_compute(global_step, params,
    batch_loss)`` (and ``extensions``); it is computed on the steps of ``track_schedule``."""

    def should_compute(self, global_step):
        return self._track_schedule(global_step)

    def compute(self, global_step, params, batch_loss):
        return global_step, self._compute(global_step, params, batch_loss)

    def _compute(self, global_step, params, batch_loss):
        raise NotImplementedError


class ByproductQuantity(SingleStepQuantity):
    """Cockpit's quantity that needs no BackPACK extension."""

    def extensions(self, global_step):
        return []


class TwoStepQuantity(Quantity):
    """Cockpit's quantity of two steps, a start and an end.

    Subclasses implement ``is_start``, ``is_end``, ``_compute_start`` (which keeps what the end
    needs with :meth:`save_to_cache`) and ``_compute_end`` (which reads it with
    :meth:`load_from_cache` and returns the value), and may set :attr:`SAVE_SHIFT`.
    """

    SAVE_SHIFT = 0
    """The value computed at step n is stored under step n - SAVE_SHIFT."""

    def __init__(self, track_schedule, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._cache = defaultdict(dict)  # step -> key -> (value, block_fn)

    def should_compute(self, global_step):
        return self.is_start(global_step) or self.is_end(global_step)

    def is_start(self, global_step):
        raise NotImplementedError

    def is_end(self, global_step):
        raise NotImplementedError

    def state_dict(self):
        """As :meth:`Quantity.state_dict`, between steps whose cache is empty.

        Raises:
            RuntimeError: While values are cached for a later step: their ``block_fn`` are code,
                not state. Save where no start waits for its end, or override ``state_dict`` /
                ``load_state_dict`` to save the values and rebuild their block functions.
        """
        if self._cache:
            raise RuntimeError(
                f"{type(self).__name__} holds values cached at steps {sorted(self._cache)} for a later step, "
                "whose block_fn cannot be saved: save at a step where nothing is cached, or override "
                "state_dict and load_state_dict"
            )
        return super().state_dict()

    def load_state_dict(self, state, params):
        super().load_state_dict(state, params)
        self._cache = defaultdict(dict)  # empty when saved

    def compute(self, global_step, params, batch_loss):
        """The value (None on a step that only starts), stored under ``global_step -
        SAVE_SHIFT``; then forgets cached entries that the next step does not block."""
        result = None
        if self.is_start(global_step):
            self._compute_start(global_step, params, batch_loss)
        if self.is_end(global_step):
            result = self._compute_end(global_step, params, batch_loss)
        self.free_cache(global_step, global_step + 1)
        return global_step - self.SAVE_SHIFT, result

    def _compute_start(self, global_step, params, batch_loss):
        raise NotImplementedError

    def _compute_end(self, global_step, params, batch_loss):
        raise NotImplementedError

    def save_to_cache(self, global_step, key, value, block_fn):
        """Keep ``value`` under ``(global_step, key)`` while ``block_fn(step)`` is true."""
        if self._verbose:
            print(f"{self._verbose_prefix(global_step)}: Create cache entry ('{global_step}', '{key}')")
        self._cache[global_step][key] = (value, block_fn)

    def load_from_cache(self, global_step, key):
        """The value kept under ``(global_step, key)``."""
        return self._cache[global_step][key][0]

    def free_cache(self, global_step, virtual_step):
        """Forget the entries that ``virtual_step`` does not block, and steps left empty."""
        for step in list(self._cache):
            entries = self._cache[step]
            for key in [k for k, (_, block_fn) in entries.items() if not block_fn(virtual_step)]:
                del entries[key]
                if self._verbose:
                    print(f"{self._verbose_prefix(global_step)}: Delete cache entry ('{step}', '{key}')")
            if not entries:
                del self._cache[step]
                if self._verbose:
                    print(f"{self._verbose_prefix(global_step)}: Delete empty cache ('{step}')")
