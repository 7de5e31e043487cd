"""What the trainer callbacks share: one cockpit step per optimizer step, spanning the trainer's
micro-batches, each sample's loss taken from the model's output, the output handed to the
trainer's loggers, the log and dashboard written at the end."""

import copy
import os
import warnings

import torch
import torch.nn.functional as F

from cockpit_fast.cockpit import Cockpit
from cockpit_fast.integrations.language_models import causal_lm_losses
from cockpit_fast.loggers import CockpitLogger, parameter_names, records
from cockpit_fast.plotter import CockpitPlotter
from cockpit_fast.utils.configuration import configuration


def make_cockpit(model, quantities, max_kept_bytes=None, logpath=None):
    """A cockpit of ``model``'s trainable parameters tracking ``quantities`` (a list, or a
    configuration label: ``"economy"``, ``"business"``, ``"full"``), streaming its log to
    ``logpath`` (if given), whose steps keep their gradient before the trainer clips it."""
    if isinstance(quantities, str):
        quantities = configuration(quantities)
    cockpit = Cockpit(model.parameters(), quantities=list(quantities), max_kept_bytes=max_kept_bytes, logpath=logpath)
    cockpit.capture_grads = True
    return cockpit


def sample_losses(logits, labels, num_items_in_batch=None):
    """Each sample's loss as the model's own loss weighs it (their mean is that loss): a causal
    language model's ``(N, T, V)`` logits with ``(N, T)`` labels, or a classifier's ``(N, C)``
    logits with ``(N,)`` labels; None for other outputs."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return None
    if logits.dim() == 3 and labels.shape == logits.shape[:-1]:
        return causal_lm_losses(logits, labels, num_items_in_batch=num_items_in_batch)
    if logits.dim() == 2 and labels.dim() == 1 and labels.shape[0] == logits.shape[0] and not labels.is_floating_point():
        # In float32 at least: a half-precision model's logits upcast, a float64 one's left as they are.
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels, reduction="none")
    return None


class TrainerSteps:
    """Opens a cockpit step when the trainer starts an optimizer step, starts a micro-batch on
    each forward pass of the model in training, and closes the step before the trainer clips
    the gradient and steps the optimizer.

    Args:
        cockpit (Cockpit): The cockpit (:func:`make_cockpit`).
    """

    def __init__(self, cockpit):
        self.cockpit = cockpit
        self._step = None  # the open step, from its `with` statement's __enter__
        self._abandoned = False

    def begin(self, global_step, optimizer, grad_scaler=None):
        """Open the step ``global_step`` (closing one a failed step left open); ``grad_scaler``:
        the trainer's ``GradScaler`` (fp16 mixed precision), whose scale its backward passes
        multiply the loss by."""
        self.abandon()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's and Lightning's wrappers
        info = {"optimizer": optimizer} if isinstance(optimizer, torch.optim.Optimizer) else {}
        if grad_scaler is not None and grad_scaler.is_enabled():
            info["grad_scaler"] = grad_scaler
        step = self.cockpit(global_step, info=info)
        step.__enter__()
        self._step = step

    def micro_batch(self, individual_losses, loss, scaled=False):
        """A micro-batch's forward pass ran: its losses (None where the cockpit cannot tell them)
        and the loss backpropagated (``scaled``: already times the step's grad scaler's scale)."""
        if self._step is not None:
            if scaled and loss is not None:
                loss = loss * self._step.unscale
            self._step.micro_batch(individual_losses=individual_losses, loss=loss)

    def end(self):
        """Close the open step: the quantities track it."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(None, None, None)

    def abandon(self):
        """Close a step the trainer never finished (an exception in between), tracking nothing."""
        step, self._step = self._step, None
        if step is not None:
            step.__exit__(RuntimeError, RuntimeError("abandoned"), None)

    @property
    def open(self):
        return self._step is not None


class ScalarForwarder(CockpitLogger):
    """Hands each new entry of the cockpit's output, as numbers, to ``write(step, scalars)`` (a
    trainer's loggers); histograms' counts are left to the cockpit's own log."""

    def __init__(self, write, per_parameter=False):
        super().__init__(per_parameter=per_parameter)
        self._forward = write

    def _write(self, step, scalars, histograms):
        if scalars:
            self._forward(step, scalars)


def latest_scalars(cockpit, output, per_parameter=False):
    """``{tag: number}`` of each quantity's latest value in ``output`` (the cockpit's recent
    rows: Alpha's and UpdateSize's come one step later than the others'), tagged as
    :mod:`cockpit_fast.loggers` tags them."""
    latest = {}
    for step in sorted(output, reverse=True):
        for name, value in output[step].items():
            if value is not None:
                latest.setdefault(name, value)
    return records(latest, parameter_names(cockpit), per_parameter)[0]


