"""``Cockpit``: tracks quantities during training, a drop-in for ``cockpit.Cockpit`` 1.0.2."""

import contextlib
import os
import warnings
import weakref
from collections import Counter, defaultdict
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed
from backpack import backpack, disable
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.backprop_extension import BackpropExtension
from torch.amp.grad_scaler import OptState

from cockpit_fast.statistics import ROUTES, WRAPPED_LATER, StepContext, StepPlan, StepStatistics, unreached, zero_grad
from cockpit_fast._validation import check_info
from cockpit_fast.distributed import GradientCapture, agreed_by_ranks, is_writer, meet, reduce_step, resolve_group
from cockpit_fast.fsdp import Unsharded, refuse_fsdp1
from cockpit_fast.log_stream import LogStream, read_log, write_log
from cockpit_fast.loggers import parameter_names
from cockpit_fast.per_sample import Engine, outside_autocast
from cockpit_fast.quantities._curvature import CURVATURE_EXTENSIONS
from cockpit_fast.quantities.quantity import FastQuantity, merged_hooks

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

_MICRO_BATCH_ORDER = "call tracked.micro_batch(...) after each micro-batch's forward pass and before its backward pass"


class Cockpit:
    """Tracks quantities of a model's parameters during training.

    Use ``with cockpit(global_step, *extensions, info={...}): loss.backward(...)`` on the steps
    to track; results are read with :meth:`get_output` and written with :meth:`write`.

    Args:
        params (iterable): Parameters to track: those that require gradients (frozen ones are
            left out, with a warning saying how many).
        quantities (list, optional): :class:`~cockpit_fast.quantities.quantity.FastQuantity`
            instances to track (the built-in quantities, and ones written for Cockpit on
            :class:`~cockpit_fast.quantities.quantity.Quantity`). Defaults to none.
        per_sample_route (str, optional): How per-sample statistics are computed from the
            per-sample engine's forms (:mod:`cockpit_fast.per_sample`). ``"auto"`` (default):
            closed forms (factors of Linear and convolution weights, embedding rows) where
            they are cheaper than forming the per-sample gradients; ``"factors"``: closed
            forms wherever a form has them; ``"grad_batch"``: always from the per-sample
            gradients themselves, formed a chunk of samples at a time. Results agree to
            rounding.
        process_group (optional): Under ``torch.distributed``, the processes whose samples form
            the global batch; every quantity is then that of the global batch
            (:mod:`cockpit_fast.distributed`). Defaults to the world group when
            ``torch.distributed`` is initialised when the cockpit is made.
        log_all_ranks (bool, optional): Let every process write logs, not only rank 0; each
            then writes ``<logpath>_rank<r>.json``. Defaults to ``False``.
        logpath (str, optional): Stream the log to ``logpath + '.json'`` as the run goes
            (:mod:`cockpit_fast.log_stream`): each step's row once the step is finished (after
            the next tracked step; the last at :meth:`write`), so a run killed at any point
            keeps them, and the cockpit holds only the rows not yet written plus the last
            :attr:`RECENT_ROWS` (memory bounded however long the run). :meth:`get_output` and
            the plotter read the written rows back. Defaults to ``None``: all in memory until
            :meth:`write`, as Cockpit.
        max_kept_bytes (int, optional): In a step accumulated over micro-batches
            (:meth:`_TrackedBackward.micro_batch`), the statistics that set each sample's
            gradient against the step's (InnerTest, OrthoTest, Alpha) keep every micro-batch's
            per-sample gradients (their factors, about the activations a layer's backward pass
            reads) until the last backward pass; beyond this many bytes they are skipped for the
            step, with a warning naming them. Defaults to ``None``: no limit.

    Raises:
        ValueError: If no parameter requires gradients, or the route is unknown.
    """

    BACKPACK_CONV_SAVE_MEMORY = True
    """Let BackPACK use its memory-saving Jacobian products for convolution weights."""

    CPU_OUTPUT_EVERY = 32
    """Tracked steps after which values of parameters on the CPU are converted to output (floats,
    arrays): a value kept as a tensor costs far more memory, and on the CPU reading it waits on
    nothing. On a GPU values stay on the device until output is read (no synchronisation)."""

    capture_grads = False
    """Keep a copy of each step's gradient as its backward passes make it, before anything
    changes ``param.grad`` (a trainer clipping it before the step is tracked)."""

    RECENT_ROWS = 64
    """Rows a streaming cockpit keeps after writing them, for :meth:`recent_output` (loggers that
    write each step's new values read them there)."""

    def __init__(
        self, params, quantities=None, per_sample_route="auto", process_group=None, log_all_ranks=False,
        max_kept_bytes=None, logpath=None,
    ):
        self.params = _trainable(params)
        refuse_fsdp1(self.params)
        self._unsharded = Unsharded(self.params)  # FSDP2's: the tensors the shards are computed with
        self.max_kept_bytes = max_kept_bytes
        self.process_group = resolve_group(process_group)
        self.log_all_ranks = log_all_ranks
        self._stream = LogStream(logpath + self.rank_suffix + ".json") if logpath is not None and self.is_writer() else None
        self._rows_as_logged = logpath is not None  # get_output() as the log holds rows, on every rank
        self._recent = {}  # step -> row of the last rows streamed
        if per_sample_route not in ROUTES:
            raise ValueError(f"per_sample_route must be one of {ROUTES}, got {per_sample_route!r}")
        self.per_sample_route = per_sample_route
        self.quantities = []
        # Watches the forward passes once a quantity needs their calls (per-sample gradients).
        self._engine = None
        for q in quantities or []:
            self.add(q)
        self.output = defaultdict(dict)
        self._nan_loss = _NanLossWatch()
        self._steps_since_output = 0
        self._mean_checked = False  # the first step with per-sample statistics checks info's loss
        self._said_unreached = False  # a step whose backward passes did not reach some tracked parameters
        self._last_step = None  # the step last tracked or not: whether steps come one after another
        self._last_tracked = None  # the step whose quantities last tracked it to the end
        self._learning_rates = {}  # step -> info['optimizer']'s learning rate
        self._met = False  # whether the processes' cockpits met before their first exchange
        self._param_kinds = None  # (dtype, device) of each parameter at the last step

    def _refuse_converted_params(self, step):
        """A parameter converted or moved since the last step (``model.double()`` mid-run): what
        the quantities keep from earlier steps (Distance's start, Alpha's update) is in its old
        dtype and place."""
        kinds = [(p.dtype, p.device) for p in self.params]
        if self._param_kinds is not None and kinds != self._param_kinds:
            index, (was, now) = next((i, pair) for i, pair in enumerate(zip(self._param_kinds, kinds)) if pair[0] != pair[1])
            raise ValueError(
                f"[Step {step}] tracked parameter {index} is {str(now[0]).removeprefix('torch.')} on {now[1]}, and was "
                f"{str(was[0]).removeprefix('torch.')} on {was[1]} at an earlier step (the model converted or moved after "
                "the cockpit's first step: what the quantities keep from earlier steps is in the old dtype and place): "
                "convert or move the model before the first tracked step, or make a new cockpit"
            )
        self._param_kinds = kinds

    def add(self, quantity):
        """Track ``quantity`` too.

        Raises:
            ValueError: If ``quantity`` is not a :class:`FastQuantity` instance.
        """
        if not isinstance(quantity, FastQuantity):
            raise ValueError(
                f"Quantities must be instances of cockpit_fast's FastQuantity or Quantity, got {quantity!r}"
            )
        self.quantities.append(quantity)
        if quantity.NEEDS_CALLS and self._engine is None:
            self._engine = Engine(self.params, self._unsharded)  # watches from the next forward pass on

    def routes(self):
        """``{parameter name: route}``: how the last step with per-sample statistics got each
        tracked parameter's per-sample gradients (a module's rule, a replay of its call, or the
        whole graph), to see why a step is slow. Names are those in the model last called."""
        return {} if self._engine is None else self._engine.routes()

    def _tracked(self):
        """What the cockpit tracks: its quantities' kinds and its parameters' shapes."""
        return [type(q).__name__ for q in self.quantities], [tuple(p.shape) for p in self.params]

    def _named(self, indices):
        """The tracked parameters ``indices``, by name where the engine saw the model."""
        return self._engine._describe([id(self.params[i]) for i in indices]) if self._engine is not None else f"tracked parameters {indices}"

    def _say_unreached(self, global_step, indices):
        """Warns once that the tracked parameters ``indices`` got no gradient at a step."""
        if not indices or self._said_unreached:
            return
        self._said_unreached = True
        warnings.warn(
            f"[Step {global_step}] {self._named(indices)} got no gradient: no backward pass of the step reached them (an expert no "
            "token chose, a layer the forward pass skipped); each sample's gradient of each counts as zero (said once)",
            RuntimeWarning,
            stacklevel=5,
        )

    def stop_watching(self):
        """Stops recording the process's module calls, for a cockpit no step will use again (every
        forward pass in the process pays a watching cockpit's hooks); its output stays readable."""
        if self._engine is not None:
            self._engine.watch(False)

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
        check_info(info)
        for ext in exts:
            if not isinstance(ext, BackpropExtension):
                raise ValueError(f"*exts must be BackPACK extensions, got {ext!r}")
        frozen = [index for index, p in enumerate(self.params) if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"tracked parameters {frozen} were frozen (requires_grad=False) after the cockpit was made: a "
                "cockpit tracks the parameters it was made with; make a new one for the trainable parameters"
            )
        if self._last_tracked is not None and global_step <= self._last_tracked:
            warnings.warn(
                f"[Step {global_step}] comes after step {self._last_tracked} was tracked: step numbers must grow from "
                "step to step (a step tracked again replaces its output, and Distance, UpdateSize and Alpha read "
                "their values from the wrong steps)",
                RuntimeWarning,
                stacklevel=2,
            )
        info = {} if info is None else info
        if "optimizer" in info:
            self._optimizer_name = type(info["optimizer"]).__name__
            # The dashboard's learning rate where log() gives none (the first group's, as Cockpit's examples log it).
            self._learning_rates[global_step] = float(info["optimizer"].param_groups[0]["lr"])
        # A step combines the processes' batches where some quantity reads them.
        self.expect(global_step)  # late for a forward pass made before: the engine says so where it matters
        reduces = any(q.reads_batch(global_step) for q in self.quantities)
        group = self.process_group if reduces else None
        return _TrackedBackward(self, StepPlan(global_step, self.params, info, group, self.quantities), exts, debug)

    def expect(self, global_step):
        """Say that the forward pass of ``global_step`` comes next, where the loop opens the step
        after it (a trainer's hooks) and step numbers may skip: its module calls are watched if
        a quantity needs them. (The cockpit stops watching after a step while the next one,
        numbered one more, needs no per-sample gradients.)"""
        if self._engine is not None and not self._engine.watching and self._needs_calls(global_step):
            self._engine.watch(True)

    def _needs_calls(self, global_step):
        """Whether a quantity may read per-sample gradients or curvatures at ``global_step``."""
        return any(q.needs_calls(global_step) for q in self.quantities)

    def _plan_watching(self, global_step):
        """After a step: while steps come one after another, the forward passes of the next are
        watched only if it needs per-sample gradients (a step no quantity tracks then costs what
        it costs without a cockpit)."""
        consecutive = self._last_step is not None and global_step == self._last_step + 1
        self._last_step = global_step
        if self._engine is not None:
            self._engine.watch(not consecutive or self._needs_calls(global_step + 1))

    def _track(self, ctx, buffers, curvature_names, skipped=()):
        """Let every quantity but ``skipped`` track ``ctx``; free ``buffers`` before those that
        need a clean graph."""
        if ctx.group is not None:
            ctx = reduce_step(ctx, curvature_names)
        if ctx.has_info("loss"):
            self._nan_loss.observe(ctx.global_step, ctx.loss(self))
        tracked = [q for q in self.quantities if q not in skipped]
        late = [q for q in tracked if q.RUNS_AFTER_CLEANUP]
        try:
            for q in tracked:
                if not q.RUNS_AFTER_CLEANUP:
                    q._track_step(ctx)
        finally:  # a quantity that raises must not leave BackPACK's buffers behind
            self._free(buffers, ctx.extended_params)
        with disable():
            for q in late:
                q._track_step(ctx)
        self._steps_since_output += 1
        self._last_tracked = ctx.global_step
        if self._stream is not None:
            self._stream_finished(ctx.global_step)
        elif self._steps_since_output >= self.CPU_OUTPUT_EVERY and all(p.device.type == "cpu" for p in self.params):
            self._collect()

    def _stream_finished(self, global_step):
        """Write the rows of the steps before ``global_step`` (no quantity adds to them any more:
        a two-step quantity completes a step at the next) and let go of them."""
        self._collect()
        finished = {step: self._with_learning_rate(step, row) for step, row in self.output.items() if step < global_step}
        self._stream.append(finished)
        for step in finished:
            del self.output[step]
            self._learning_rates.pop(step, None)
        for q in self.quantities:
            q.forget(finished)
        self._recent = dict(sorted({**self._recent, **finished}.items())[-self.RECENT_ROWS :])

    def _free(self, buffers, extended_params):
        """Delete the BackPACK ``buffers`` the cockpit asked for from the parameters: the tracked
        ones and every other one BackPACK filled (``extended_params``: a cockpit may track part
        of a model)."""
        for p in [*self.params, *extended_params]:
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
        """Results as ``{step: {quantity class name: value}}`` plus what :meth:`log` recorded
        (streaming, ``logpath`` given: the rows written read back, with the rest, as
        :meth:`logged_output` gives them; on a rank that writes no log, the same rows)."""
        self._collect()
        if self._stream is None:  # (ranks that write no log: as rank 0's rows, read back from it)
            return {step: self._with_learning_rate(step, row) for step, row in self.output.items()} if self._rows_as_logged else self.output
        output = self._stream.read()
        for step, row in self.output.items():  # in the form the log holds them
            output[step] = {**output.get(step, {}), **self._with_learning_rate(step, row)}
        return dict(sorted(output.items()))

    def recent_output(self):
        """The rows not yet streamed and the last :attr:`RECENT_ROWS` streamed (without
        ``logpath``: :meth:`get_output`), for loggers that write each step's new values."""
        if self._stream is None:
            return self.get_output()
        self._collect()
        return {**self._recent, **{step: dict(row) for step, row in self.output.items()}}

    def _collect(self):
        """Convert what the quantities stored into output rows."""
        self._nan_loss.report()
        self._steps_since_output = 0
        for q in self.quantities:
            name = type(q).__name__
            for step, value in q.get_output().items():
                self.output[step][name] = value
        # Learning rates of steps without a row (none will come) are not kept.
        latest = max(self.output, default=float("-inf"))
        self._learning_rates = {s: r for s, r in self._learning_rates.items() if s in self.output or s > latest}

    def _with_learning_rate(self, step, row):
        """``row`` with ``info['optimizer']``'s learning rate where :meth:`log` gave none."""
        if "learning_rate" in row or step not in self._learning_rates:
            return row
        return {**row, "learning_rate": self._learning_rates[step]}

    def logged_output(self):
        """What :meth:`write` writes and the dashboard draws: :meth:`get_output`, with each row's
        ``learning_rate`` taken from ``info['optimizer']`` where :meth:`log` recorded none."""
        return {step: self._with_learning_rate(step, row) for step, row in self.get_output().items()}

    def output_by_name(self, model=None):
        """:meth:`get_output` with each per-parameter list (of every tracked parameter, in order)
        turned into ``{parameter name: value}``, in dict outputs too (GradNoiseScale's).

        Args:
            model (torch.nn.Module, optional): Whose parameter names to use; by default those in
                the model the cockpit saw (where a quantity needed per-sample gradients), else
                ``param_<i>``.
        """
        if model is not None:
            by_id = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
            names = [by_id.get(id(p), f"param_{index}") for index, p in enumerate(self.params)]
        else:
            names = parameter_names(self)

        def named(value):
            if isinstance(value, dict):
                return {key: named(item) for key, item in value.items()}
            if isinstance(value, (list, tuple, np.ndarray)) and len(value) == len(names) and getattr(value, "ndim", 1) == 1:
                return dict(zip(names, value))
            return value

        return {step: {key: named(value) for key, value in row.items()} for step, row in self.get_output().items()}

    def state_dict(self):
        """Everything a run restored from a checkpoint needs to go on exactly as if uninterrupted:
        each quantity's state (``FastQuantity.state_dict``: Distance's start, the step that
        Alpha and UpdateSize carry, the histograms' adapted ranges, the noise scale's averages,
        the output so far), what :meth:`log` recorded and the cockpit's own counters.

        A plain dict (key ``"version"``) of plain types and CPU tensors that shares nothing with
        the model: ``torch.save`` it beside the model's and the optimizer's state dicts, and
        ``torch.load(..., weights_only=True)`` reads it back. Values waiting on the device are
        converted to output first. Restore it with :meth:`load_state_dict`. A streaming cockpit's
        state holds the rows not yet in its log file, and the file's path and last step: the
        cockpit it is restored into reads the file's steps up to there (a streaming one starts
        its own file with them, and goes on).

        Under ``torch.distributed`` each process saves its own (no collective): most of it is the
        same in every process, but some values are each process's own: FSDP2's shards (Distance's
        start, UpdateSize's carried step), Alpha's kept individual gradients (an optimizer other
        than plain SGD), the noise scale's averages of the process's micro-batches, the output of
        a quantity on Cockpit's contract. A state holding those is restored into the process of
        the same rank, of as many, only (:meth:`load_state_dict` says so otherwise).
        """
        from cockpit_fast.quantities.quantity import STATE_VERSION, plain_state

        names = [type(q).__name__ for q in self.quantities]
        nan_first, nan_count = self._nan_loss._first, self._nan_loss._count
        return {
            "version": STATE_VERSION,
            "quantities": names,
            "param_shapes": [list(p.shape) for p in self.params],
            "quantity_states": [q.state_dict() for q in self.quantities],
            "settings": [q.settings() for q in self.quantities],
            "process": self._process(),
            # What log() recorded; the quantities' values are in their own states.
            "log": plain_state(
                {step: {key: v for key, v in row.items() if key not in names} for step, row in self.output.items()}
            ),
            "nan_loss": None if nan_count is None else [nan_first.item(), nan_count.item()],
            "steps_since_output": self._steps_since_output,
            "mean_checked": self._mean_checked,
            "optimizer_name": getattr(self, "_optimizer_name", None),
            "learning_rates": dict(self._learning_rates),
            # Streaming: the log file and the steps already in it (the rows above are those not yet).
            "streamed": None if self._stream is None else {"path": os.path.abspath(self._stream.path), "through": self._stream.last_step},
        }

    @property
    def rank(self):
        """This process's rank in the cockpit's process group (0 without one)."""
        return 0 if self.process_group is None else torch.distributed.get_rank(self.process_group)

    @property
    def world_size(self):
        """How many processes the cockpit's process group holds (1 without one)."""
        return 1 if self.process_group is None else torch.distributed.get_world_size(self.process_group)

    def _process(self):
        return {"rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` into this cockpit, made with the same quantities in the same
        order and parameters of the same shapes; tensors go to the tracked parameters' devices.

        Raises:
            ValueError: If ``state`` is not a cockpit state dict of this version, or holds other
                quantities, quantities made otherwise (a histogram's bins and range) or parameter
                shapes, or values of another process's own (nothing is restored then).
        """
        from cockpit_fast.quantities.quantity import READ_VERSIONS, STATE_VERSION, holds_this_process, restored_state

        if not isinstance(state, dict) or "version" not in state:
            raise ValueError(
                f"state must be a dict from Cockpit.state_dict() (with a 'version'), got {type(state).__name__}"
            )
        if state["version"] not in READ_VERSIONS:
            raise ValueError(
                f"state is a Cockpit state dict of version {state['version']!r}, "
                f"this cockpit reads version {STATE_VERSION}"
            )
        names = [type(q).__name__ for q in self.quantities]
        if state["quantities"] != names:
            raise ValueError(
                f"state holds the quantities {state['quantities']}, this cockpit tracks {names} "
                "(restore into one made with the same quantities, in the same order)"
            )
        for q, saved in zip(self.quantities, state.get("settings", [{}] * len(names))):  # (older states: none)
            if saved and saved != q.settings():
                raise ValueError(
                    f"state holds a {type(q).__name__} made with {saved}, this cockpit's has {q.settings()} (restore into "
                    "a cockpit made as the saved one was)"
                )
        shapes = [list(p.shape) for p in self.params]
        if len(state["param_shapes"]) != len(shapes):
            raise ValueError(f"state holds {len(state['param_shapes'])} parameters, this cockpit tracks {len(shapes)}")
        for index, (saved, own) in enumerate(zip(state["param_shapes"], shapes)):
            if saved != own:
                raise ValueError(f"parameter {index} has shape {tuple(saved)} in state, {tuple(own)} in this cockpit")
        saved_by, here = state.get("process"), self._process()
        own = [n for n, q in zip(names, state["quantity_states"]) if holds_this_process(q)]
        if own and saved_by is not None and saved_by != here:
            raise ValueError(
                f"state was saved by process {saved_by['rank']} of {saved_by['world_size']} and holds that process's "
                f"own values (of {', '.join(own)}: FSDP2's shards, or values of its own samples), "
                f"this is process {here['rank']} of {here['world_size']}: save every process's "
                "state_dict() and restore each into the process of its rank"
            )
        if any(holds_this_process(q, holds_this_process.SHARDS) for q in state["quantity_states"]) and not self._unsharded.active:
            raise ValueError(
                "state holds FSDP2's shards of the parameters, this cockpit's parameters are not sharded: restore it "
                "into a cockpit of the model sharded as it was (fully_shard)"
            )
        earlier = _streamed_rows(state.get("streamed"))  # (before anything is restored: it may raise)
        for q, q_state in zip(self.quantities, state["quantity_states"]):
            q.load_state_dict(q_state, self.params)
        self.output = defaultdict(dict, restored_state(state["log"]))
        self._nan_loss = _NanLossWatch()
        if state["nan_loss"] is not None:  # kept on the device, as the watch keeps it
            device = self.params[0].device
            first, count = state["nan_loss"]
            self._nan_loss._first = torch.tensor(first, dtype=torch.long, device=device)
            self._nan_loss._count = torch.tensor(count, dtype=torch.long, device=device)
        self._steps_since_output = state["steps_since_output"]
        self._last_tracked = None  # (the run goes on from the checkpoint's step)
        self._mean_checked = state["mean_checked"]
        if state["optimizer_name"] is not None:
            self._optimizer_name = state["optimizer_name"]
        self._learning_rates = dict(state.get("learning_rates", {}))
        if self._stream is not None:  # the log file goes on from the checkpoint's step
            self._stream.rewrite(earlier)
            self._recent = {}
        else:
            for step, row in earlier.items():
                self.output[step] = {**row, **self.output.get(step, {})}

    def is_writer(self):
        """Whether this process writes logs: always, but under ``torch.distributed`` rank 0 only
        unless ``log_all_ranks``."""
        return is_writer(self.process_group, self.log_all_ranks)

    @property
    def rank_suffix(self):
        """``"_rank<r>"`` where every process writes its own files (``log_all_ranks`` under
        ``torch.distributed``), else ``""``."""
        if self.process_group is not None and self.log_all_ranks:
            return f"_rank{self.rank}"
        return ""

    def write(self, logpath):
        """Write :meth:`logged_output` to ``logpath + '.json'`` in the format Cockpit's plotter
        reads (:mod:`cockpit_fast.log_stream`: plain JSON, one line per step).
        Under ``torch.distributed`` only rank 0 writes, unless ``log_all_ranks``: then rank r
        writes ``logpath + f'_rank{r}.json'``.
        """
        if not self.is_writer():
            return
        path = logpath + self.rank_suffix + ".json"
        print(f"[cockpit] writing output to {path}")
        output = self.logged_output()
        if self._stream is not None and os.path.abspath(path) == os.path.abspath(self._stream.path):
            self._stream.rewrite(output)  # the rows not finished yet too; the stream goes on
        else:
            write_log(path, output)


def _streamed_rows(streamed):
    """The rows a streaming cockpit had written when its state was taken (``state['streamed']``)."""
    if streamed is None or streamed["through"] is None:
        return {}
    path, through = streamed["path"], streamed["through"]
    if not os.path.isfile(path):
        raise ValueError(f"the checkpoint's steps up to {through} are in its log file {path}, which is gone")
    return {step: row for step, row in read_log(path).items() if step <= through}


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
    """One tracked step: ``with cockpit(global_step, info=...) as tracked:``.

    Its backward passes run with the per-sample engine armed (and BackPACK where a quantity asks
    for its extensions); on exit the quantities track the step. A step accumulated over
    micro-batches calls :meth:`micro_batch` after each micro-batch's forward pass and before
    its backward pass: the step's statistics are then those of the union of the micro-batches.
    """

    def __init__(self, cockpit, plan, user_exts, debug):
        self._cockpit = cockpit
        self._plan = plan
        step = plan.global_step
        self._requested_by = {}  # BackPACK extension type -> the quantities asking for it
        for q in cockpit.quantities:
            for e in q.extensions(step):
                self._requested_by.setdefault(type(e), []).append(type(q).__name__)
        extensions = _unique_by_type([*user_exts, *(e for q in cockpit.quantities for e in q.extensions(step))])
        self._extensions = extensions
        self._curvature_names = [e.savefield for e in extensions if e.savefield in CURVATURE_EXTENSIONS]
        self._keep_graph = cockpit.create_graph(step)
        self._reads_micro = any(q.reads_micro_batches(step) for q in cockpit.quantities)
        self._grads = None  # GradientCapture: the step's gradients, pass by pass
        self._pass = None  # the engine's pass of the micro-batch under way
        self._given = _MicroBatch()  # what the micro-batch under way (or the step's one pass) told
        self._ended = []  # the _MicroBatch of every backward pass that ended
        self._total = {}  # {index: gradient} of the ended backward passes
        self._statistics = None
        self._micro = False  # micro_batch() started the passes
        self._unplanned = None  # why the pass begun at entry could not be planned (no losses)
        self._extended = []  # every parameter BackPACK's extensions visited, tracked or not
        self._open = False
        self._stream_error = None  # what computing statistics in the backward pass raised
        kept = {e.savefield for e in user_exts} | {f for q in cockpit.quantities for f in q.protected_savefields(step)}
        hooks = merged_hooks([h for q in cockpit.quantities for h in q.extension_hooks(step)])
        transforms = {"grad_batch_transforms"} if hooks else set()  # where Cockpit's hooks write
        self._buffers = ({e.savefield for e in extensions} | transforms) - kept  # freed after tracking
        hook = _in_turn([*hooks, _record_visited(self._extended)])
        if extensions:
            self._contexts = (
                backpack(*extensions, extension_hook=hook, debug=debug),
                weight_jac_t_save_memory(save_memory=cockpit.BACKPACK_CONV_SAVE_MEMORY),
            )
        else:
            self._contexts = (disable(),)
        if debug:
            print(f"[DEBUG, step {step}] statistics: {set(plan.requests)}, extensions: {extensions}, kept: {kept}")

    def __enter__(self):
        cockpit, plan = self._cockpit, self._plan
        refuse_fsdp1(cockpit.params)  # (wrapped after the cockpit was made)
        cockpit._refuse_converted_params(plan.global_step)
        if not cockpit._met and (plan.group is not None or (cockpit.process_group is not None and cockpit._unsharded.active)):
            # Before any collective: the step's, or FSDP2's engine passes and sums of shards.
            meet(cockpit.process_group, cockpit._tracked(), plan.global_step)
            cockpit._met = True
        if cockpit._unsharded.active and self._extensions:
            raise ValueError(
                f"{_needing(self._extensions, self._requested_by)} BackPACK's extensions, which do not run on parameters "
                "FSDP2 shards (fully_shard): track them without sharding, or track first-order quantities"
            )
        _check_curvature_support(cockpit._engine, self._extensions, self._requested_by)
        if plan.requests:
            _refuse_earlier_gradients(cockpit.params)
            size = int(plan.given("batch_size")) if plan.has_info("batch_size") else None
            self._statistics = StepStatistics(
                cockpit.params, plan.requests, cockpit.per_sample_route, size, cockpit.max_kept_bytes
            )
            weight = self._begin(plan.given("individual_losses"), plan.given("loss"), micro=False)
            self._given = _MicroBatch(plan.given("individual_losses"), plan.given("loss"), weight)
        if plan.group is not None or plan.requests or cockpit.capture_grads or self._reads_micro:  # the step's own gradients
            # A step of one backward pass on one process: each parameter's statistics as its
            # gradient arrives, its calls' output gradients let go then (not held to the end).
            streams = self._pass is not None and self._pass.streams and plan.group is None
            me = weakref.ref(self)  # (not a cycle with the capture: the step's calls would wait for the collector)
            self._grads = GradientCapture(
                cockpit.params, self._keep_graph, copy=plan.group is not None or cockpit.capture_grads,
                unsharded=cockpit._unsharded, on_grad=(lambda index, grad: me()._stream(index, grad)) if streams else None,
            )
        for context in self._contexts:
            context.__enter__()
        self._open = True
        return self

    def _stream(self, index, grad):
        """In the backward pass begun at entry, parameter ``index``'s gradient ``grad`` is final:
        its statistics now, where the engine gives its form (the step's only pass, unless
        :meth:`micro_batch` follows: then refused)."""
        if self._stream_error is not None or self._pass is None:
            return
        unscale, param = self._plan.unscale, self._plan.params[index]
        try:
            form = self._cockpit._engine.take(self._pass, param, unscale)
            if form is not None:
                with outside_autocast([param]):
                    self._statistics.stream(index, form, grad * unscale if unscale != 1.0 else grad)
        except Exception as error:  # raised when the pass ends, where end() would have raised it
            self._stream_error = error

    @property
    def unscale(self):
        """What the step's backward passes' gradients are multiplied by to be in the units of
        its loss: ``1 / scale`` of ``info['grad_scaler']``, else 1."""
        return self._plan.unscale

    def micro_batch(self, individual_losses=None, loss=None, batch_size=None):
        """Start the next micro-batch of a step accumulated over several: call it after the
        micro-batch's forward pass and before its backward pass, the first micro-batch's too.

        The step's statistics are those of the union of its micro-batches, each sample's
        gradient that of its own loss as the backward passes weigh it (``info['batch_size']``
        times its share of the step's gradient). A micro-batch's loss is best its losses' sum
        over ``info['batch_size']`` (``mean / k`` for k micro-batches of one size): the
        individual gradients are then exactly those of the samples' own losses.

        Args:
            individual_losses (torch.Tensor, optional): The micro-batch's per-sample losses,
                ``(N_m,)`` or ``(N_m, 1)``, with their graph, where a quantity needs them.
            loss (torch.Tensor, optional): The loss its backward pass runs on (before a
                ``GradScaler`` scales it): with ``individual_losses``, tells how the pass weighs
                each sample (else ``1 / info['batch_size']``); the step's ``info['loss']`` is
                the micro-batches' sum.
            batch_size (int, optional): The micro-batch's number of samples where no
                ``individual_losses`` tell it: the gradient noise scale from micro-batches
                (``GradNoiseScale(..., estimator="micro_batches")``) reads it.

        Raises:
            ValueError: Outside the ``with`` block; where the step's ``info`` holds the whole
                step's ``individual_losses``; for ``individual_losses`` without ``loss`` where
                ``info`` lacks ``batch_size``; for losses that disagree with the forward pass's
                samples; where a quantity needs BackPACK's curvatures or a kept graph (not
                combined over micro-batches); when a micro-batch ran no backward pass or two.
        """
        cockpit, plan = self._cockpit, self._plan
        if not self._open:
            raise ValueError("micro_batch() starts a micro-batch inside `with cockpit(...) as tracked:`, before its backward pass")
        given = {name: value for name, value in (("individual_losses", individual_losses), ("loss", loss)) if value is not None}
        check_info(given)
        if plan.has_info("individual_losses"):
            raise ValueError(
                "info['individual_losses'] are the losses of a step of one backward pass: with micro-batches, hand "
                "each micro-batch's to micro_batch(individual_losses=...)"
            )
        ran = self._grads is not None and self._grads.passes > 0
        if ran or (self._micro and self._grads is None):
            self._end_pass(last=False)
        elif self._pass is not None:  # begun at entry, before any backward pass: not a micro-batch
            cockpit._engine.end(self._pass, failed=True)
            self._pass = None
        self._unplanned = None
        self._refuse_uncombined()
        self._micro = True
        if self._grads is not None:  # micro-batches' statistics wait for the step's gradient
            self._grads.on_grad = None
        weight = self._begin(individual_losses, loss, micro=True) if plan.requests else None
        size = individual_losses.numel() if individual_losses is not None else batch_size
        self._given = _MicroBatch(individual_losses, loss, weight, size)

    def _refuse_uncombined(self):
        """What is not combined over micro-batches yet: a clear error on the second."""
        if not self._ended:
            return
        needs = [name for e in self._extensions for name in self._requested_by.get(type(e), [type(e).__name__])]
        needs += [type(q).__name__ for q in self._cockpit.quantities if q.create_graph(self._plan.global_step)]
        if needs:
            raise ValueError(
                f"{', '.join(sorted(set(needs)))} cannot be combined over micro-batches (they need BackPACK's "
                "curvatures or the gradient's graph of one backward pass): track them on steps of one backward pass"
            )

    def _begin(self, losses, loss, micro):
        """Let the engine plan the per-sample gradients of the backward pass to come; returns
        how that pass weighs each sample's loss."""
        cockpit, plan = self._cockpit, self._plan
        calls = cockpit._engine.calls_of(losses, loss)
        # The engine's own backward passes before the user's keep what BackPACK stored in
        # the forward pass (each backward pass frees it unless told to retain it), and are
        # none of the step's gradients.
        if self._grads is not None:
            self._grads.remove()
        with backpack(retain_graph=True), _then(self._grads and self._grads.attach):
            if micro:
                count = None if losses is None else losses.numel()
                _check_samples(count, "micro_batch(individual_losses=...)", calls)
                weight = _weight_of_each_sample(losses, loss, self._statistics.batch_size)
                size = count
            else:
                try:
                    _check_batch_size(plan, calls)
                except ValueError as error:
                    if losses is not None or loss is not None:
                        raise
                    # No loss yet tells which forward pass is the step's: micro-batches may follow.
                    self._unplanned = error
                    return 1.0
                if not cockpit._mean_checked:
                    _check_mean_loss(plan)
                    cockpit._mean_checked = True
                weight = 1.0 / losses.numel() if isinstance(losses, torch.Tensor) and losses.numel() else 1.0
                size = plan.given_batch_size()
            try:
                self._pass = cockpit._engine.begin(losses, weight, size, loss, calls)
            except RuntimeError as error:
                if micro and "backward through the graph a second time" in str(error):
                    raise ValueError(f"micro_batch() came after its micro-batch's backward pass (its graph is freed): {_MICRO_BATCH_ORDER}") from error
                raise
            except ValueError as error:
                if micro or losses is not None:
                    raise
                self._unplanned = error  # a forward pass that needs losses: micro_batch() may hand them in yet
        return weight

    def _end_pass(self, last):
        """After a micro-batch's backward pass: its gradients and per-sample statistics."""
        cockpit, plan = self._cockpit, self._plan
        if self._unplanned is not None:
            raise self._unplanned
        changed = self._grads.changed_in_place() if self._grads is not None else []
        if self._grads is not None and _unscaled_inside(plan):  # (its kernel leaves the version counters alone)
            grads = self._grads.grads
            changed = [i for i in grads if plan.params[i].grad is not None and grads[i].data_ptr() == plan.params[i].grad.data_ptr()]
        if changed:
            raise ValueError(
                f"[Step {plan.global_step}] the gradient of {cockpit._named(sorted(changed))} "
                "was changed in place inside `with cockpit(...)` (clip_grad_norm_, GradScaler.unscale_, zero_grad), "
                "where the statistics read the backward pass's gradient: change it after the `with` block"
            )
        grads, passes = self._grads.take() if self._grads is not None else ({}, 1)
        if self._grads is not None and not passes:
            raise ValueError(
                "no backward pass reached the tracked parameters "
                + ("after micro_batch(): " + _MICRO_BATCH_ORDER if self._micro else "inside `with cockpit(...)`: call loss.backward() inside the `with` block")
                + f" {WRAPPED_LATER}"
            )
        if passes > 1 and plan.requests:
            raise ValueError(
                f"{passes} backward passes ran for one {'micro-batch' if self._micro else 'step'}: for gradient "
                f"accumulation, {_MICRO_BATCH_ORDER}, in `with cockpit(...) as tracked:`; for LBFGS, whose step "
                "evaluates its closure several times, run one closure's backward pass inside the block, the step after "
                "it. A custom autograd.Function whose backward runs one of its own (a reversible layer recomputing its "
                "inputs, as Reformer's; a hand-made checkpoint) counts too: per-sample gradients cannot be computed "
                "through it"
            )
        if self._stream_error is not None:
            raise self._stream_error
        if self._pass is not None and self._pass.taken and not last:
            raise ValueError(
                f"micro_batch() came after its micro-batch's backward pass (one before any micro_batch() is taken as the "
                f"step's only one): {_MICRO_BATCH_ORDER}, the first micro-batch's too"
            )
        if plan.unscale != 1.0:
            grads = {index: g * plan.unscale for index, g in grads.items()}
        elif not last:  # the next pass may add into the tensor autograd handed on, now param.grad
            grads = {index: g.clone() for index, g in grads.items()}
        for index, grad in grads.items():
            self._total[index] = grad if index not in self._total else self._total[index] + grad
        if self._pass is not None:
            step, self._pass = self._pass, None
            keyed = {id(plan.params[index]): grad for index, grad in grads.items()}
            only_pass = last and not self._statistics.micro_batches and plan.group is None and self._grads is not None
            final = {index: grad.detach() for index, grad in grads.items()} if only_pass else None
            self._statistics.add(cockpit._engine.end(step, keyed, unscale=plan.unscale), final, graded=set(grads))
        if self._reads_micro:
            self._given = self._given._replace(
                squared_norms=[grads[i].double().square().sum() if i in grads else None for i in range(len(plan.params))]
            )
        self._ended.append(self._given)

    def __exit__(self, exc_type, exc, traceback):
        try:
            # The statistics and the quantities in their own dtypes, wherever the step runs.
            with outside_autocast(self._cockpit.params):
                self._exit(exc_type, exc, traceback)
        finally:
            self._cockpit._plan_watching(self._plan.global_step)

    def _exit(self, exc_type, exc, traceback):
        cockpit = self._cockpit
        self._open = False
        for context in reversed(self._contexts):
            context.__exit__(exc_type, exc, traceback)
        try:
            if exc_type is None and (self._pass is not None or self._grads is not None or self._micro):
                self._end_pass(last=True)
        except BaseException:
            exc_type = ValueError
            raise
        finally:
            if self._grads is not None:
                self._grads.remove()
            if self._pass is not None:  # a pass that failed, or never ended
                cockpit._engine.end(self._pass, failed=True)
                self._pass = None
            if exc_type is not None:
                cockpit._free(self._buffers, self._extended)
        if exc_type is AssertionError and "expects a backpropagation quantity" in str(exc) and self._curvature_names:
            names = sorted({name for e in self._extensions for name in self._requested_by.get(type(e), [])})
            raise ValueError(
                f"{', '.join(names)} need BackPACK's curvatures, which it backpropagates from the loss module: compute "
                "the loss backward() runs on with a backpack.extend-ed loss module (extend(nn.CrossEntropyLoss())), "
                "not a functional loss (F.cross_entropy)"
            ) from exc
        if exc_type is not None:
            return
        ctx, skipped = self._finish()
        cockpit._track(ctx, self._buffers, self._curvature_names, skipped)

    def _finish(self):
        """The step's context: its gradient, statistics and ``info`` over its micro-batches;
        and the quantities skipped for the step."""
        cockpit, plan = self._cockpit, self._plan
        local_grads = self._total
        stats = self._statistics
        grads = None  # param.grad, where the step's gradients were not captured
        reads = any(q.reads_batch(plan.global_step) for q in cockpit.quantities)  # (else nothing to say)
        if plan.group is None and self._grads is not None:
            # A parameter no backward pass reached (an expert no token chose): its gradient is zero.
            grads = [local_grads[i].detach() if i in local_grads else zero_grad(p) for i, p in enumerate(plan.params)]
            cockpit._say_unreached(plan.global_step, [i for i in range(len(plan.params)) if reads and i not in local_grads])
        elif plan.group is None and reads:
            cockpit._say_unreached(plan.global_step, unreached(plan.params))
        info = _combined_info(plan, self._ended, None if stats is None else stats.samples) if self._micro else None
        norms = _micro_batch_norms(self._ended, plan, local_grads) if self._reads_micro else None
        step = {"local_grads": local_grads, "grads": grads, "info": info, "micro_batch_norms": norms,
                "extended_params": self._extended}
        if stats is None:
            return StepContext(plan, **step), []
        if self._micro and stats.batch_size is not None and stats.samples != stats.batch_size:
            raise ValueError(
                f"info['batch_size'] is {stats.batch_size}, but the step's micro-batches held {stats.samples} samples"
            )
        if plan.group is not None:
            stats.agree(*agreed_by_ranks(stats.reached, stats.complete, stats.dropped, plan.params, plan.group))
            cockpit._say_unreached(plan.global_step, [i for i in range(len(plan.params)) if i not in stats.anywhere])
        results = defaultdict(dict)
        for statistic, index, value in stats.values():
            results[statistic][index] = value
        if plan.group is None:
            for statistic, index, value in stats.later(grads):
                results[statistic][index] = value
        ctx = StepContext(
            plan, results=results, local_batch_size=stats.samples or None,
            waiting=stats if plan.group is not None else None, **step,
        )
        if not stats.dropped:
            return ctx, []
        skipped = [q for q in cockpit.quantities if plan.statistics_of[q] & stats.skipped]
        warnings.warn(
            f"[Step {plan.global_step}] {', '.join(type(q).__name__ for q in skipped)} skipped: the micro-batches' "
            f"per-sample gradients they wait for (the step's gradient, or its batch size: info['batch_size']) "
            f"outgrew max_kept_bytes={cockpit.max_kept_bytes}",
            RuntimeWarning,
            stacklevel=3,
        )
        return ctx, skipped


class _MicroBatch(NamedTuple):
    """What one backward pass of a step was told, and gave."""

    losses: Optional[torch.Tensor] = None  # its samples' own losses, where handed in
    loss: Optional[torch.Tensor] = None  # the loss it ran on, where handed in
    weight: Optional[float] = None  # how it weighs each sample's loss (None: no losses)
    size: Optional[int] = None  # its samples, where told
    squared_norms: Optional[list] = None  # its gradient's, per parameter (the noise scale's)


@contextlib.contextmanager
def _then(action):
    """Runs ``action`` (if any) on leaving the block, however it is left."""
    try:
        yield
    finally:
        if action:
            action()


def _unscaled_inside(plan):
    """Whether ``info['grad_scaler']`` unscaled the gradients in place (``unscale_``) since its
    last ``update()``: inside the step's ``with`` block, before the statistics read them."""
    scaler = plan.given("grad_scaler") if plan.has_info("grad_scaler") else None
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    return any(state.get("stage") is OptState.UNSCALED for state in states.values())


def _weight_of_each_sample(losses, loss, batch_size):
    """How a micro-batch's backward pass weighs each sample's loss: ``loss / sum(losses)`` where
    both are given (any uniform weighting: a mean over the micro-batch divided by their count,
    a sum over the step's batch size), else ``1 / batch_size``; None without losses."""
    if not isinstance(losses, torch.Tensor):
        return None
    if isinstance(loss, torch.Tensor):
        total = losses.detach().double().sum()
        if total.isfinite() and total != 0:
            return float(loss.detach().double().reshape(()) / total)
    if batch_size is None:
        raise ValueError(
            "micro_batch(individual_losses=...) needs the micro-batch's loss too (loss=..., the one its backward "
            "pass runs on), or info['batch_size'] of the whole step (each micro-batch's loss then its losses' sum "
            "over it)"
        )
    return 1.0 / batch_size


def _micro_batch_norms(ended, plan, local_grads):
    """``(sizes, squared norms, the step's)`` of the micro-batches ``ended``
    (``StepContext.micro_batch_norms``)."""
    sizes = [plan.given_batch_size() or 0] if len(ended) == 1 and ended[0].size is None else [m.size for m in ended]
    if any(size is None for size in sizes):
        raise ValueError(
            "the gradient noise scale from micro-batches needs each micro-batch's size: "
            "tracked.micro_batch(individual_losses=...) or tracked.micro_batch(batch_size=...)"
        )
    device = plan.params[0].device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    squared = torch.stack([torch.stack([zero if v is None else v for v in m.squared_norms]) for m in ended])
    step = torch.stack([local_grads[i].double().square().sum() if i in local_grads else zero for i in range(len(plan.params))])
    return torch.tensor(sizes, dtype=torch.float64, device=device), squared, step


def _combined_info(plan, ended, samples):
    """The step's ``info``, with ``batch_size``, ``individual_losses`` and ``loss`` from its
    micro-batches' (where the plan's lacks them and every micro-batch handed them in): each
    sample's loss weighed as the backward passes weighed it, so that their mean is the step's."""
    entries = {}
    if not plan.has_info("batch_size") and samples:
        entries["batch_size"] = samples
    n = int(plan.given("batch_size")) if plan.has_info("batch_size") else entries.get("batch_size")
    if all(m.losses is not None and m.weight is not None for m in ended) and n:
        entries["individual_losses"] = torch.cat([m.losses.detach().reshape(-1) * (n * m.weight) for m in ended])
    if not plan.has_info("loss") and all(m.loss is not None for m in ended):
        entries["loss"] = sum(m.loss.detach().reshape(()) for m in ended)
    return plan.info_with(**entries)


def _record_visited(visited):
    """BackPACK extension hook: adds every parameter its extensions filled to ``visited`` (to
    free them)."""
    seen = set()

    def record(module):
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                visited.append(param)

    return record


def _trainable(params):
    """The parameters that require gradients; the frozen ones are left out, saying so once."""
    params = list(params)
    trainable = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
    others = [p for p in params if not isinstance(p, torch.Tensor)]
    if others:
        raise TypeError(f"Cockpit tracks tensors (model.parameters()), got a {type(others[0]).__name__}")
    if not trainable:
        raise ValueError(
            f"none of the {len(params)} parameters given requires gradients (requires_grad=False): nothing to track"
        )
    if len(trainable) < len(params):
        warnings.warn(
            f"Cockpit: {len(params) - len(trainable)} of the {len(params)} parameters given are frozen "
            "(requires_grad=False) and are not tracked; tracking the other "
            f"{len(trainable)}", UserWarning, stacklevel=3,
        )
    return trainable


def _refuse_earlier_gradients(params):
    """Gradients in ``.grad`` before the tracked backward pass (a micro-batch's backward pass made
    outside the ``with`` block, or no ``zero_grad``) would be mixed into the statistics unseen."""
    held = [p.grad for p in params if p.grad is not None]
    if held and bool(torch.stack([g.detach().ne(0).any() for g in held]).any()):
        raise ValueError(
            "tracked parameters hold gradients from before `with cockpit(...)` (a backward pass outside it, or no "
            "zero_grad()): the statistics would mix them in unseen. Zero the gradients before the tracked step's "
            "forward pass, and run its backward pass inside the `with` block"
        )


def _check_batch_size(ctx, calls):
    """``info``'s batch size and individual losses against the samples of the forward pass: a
    mismatch would weigh every statistic wrongly."""
    losses = ctx.given("individual_losses")
    count = None if not isinstance(losses, torch.Tensor) else losses.numel()
    if ctx.has_info("batch_size") and count is not None and count != int(ctx.given("batch_size")):
        raise ValueError(
            f"info['individual_losses'] holds {count} losses but info['batch_size'] is {int(ctx.given('batch_size'))}: "
            "hand in one loss per sample of this batch"
        )
    name = "info['batch_size']" if ctx.has_info("batch_size") else "info['individual_losses']"
    _check_samples(ctx.given_batch_size(), name, calls)


def _check_samples(told, name, calls):
    """``told`` samples (by ``name``) against those of the forward pass's module calls."""
    seen = Counter(call.batch_size for call in calls if not call.shared)
    if told is None or not seen or told in seen:
        return
    raise ValueError(
        f"{name} tells {told} samples, but the forward pass this backward pass runs through had "
        f"{seen.most_common(1)[0][0]} (along the sample dimension of its module calls): hand in the batch's own "
        "size and losses (a last batch may be smaller)"
    )


def _check_mean_loss(ctx):
    """Cockpit's quantities assume the mini-batch loss is the mean of the individual losses."""
    if not (ctx.has_info("loss") and ctx.has_info("individual_losses")):
        return
    loss = ctx.loss(None)
    losses = ctx.info("individual_losses", None).detach()
    if losses.numel() == 0:
        return
    # Beyond what rounding explains: a mean of N terms of size s, in the less precise of the two
    # dtypes, is exact to about N eps s.
    eps = max(torch.finfo(loss.dtype).eps, torch.finfo(losses.dtype).eps)
    mean = losses.double().mean()
    tolerance = (losses.numel() + 8) * eps * losses.double().abs().mean() + 1e-30
    if (loss.double() - mean).abs() > tolerance:
        raise ValueError(
            f"info['loss'] = {loss.item():.6g} is not the mean of info['individual_losses'] ({mean.item():.6g}): "
            "the cockpit's statistics assume a mean-reduced loss (reduction='mean')"
        )


def _check_curvature_support(engine, extensions, requested_by):
    """A BackPACK curvature on a module BackPACK cannot handle: a clear error before the backward
    (where the cockpit watches the calls: a user's extension beside quantities that need none
    meets BackPACK's own error)."""
    if engine is None:
        return
    for ext in extensions:
        if ext.savefield not in CURVATURE_EXTENSIONS:
            continue
        supported = ext._BackpropExtension__module_extensions
        for call in engine.capture.calls():
            for leaf in call.module.modules():
                if next(leaf.parameters(recurse=False), None) is not None and type(leaf) not in supported:
                    raise ValueError(
                        f"{_needing([ext], requested_by)} BackPACK's {type(ext).__name__}, which does not support "
                        f"{type(leaf).__name__} ({leaf}): track it on models of layers BackPACK knows"
                    )


def _needing(extensions, requested_by):
    """Who asks for ``extensions``, with the verb: ``TICDiag needs``, ``HessTrace, TICDiag need``
    (an extension's own name where the user asked for it)."""
    names = sorted({name for e in extensions for name in requested_by.get(type(e), [type(e).__name__])})
    return f"{', '.join(names)} need{'s' if len(names) == 1 else ''}"


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
