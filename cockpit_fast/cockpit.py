"""``Cockpit``: tracks quantities during training, a drop-in for ``cockpit.Cockpit`` 1.0.2."""

import os
import warnings
from collections import defaultdict

import json_tricks
import torch
import torch.distributed
from backpack import backpack, disable
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.backprop_extension import BackpropExtension

from cockpit_fast._step import ROUTES, STATISTIC_SOURCES, StatisticsHook, StepContext, extensions_for
from cockpit_fast.distributed import GradientCapture, is_writer, reduce_step, resolve_group
from cockpit_fast.quantities._curvature import CURVATURE_EXTENSIONS
from cockpit_fast.quantities.quantity import Quantity, merged_hooks

_LOG_KEYS = (
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)


class Cockpit:
    """Tracks quantities of a model's parameters during training.

    Use ``with cockpit(global_step, *extensions, info={...}): loss.backward(...)`` on the steps
    to track; results are read with :meth:`get_output` and written with :meth:`write`.

    Args:
        params (iterable): Parameters to track; each must require gradients.
        quantities (list, optional): :class:`~cockpit_fast.quantities.quantity.Quantity`
            instances to track. Defaults to none.
        per_sample_route (str, optional): Where per-sample statistics come from. ``"auto"``
            (default): the weights of Linear and Conv2d layers from their input and output
            gradient without materialising per-sample gradients (:mod:`cockpit_fast.factors`),
            where those factors are smaller than the gradient and every statistic of the step
            can be served so; else BackPACK's ``grad_batch``. ``"factors"``: factors for every
            such layer, cheaper or not (a step needing ``grad_batch`` itself, or a grouped
            convolution, raises); ``"grad_batch"``: never. Results agree to rounding. A Conv2d
            padded other than by zeros given as numbers always takes factors: BackPACK's
            ``grad_batch`` is wrong there, and materialising it raises.
        process_group (optional): Under ``torch.distributed``, the processes whose samples form
            the global batch; every quantity is then that of the global batch
            (:mod:`cockpit_fast.distributed`). Defaults to the world group when
            ``torch.distributed`` is initialised when the cockpit is made.
        log_all_ranks (bool, optional): Let every process write logs, not only rank 0; each
            then writes ``<logpath>_rank<r>.json``. Defaults to ``False``.

    Raises:
        ValueError: If a parameter does not require gradients, or the route is unknown.
    """

    BACKPACK_CONV_SAVE_MEMORY = True
    """Let BackPACK use its memory-saving Jacobian products for convolution weights."""

    CPU_OUTPUT_EVERY = 32
    """Tracked steps after which values of parameters on the CPU are converted to output (floats,
    arrays): a value kept as a tensor costs far more memory, and on the CPU reading it waits on
    nothing. On a GPU values stay on the device until output is read (no synchronisation)."""

    def __init__(self, params, quantities=None, per_sample_route="auto", process_group=None, log_all_ranks=False):
        self.params = list(params)
        self.process_group = resolve_group(process_group)
        self.log_all_ranks = log_all_ranks
        if per_sample_route not in ROUTES:
            raise ValueError(f"per_sample_route must be one of {ROUTES}, got {per_sample_route!r}")
        self.per_sample_route = per_sample_route
        for p in self.params:
            if not p.requires_grad:
                raise ValueError(f"Got a parameter with requires_grad=False, which cannot be tracked: {p}")
        self.quantities = []
        for q in quantities or []:
            self.add(q)
        self.output = defaultdict(dict)
        self._nan_loss = _NanLossWatch()
        self._steps_since_output = 0

    def add(self, quantity):
        """Track ``quantity`` too.

        Raises:
            ValueError: If ``quantity`` is not a :class:`Quantity` instance.
        """
        if not isinstance(quantity, Quantity):
            raise ValueError(f"Quantities must be instances of cockpit_fast Quantity, got {quantity!r}")
        self.quantities.append(quantity)

    def create_graph(self, global_step):
        """Whether ``loss.backward`` must keep the graph at ``global_step``."""
        return any(q.create_graph(global_step) for q in self.quantities)

    def __call__(self, global_step, *exts, info=None, debug=False):
        """Context for the backward pass of ``global_step``; tracks the quantities on exit.

        Args:
            global_step (int): Current iteration.
            *exts: The user's own BackPACK extensions, computed on top; their results are kept.
            info (dict, optional): What quantities need besides the backward pass:
                ``batch_size``, ``individual_losses``, ``loss``, ``optimizer``.
            debug (bool, optional): Print what the step computes. Defaults to ``False``.
        """
        for ext in exts:
            if not isinstance(ext, BackpropExtension):
                raise ValueError(f"*exts must be BackPACK extensions, got {ext!r}")
        info = {} if info is None else info
        if "optimizer" in info:
            self._optimizer_name = type(info["optimizer"]).__name__
        # A step combines the processes' batches where some quantity reads them.
        reduces = any(q.reads_batch(global_step) for q in self.quantities)
        group = self.process_group if reduces else None
        return _TrackedBackward(self, StepContext(global_step, self.params, info, group), exts, debug)

    def _track(self, ctx, buffers, curvature_names):
        """Let every quantity track ``ctx``; free ``buffers`` before those that need a clean graph."""
        if ctx.group is not None:
            reduce_step(ctx, curvature_names)
        if ctx.has_info("loss"):
            self._nan_loss.observe(ctx.global_step, ctx.loss(self))
        late = [q for q in self.quantities if q.RUNS_AFTER_CLEANUP]
        try:
            for q in self.quantities:
                if not q.RUNS_AFTER_CLEANUP:
                    q.track(ctx)
        finally:  # a quantity that raises must not leave BackPACK's buffers behind
            self._free(buffers, ctx)
        with disable():
            for q in late:
                q.track(ctx)
        self._steps_since_output += 1
        if self._steps_since_output >= self.CPU_OUTPUT_EVERY and all(p.device.type == "cpu" for p in self.params):
            self.get_output()

    def _free(self, buffers, ctx):
        """Delete the BackPACK ``buffers`` the cockpit asked for from the parameters: the tracked
        ones and every other one BackPACK filled (a cockpit may track part of a model)."""
        for p in [*self.params, *ctx.extended_params]:
            for name in buffers:
                if hasattr(p, name):
                    delattr(p, name)

    def log(
        self,
        global_step,
        epoch_count,
        train_loss,
        valid_loss,
        test_loss,
        train_accuracy,
        valid_accuracy,
        test_accuracy,
        learning_rate,
    ):
        """Record per-epoch metrics under ``global_step``, next to the tracked quantities."""
        values = (
            epoch_count,
            train_loss,
            valid_loss,
            test_loss,
            train_accuracy,
            valid_accuracy,
            test_accuracy,
            learning_rate,
        )
        self.output[global_step].update(zip(_LOG_KEYS, values))

    def get_output(self):
        """Results as ``{step: {quantity class name: value}}`` plus what :meth:`log` recorded."""
        self._nan_loss.report()
        self._steps_since_output = 0
        for q in self.quantities:
            name = type(q).__name__
            for step, value in q.get_output().items():
                self.output[step][name] = value
        return self.output

    def is_writer(self):
        """Whether this process writes logs: always, but under ``torch.distributed`` rank 0 only
        unless ``log_all_ranks``."""
        return is_writer(self.process_group, self.log_all_ranks)

    @property
    def rank_suffix(self):
        """``"_rank<r>"`` where every process writes its own files (``log_all_ranks`` under
        ``torch.distributed``), else ``""``."""
        if self.process_group is not None and self.log_all_ranks:
            return f"_rank{torch.distributed.get_rank(self.process_group)}"
        return ""

    def write(self, logpath):
        """Write :meth:`get_output` to ``logpath + '.json'`` in the format Cockpit's plotter reads.

        Under ``torch.distributed`` only rank 0 writes, unless ``log_all_ranks``: then rank r
        writes ``logpath + f'_rank{r}.json'``.
        """
        if not self.is_writer():
            return
        path = logpath + self.rank_suffix + ".json"
        print(f"[cockpit] writing output to {path}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            json_tricks.dump(self.get_output(), file, indent=4, sort_keys=True)


class _NanLossWatch:
    """Cockpit's warning on a NaN mini-batch loss at a tracked step, without a host sync on a GPU.

    A loss on the CPU is checked at once. On a device, the first step with a NaN loss and their
    count stay on the device, in constant memory, until :meth:`report` (when output is read).
    """

    def __init__(self):
        self._first = self._count = None

    def observe(self, step, loss):
        nan = loss.isnan()
        if loss.device.type == "cpu":
            if nan:
                _warn_nan_loss(step, loss.item(), 1)
            return
        if self._count is None:
            self._first = torch.full((), -1, dtype=torch.long, device=loss.device)
            self._count = torch.zeros((), dtype=torch.long, device=loss.device)
        self._first = torch.where(nan & (self._first < 0), step, self._first)
        self._count = self._count + nan

    def report(self):
        if self._count is None:
            return
        first, count = self._first.item(), self._count.item()
        self._first = self._count = None
        if count:
            _warn_nan_loss(first, float("nan"), count)


def _warn_nan_loss(step, loss, steps):
    also = f" (and on {steps - 1} later tracked steps)" if steps > 1 else ""
    warnings.warn(f"[Step {step}] Mini-batch loss is {loss}{also}. This may break computation of quantities.")


class _TrackedBackward:
    """Runs one backward pass under BackPACK with the step's hook, then tracks the quantities."""

    def __init__(self, cockpit, ctx, user_exts, debug):
        self._cockpit = cockpit
        self._ctx = ctx
        step = ctx.global_step
        for q in cockpit.quantities:
            ctx.requests.update(q.statistics(ctx))
        asked = [e for q in cockpit.quantities for e in q.extensions(step)]
        extensions = _unique_by_type(
            [*user_exts, *extensions_for(ctx.requests, cockpit.per_sample_route, [*user_exts, *asked]), *asked]
        )
        self._curvature_names = [e.savefield for e in extensions if e.savefield in CURVATURE_EXTENSIONS]
        self._capture = None
        if ctx.group is not None:
            self._capture = GradientCapture(cockpit.params, keep_graph=cockpit.create_graph(step))
        kept = {e.savefield for e in user_exts} | {f for q in cockpit.quantities for f in q.protected_savefields(step)}
        hooks = merged_hooks([h for q in cockpit.quantities for h in q.extension_hooks(step)])
        # The hook frees the statistics' sources at once; the rest (curvatures, what quantities
        # asked for themselves, Cockpit's hook results) after tracking.
        transforms = {"grad_batch_transforms"} if hooks else set()  # where Cockpit's hooks write
        self._buffers = ({e.savefield for e in extensions} | transforms) - kept
        statistics = StatisticsHook(ctx, self._buffers & (STATISTIC_SOURCES - {e.savefield for e in asked}))
        hook = _in_turn([*hooks, statistics])
        if extensions:
            self._contexts = (
                backpack(*extensions, extension_hook=hook, debug=debug),
                weight_jac_t_save_memory(save_memory=cockpit.BACKPACK_CONV_SAVE_MEMORY),
            )
        else:
            self._contexts = (disable(),)
        if debug:
            print(f"[DEBUG, step {step}] statistics: {ctx.requests}, extensions: {extensions}, kept: {kept}")

    def __enter__(self):
        for context in self._contexts:
            context.__enter__()

    def __exit__(self, exc_type, exc, traceback):
        for context in reversed(self._contexts):
            context.__exit__(exc_type, exc, traceback)
        if self._capture is not None:
            self._capture.remove()
            self._ctx.local_grads = self._capture.grads
        if exc_type is None:
            self._cockpit._track(self._ctx, self._buffers, self._curvature_names)
        else:
            self._cockpit._free(self._buffers, self._ctx)


def _in_turn(hooks):
    """One BackPACK extension hook that runs ``hooks`` on each module, in order."""

    def hook(module):
        for h in hooks:
            h(module)

    return hook


def _unique_by_type(extensions):
    """First extension of each type (two of one type would write the same savefield)."""
    seen = {}
    for ext in extensions:
        seen.setdefault(type(ext), ext)
    return list(seen.values())