class Runs:
    """The runs a trainer callback tracks. A ``train()``/``fit()`` that starts afresh (at step 0, not
    from a checkpoint: a second one, a hyperparameter search's trial) or on another model is a
    run of its own: its own cockpit, of fresh quantities (copies of those given, as they were
    before any run), and its own log (``logpath + "_run<k>"`` after the first). The earlier runs'
    outputs stay in :attr:`earlier`; their cockpits stop watching the process's module calls and
    are let go (a search's trials keep no model alive). A ``fit()`` that goes on from the trainer's
    step, or one resumed from a checkpoint, goes on in the same run.

    Args:
        logpath (str, optional): The first run's log.
        quantities (list or str): The callback's quantities, or a configuration label.
        max_kept_bytes (int, optional): Each run's cockpit's (:func:`make_cockpit`).
    """

    def __init__(self, logpath, quantities, max_kept_bytes=None):
        self.base_logpath, self._given, self._max_kept_bytes = logpath, quantities, max_kept_bytes
        self.earlier = []  # each earlier run's output, Cockpit.get_output()
        try:  # (before any run changes them)
            self._unused = quantities if isinstance(quantities, str) else _copied(list(quantities))
        except Exception as error:  # noqa: BLE001 (any object a user hands in)
            self._unused = error

    @property
    def logpath(self):
        """The log of the current run."""
        runs = len(self.earlier)
        return self.base_logpath if self.base_logpath is None or not runs else f"{self.base_logpath}_run{runs}"

    def quantities(self):
        """The current run's quantities: those given for the first, fresh copies for later ones."""
        if not self.earlier or isinstance(self._given, str):
            return self._given
        if isinstance(self._unused, Exception):
            raise ValueError(
                f"CockpitCallback: a new run needs fresh quantities, and those given cannot be copied "
                f"({self._unused}): hand a configuration label, or make a callback for each run"
            )
        return _copied(self._unused)

    def next(self, cockpit, model, resumed, step, started):
        """The new cockpit of ``model`` that a ``train()``/``fit()`` (``started``, for the warning)
        at the trainer's ``step`` (``resumed``: from a checkpoint) needs instead of ``cockpit``
        (None: none yet), or None where the run goes on. A new run says so."""
        if cockpit is not None:
            held = {id(p) for p in model.parameters()}
            if all(id(p) in held for p in cockpit.params) and (resumed or step > 0):  # the same run goes on
                return None
            cockpit.stop_watching()
            if not resumed:  # (another model going on from a checkpoint: its run, restored into the new cockpit)
                self.earlier.append(cockpit.get_output())
                log = "" if self.logpath is None else f", its log goes to {self.logpath}.json"
                warnings.warn(
                    f"CockpitCallback: {started} again from step 0: a new cockpit tracks this run{log}; the earlier "
                    "runs' outputs stay in callback.earlier_outputs",
                    stacklevel=4,
                )
        return make_cockpit(model, self.quantities(), self._max_kept_bytes, self.logpath)


def _copied(quantities):
    """Deep copies of ``quantities``, sharing their schedules and other callables (a lambda, a
    ``staticmethod``: nothing a run changes)."""
    shared = {id(value): value for q in quantities for value in getattr(q, "__dict__", {}).values()
              if callable(value) or isinstance(value, (staticmethod, classmethod))}
    return copy.deepcopy(quantities, shared)


def write_results(cockpit, logpath, plot):
    """The cockpit's log (``logpath + '.json'``) and dashboard (beside it) at the end of training."""
    if logpath is None:
        return
    cockpit.write(logpath)
    if plot and cockpit.is_writer():
        folder, name = os.path.split(logpath)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # panels without data (quantities not tracked) say so
            CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=folder or ".", savename=name)


