"""``CockpitCallback`` for the Hugging Face ``transformers.Trainer``, added in one line::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CockpitCallback("economy", logpath="logs/run")])

Each optimizer step of the trainer is one cockpit step, whatever ``gradient_accumulation_steps``
says: each micro-batch's per-sample losses come from the model's own output (a causal language
model's logits and labels, as its loss weighs tokens, with ``-100`` labels and padding; a
classifier's logits and labels), and the statistics are those of the gradient before the trainer
clips it (``max_grad_norm``). Whenever the trainer logs (``logging_steps``), each quantity's
latest value goes to the trainer's own loggers (``report_to``: TensorBoard, W&B, ...) under
``cockpit/<Quantity>`` names, at the trainer's step (as its loss: the step just taken), every
parameter's too with ``per_parameter=True``; every tracked step is in the cockpit's log. At the end of training
the cockpit's log and dashboard are written to ``logpath``. The cockpit's state is saved in each
checkpoint the trainer writes (``cockpit_state.pt``; under ``torchrun`` each process's own,
``cockpit_state_rank<r>.pt``, as the trainer's random states) and restored when it resumes from
one (``trainer.train(resume_from_checkpoint=...)``). The cockpit is ``callback.cockpit``. Each
``train()`` that does not resume (a second one, each trial of ``hyperparameter_search``, a new
model from ``model_init``) is a run of its own: a new cockpit tracks it, its log goes to
``logpath + "_run<k>"``, and the earlier runs' outputs stay in ``callback.earlier_outputs``.

Where the model does not take ``num_items_in_batch`` (its ``forward`` has no ``**kwargs``), the
trainer divides each micro-batch's loss by the micro-batches of the step (fewer in an epoch's
last, shorter cycle), and so does the callback.
"""

import inspect
import os
import warnings

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from cockpit_fast.integrations._tracking import (
    Runs,
    TrainerSteps,
    latest_scalars,
    sample_losses,
    write_results,
)

STATE_FILE = "cockpit_state.pt"
"""The cockpit's state in each checkpoint folder the trainer writes, restored when it resumes
(each process's own under ``torchrun``: :func:`state_file`)."""


def state_file(cockpit):
    """The name of ``cockpit``'s state file in a checkpoint folder: one per process where
    several track (their states differ, see :meth:`~cockpit_fast.Cockpit.state_dict`)."""
    if cockpit.process_group is None:
        return STATE_FILE
    return f"cockpit_state_rank{cockpit.rank}.pt"


class CockpitCallback(TrainerCallback):
    """Tracks ``quantities`` on every optimizer step of a ``transformers.Trainer``.

    Args:
        quantities (list or str): Quantities, or a configuration label (``"economy"``,
            ``"business"``, ``"full"``). Defaults to ``"economy"``.
        logpath (str, optional): Where the cockpit's log goes (``logpath + '.json'``, streamed
            as the run goes) and its dashboard at the end of training; None: neither.
        plot (bool): Draw the dashboard beside the log. Defaults to ``True``.
        max_kept_bytes (int, optional): :class:`~cockpit_fast.Cockpit`'s bound on what an
            accumulated step keeps.
        per_parameter (bool): Log each parameter's values too (one scalar each), not only the
            whole model's. Defaults to ``False``.
    """

    def __init__(self, quantities="economy", logpath=None, plot=True, max_kept_bytes=None, per_parameter=False):
        self.plot, self.per_parameter = plot, per_parameter
        self.cockpit = None
        self._runs = Runs(logpath, quantities, max_kept_bytes)
        self._steps = self._hook = self._trainer = self._args = None
        self._logging = False  # inside our own trainer.log: its on_log is ours to pass
        self._logged_through = None  # the newest tracked step logged

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._trainer, resumed_from = _calling_trainer()
        cockpit = self._runs.next(self.cockpit, model, resumed_from is not None, state.global_step, "train()")
        if cockpit is not None:
            self.cockpit = cockpit
            self._steps, self._logged_through = TrainerSteps(self.cockpit), None
            if self._hook is not None:  # on the last run's model
                self._hook.remove()
                self._hook = None
        if self._hook is None:
            # Bookkeeping, hidden from torch.compile (torch_compile=True inlines the model's hooks).
            self._hook = model.register_forward_hook(torch.compiler.disable(self._micro_batch), with_kwargs=True)
        self._args = args
        if resumed_from is not None:
            self._restore(resumed_from)

    def _restore(self, folder):
        # This process's own state, else one process's (a checkpoint of one process, or of an
        # earlier version): the cockpit refuses it where it holds another process's own values.
        for name in (state_file(self.cockpit), STATE_FILE, "cockpit_state_rank0.pt"):
            if os.path.isfile(os.path.join(folder, name)):
                self.cockpit.load_state_dict(torch.load(os.path.join(folder, name), weights_only=True))
                return
        warnings.warn(f"the checkpoint {folder} holds no cockpit state: the cockpit starts afresh")

    def on_save(self, args, state, control, **kwargs):
        # Beside the trainer's own state in the checkpoint it has just written (under torchrun
        # each process's, as the trainer's random states).
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.cockpit.state_dict(), os.path.join(folder, state_file(self.cockpit)))

    def _micro_batch(self, module, args, kwargs, output):
        if not (module.training and torch.is_grad_enabled() and self._steps.open):
            return
        labels, num_items = kwargs.get("labels"), kwargs.get("num_items_in_batch")
        losses = sample_losses(getattr(output, "logits", None), labels, num_items)
        loss = getattr(output, "loss", None)
        if losses is None or loss is None:
            self._steps.micro_batch(None, None)
            return
        # The loss the trainer backpropagates: the model's, divided by the step's micro-batches
        # where the model did not divide by the tokens of all of them itself; where it divided by
        # those of every process (average_tokens_across_devices, under torchrun), times their number.
        if num_items is None:
            self._steps.micro_batch(losses, loss / self._micro_batches())
        else:
            processes = self._args.world_size if getattr(self._args, "average_tokens_across_devices", False) else 1
            self._steps.micro_batch(losses * processes, loss * processes)

    def _micro_batches(self):
        steps = getattr(self._trainer, "current_gradient_accumulation_steps", None)
        return steps if steps is not None else self._args.gradient_accumulation_steps

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # fp16 mixed precision: accelerate's backward multiplies the loss by its GradScaler's scale.
        self._steps.begin(state.global_step, optimizer, getattr(getattr(self._trainer, "accelerator", None), "scaler", None))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._steps.end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # trainer.log reaches every logger the trainer reports to (they see its logs before
        # this callback does: the cockpit's numbers follow as a log of their own).
        if self._logging or self._trainer is None or self.cockpit is None:
            return
        output = self.cockpit.recent_output()
        newest = max(output, default=None)
        if newest is None or newest == self._logged_through:  # nothing tracked since (the run's summary)
            return
        self._logged_through = newest
        scalars = latest_scalars(self.cockpit, output, self.per_parameter)
        if scalars:
            self._logging = True
            try:
                self._trainer.log(scalars)
            finally:
                self._logging = False

    def on_train_end(self, args, state, control, **kwargs):
        self._steps.abandon()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        write_results(self.cockpit, self._runs.logpath, self.plot)

    @property
    def earlier_outputs(self):
        """The outputs of the runs before this one (each ``train()`` from step 0), in order."""
        return self._runs.earlier


def _calling_trainer():
    """The ``Trainer`` whose training loop runs this callback (callbacks are not handed it) and
    the checkpoint it resumes from (None: none), read from the loop's frame."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate, frame.f_locals.get("resume_from_checkpoint")
        frame = frame.f_back
    return None, None
