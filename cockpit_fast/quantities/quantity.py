"""Base class of tracked quantities and the conversion of their results to plain output."""

import numpy
import torch


class Quantity:
    """A value tracked on the steps its schedule selects.

    A quantity tells the cockpit, before the backward pass, which per-parameter statistics
    (:mod:`cockpit_fast._step`) and extra BackPACK extensions it needs, and turns them into its
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

    def __init__(self, track_schedule, verbose=False):
        self._track_schedule = track_schedule
        self._verbose = verbose
        self._pending = {}  # step -> value as computed, tensors on the device
        self._output = {}  # step -> value converted for output

    def should_compute(self, global_step):
        """Whether this quantity does any work at ``global_step``."""
        return self._track_schedule(global_step)

    def reads_batch(self, global_step):
        """Whether it reads the mini-batch at ``global_step`` (see :attr:`READS_BATCH`)."""
        return self.READS_BATCH and self.should_compute(global_step)

    def create_graph(self, global_step):
        """Whether the backward pass must keep the graph (for higher derivatives)."""
        return False

    def statistics(self, ctx):
        """Per-parameter statistics the hook must compute at ``ctx.global_step``."""
        return set()

    def extensions(self, global_step):
        """BackPACK extensions needed at ``global_step`` besides those of the statistics."""
        return []

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
        self._pending[step] = value

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


def samples_for_variance(quantity, per_sample):
    """The number of samples behind ``per_sample``; an unbiased variance over them needs two.

    Raises:
        ValueError: On a batch of one sample (Cockpit 1.0.2 divides by zero there).
    """
    n = per_sample.shape[0]
    if n < 2:
        raise ValueError(
            f"{type(quantity).__name__} estimates a variance over the samples of the mini-batch "
            f"and needs at least 2 of them, got {n}"
        )
    return n


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
        """Forget values from steps before ``step`` (their partner step never came)."""
        for old in [s for s in self._entries if s < step]:
            del self._entries[old]