def lightning_callback(base, module):
    """The Lightning callback (:mod:`cockpit_fast.integrations.lightning`) on ``base``, the
    ``Callback`` class of ``lightning`` or of ``pytorch_lightning`` (two packages, two classes),
    named as ``module``'s ``CockpitCallback`` (pickle finds it there: ``ddp_spawn`` sends it)."""

    class CockpitCallback(base):
        """Tracks ``quantities`` on every optimizer step of a Lightning ``Trainer``.

        Args:
            quantities (list or str): Quantities, or a configuration label (``"economy"``,
                ``"business"``, ``"full"``). Defaults to ``"economy"``.
            logpath (str, optional): Where the cockpit's log goes (``logpath + '.json'``,
                streamed as the run goes) and its dashboard at the end of training; None:
                neither.
            plot (bool): Draw the dashboard beside the log. Defaults to ``True``.
            losses_attribute (str): The LightningModule's attribute that ``training_step`` sets
                to each sample's loss (read, then set to None, before each backward pass).
                Defaults to ``"individual_losses"``.
            max_kept_bytes (int, optional): :class:`~cockpit_fast.Cockpit`'s bound on what an
                accumulated step keeps.
            per_parameter (bool): Log each parameter's values too (one scalar each), not only
                the whole model's. Defaults to ``False``.
        """

        def __init__(
            self, quantities="economy", logpath=None, plot=True, losses_attribute="individual_losses",
            max_kept_bytes=None, per_parameter=False,
        ):
            self.plot, self.per_parameter = plot, per_parameter
            self.losses_attribute = losses_attribute
            self.cockpit = None
            self._runs = Runs(logpath, quantities, max_kept_bytes)
            self._steps = self._logger = None
            self._restored = None  # a checkpoint's cockpit state, until the cockpit is made
            self._stage = None  # the trainer's stage ("fit", "validate", ...) from setup to teardown
            self._fit_started = False  # on_fit_start ran since setup

        def on_fit_start(self, trainer, pl_module):
            # (Not in setup(): configure_model, after it, may shard the parameters, FSDP2's fully_shard.)
            cockpit = self._runs.next(self.cockpit, pl_module, self._restored is not None, trainer.global_step, "fit()")
            if cockpit is not None:
                self.cockpit = cockpit
                self._steps = TrainerSteps(self.cockpit)
                # pl_module.log reaches every logger of the trainer, at the step being taken.
                log = lambda step, scalars: pl_module.log_dict(scalars, on_step=True, on_epoch=False)  # noqa: E731
                self._logger = ScalarForwarder(log, self.per_parameter)
            if self._restored is not None:
                self._restore(self._restored)
                self._restored = None
            self._fit_started = True

        def on_train_start(self, trainer, pl_module):
            if len(trainer.optimizers) > 1:
                raise ValueError(
                    f"CockpitCallback tracks the steps of one optimizer, over every trainable parameter; "
                    f"{type(pl_module).__name__} configures {len(trainer.optimizers)}: track it with a Cockpit in "
                    "training_step instead (one per optimizer, over its parameters)"
                )

        def on_before_backward(self, trainer, pl_module, loss):
            # fp16 mixed precision: `loss` comes scaled by the precision plugin's GradScaler.
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if not self._steps.open:  # the optimizer step's first micro-batch, its gradients zeroed
                self._steps.begin(trainer.global_step, trainer.optimizers[0] if trainer.optimizers else None, scaler)
            losses = getattr(pl_module, self.losses_attribute, None)
            if losses is not None:
                setattr(pl_module, self.losses_attribute, None)  # this micro-batch's, no later one's
            given = isinstance(losses, torch.Tensor)
            # `loss` is what Lightning backpropagates: the module's, over accumulate_grad_batches.
            self._steps.micro_batch(losses if given else None, loss if given else None, scaled=scaler is not None)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._steps.end()
            self._logger.log(self.cockpit, trainer.global_step)

        def on_train_end(self, trainer, pl_module):
            self._steps.abandon()
            write_results(self.cockpit, self._runs.logpath, self.plot)

        @property
        def earlier_outputs(self):
            """The outputs of the runs before this one (each ``fit()`` from step 0), in order."""
            return self._runs.earlier

        def on_exception(self, trainer, pl_module, exception):
            if self._steps is not None:
                self._steps.abandon()

        def state_dict(self):
            if self.cockpit is None:
                return {}
            state, group = self.cockpit.state_dict(), self.cockpit.process_group
            if group is None:
                return {"cockpit": state}
            # Lightning asks every process and saves rank 0's: every process's own state,
            # gathered there ({rank: state}; each other process's holds its own).
            rank = self.cockpit.rank
            states = [None] * self.cockpit.world_size if rank == 0 else None
            torch.distributed.gather_object(state, states, dst=torch.distributed.get_global_rank(group, 0), group=group)
            return {"cockpit_by_rank": dict(enumerate(states)) if rank == 0 else {rank: state}}

        def setup(self, trainer, pl_module, stage):
            self._stage, self._fit_started = stage, False

        def teardown(self, trainer, pl_module, stage):
            self._stage, self._fit_started = None, False

        def load_state_dict(self, state_dict):
            # Lightning restores callbacks for validate, test and predict from a checkpoint too:
            # only a fit's goes on from it.
            if not state_dict or self._stage not in (None, "fit"):
                return
            if self.cockpit is not None and (self._stage is None or self._fit_started):
                self._restore(state_dict)  # by hand, or after on_fit_start (ModelParallelStrategy loads late)
            else:  # until on_fit_start makes the run's cockpit, or keeps the last run's
                self._restored = state_dict

        def _restore(self, state_dict):
            state = state_dict.get("cockpit")
            if "cockpit_by_rank" in state_dict:  # its rank's, else rank 0's (the cockpit refuses that where it cannot be)
                states = state_dict["cockpit_by_rank"]
                state = states.get(self.cockpit.rank, states.get(0))
            self.cockpit.load_state_dict(state)

    CockpitCallback.__module__, CockpitCallback.__qualname__ = module, "CockpitCallback"
    return CockpitCallback
