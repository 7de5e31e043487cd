"""Loggers for plain training loops: a cockpit's output to TensorBoard or Weights & Biases.

Call ``logger.log(cockpit)`` every few steps (or once at the end); each call writes the entries
of :meth:`~cockpit_fast.Cockpit.get_output` that no earlier call wrote, so a value that is known
only one step later (Alpha and UpdateSize of a step) follows in the next call::

    logger = TensorBoardLogger("runs/mlp")
    for step, batch in enumerate(loader):
        ...
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
        logger.log(cockpit, step)
    logger.close()

Tags are ``cockpit/<Quantity>``: numbers as scalars; per-parameter lists as one scalar per
parameter, ``cockpit/<Quantity>/<parameter name>``, and GradNorm also as the norm over all
parameters (``cockpit/GradNorm/all``); dict outputs (GradNoiseScale's) one tag per key,
``cockpit/<Quantity>/<key>``. GradHist1d's counts and edges become a histogram as they are
(nothing is recomputed from the gradients), and GradHist2d's marginal over the gradient axis
``cockpit/GradHist2d/gradients``. Most gradients sit in the bins around zero, whose spike
flattens every other bin on a linear axis: each histogram is also written with log10(1 + count)
per bin (``<tag>/log10``). Values that are none of these (the Parameters quantity's tensors,
GradHist2d's per-parameter histograms) are left out.
"""

import math
import numbers
import os

import torch

from cockpit_fast._optional import require

TAG_PREFIX = "cockpit"
SEPARATOR = "/"
HISTOGRAM_KEYS = ("hist", "edges")


class CockpitLogger:
    """Writes a cockpit's output entry by entry, each once; subclasses say where to.

    Args:
        names (list of str, optional): Names of the cockpit's tracked parameters, in the order
            of ``cockpit.params``, for the tags of per-parameter values. Defaults to the names
            in the model the cockpit saw (the keys of ``cockpit.routes()``), or ``param_<i>``
            where the cockpit has not seen a model (no quantity needed per-sample gradients).
        per_parameter (bool, optional): Write per-parameter values one tag per parameter;
            ``False``: the whole model's values only (GradNorm's ``all``). Defaults to ``True``.
    """

    def __init__(self, names=None, per_parameter=True):
        if names is not None:
            names = list(names)
            if not all(isinstance(name, str) for name in names):
                raise TypeError(f"names must be strings (parameter names), got {names!r}")
        self.names = names
        self.per_parameter = per_parameter
        self._written = {}  # step: names of the entries written

    def log(self, cockpit, step=None):
        """Write the entries of ``cockpit.get_output()`` (a streaming cockpit's recent rows: call
        it at least every ``Cockpit.RECENT_ROWS`` tracked steps) at steps up to ``step`` (``None``: all
        steps) that no earlier call wrote.

        Raises:
            ValueError: If ``names`` was given and does not name every tracked parameter.
        """
        output = _recent_output(cockpit)
        names = parameter_names(cockpit, self.names)
        for entry_step in sorted(output):
            if step is not None and entry_step > step:
                break
            written = self._written.setdefault(entry_step, set())
            new = {
                name: value for name, value in output[entry_step].items() if value is not None and name not in written
            }
            if new:
                self._write(entry_step, *records(new, names, self.per_parameter))
                written.update(new)
        # Steps the cockpit no longer holds are not written again.
        self._written = {s: w for s, w in self._written.items() if s in output}
        self._flush()

    def _write(self, step, scalars, histograms):
        """Write one step's ``{tag: number}`` and ``{tag: (counts, edges)}`` (float64 tensors)."""
        raise NotImplementedError

    def _flush(self):
        """Make what :meth:`_write` wrote visible."""

    def close(self):
        """Release what the logger holds (a run or writer handed in stays the caller's)."""


def _recent_output(cockpit):
    """The cockpit's rows a logger may not have written yet (Cockpit 1.0.2's: all of them)."""
    return cockpit.recent_output() if hasattr(cockpit, "recent_output") else cockpit.get_output()


def parameter_names(cockpit, names=None):
    """The names of the tags of ``cockpit``'s per-parameter values: ``names``, else those in the
    model the cockpit saw, else ``param_<i>``.

    Raises:
        ValueError: If ``names`` does not name every tracked parameter.
    """
    count = len(cockpit.params)
    if names is not None:
        if len(names) != count:
            raise ValueError(f"names has {len(names)} entries, the cockpit tracks {count} parameters")
        return names
    return list(cockpit.routes()) or [f"param_{index}" for index in range(count)]


def records(values, names, per_parameter=True):
    """``({tag: number}, {tag: (counts, edges)})`` of output entries ``{quantity name: value}``
    (see the module's docstring for the tags)."""
    scalars, histograms = {}, {}
    for name, value in values.items():
        _add_records(f"{TAG_PREFIX}{SEPARATOR}{name}", name, value, names, scalars, histograms, per_parameter)
    return scalars, histograms


def _add_records(tag, name, value, parameter_names, scalars, histograms, per_parameter=True):
    """File one output entry under ``tag`` into ``scalars`` and ``histograms`` by its kind
    (per-parameter values one scalar each only with ``per_parameter``)."""
    if isinstance(value, dict) and all(key in value for key in HISTOGRAM_KEYS):
        counts = torch.as_tensor(value["hist"], dtype=torch.float64)
        if counts.dim() == 1:
            _add_histogram(tag, counts, value["edges"], histograms)
        elif counts.dim() == 2:  # GradHist2d's bins: (gradient, parameter)
            _add_histogram(f"{tag}{SEPARATOR}gradients", counts.sum(dim=1), value["edges"][0], histograms)
    elif isinstance(value, dict):
        for key, item in value.items():
            _add_records(f"{tag}{SEPARATOR}{key}", name, item, parameter_names, scalars, histograms, per_parameter)
    elif _is_number(value):
        scalars[tag] = float(value)
    elif isinstance(value, (list, tuple)) or (hasattr(value, "ndim") and value.ndim == 1):
        if not all(_is_number(item) for item in value):
            return  # not a list of numbers (the Parameters quantity's tensors)
        values = [float(item) for item in value]
        labels = parameter_names if len(values) == len(parameter_names) else [str(i) for i in range(len(values))]
        if per_parameter:
            for label, number in zip(labels, values):
                scalars[f"{tag}{SEPARATOR}{label}"] = number
        if name == "GradNorm":
            scalars[f"{tag}{SEPARATOR}all"] = math.hypot(*values)


def _is_number(value):
    """A real number (Python, NumPy or a 0-dim tensor), not a bool."""
    if hasattr(value, "ndim") and value.ndim == 0 and hasattr(value, "item"):
        value = value.item()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _add_histogram(tag, counts, edges, histograms):
    """The histogram and its log10(1 + count) view (``<tag>/log10``)."""
    edges = torch.as_tensor(edges, dtype=torch.float64).cpu()
    counts = counts.cpu()
    histograms[tag] = (counts, edges)
    histograms[f"{tag}{SEPARATOR}log10"] = (torch.log10(1 + counts), edges)


class TensorBoardLogger(CockpitLogger):
    """Writes a cockpit's output to TensorBoard event files (see the module's docstring for the tags).

    Args:
        log_dir: The folder of the event files (TensorBoard names the run after it), or a
            ``torch.utils.tensorboard.SummaryWriter`` to write with (it stays open on
            :meth:`close`: it is the caller's).
        names (list of str, optional), per_parameter (bool, optional): See :class:`CockpitLogger`.

    Raises:
        cockpit_fast._optional.MissingDependency: An ``ImportError``, if ``log_dir`` is a folder
            and TensorBoard is not installed.
        TypeError: If ``log_dir`` is neither a folder nor a writer.
    """

    def __init__(self, log_dir, names=None, per_parameter=True):
        super().__init__(names, per_parameter)
        if isinstance(log_dir, (str, os.PathLike)):
            require("tensorboard", "tensorboard", "TensorBoardLogger", extra="demo")
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=os.fspath(log_dir))
            self._owns_writer = True
        elif hasattr(log_dir, "add_scalar") and hasattr(log_dir, "add_histogram_raw"):
            self.writer = log_dir
            self._owns_writer = False
        else:
            raise TypeError(
                f"log_dir must be a folder (str or path) or a SummaryWriter, got {type(log_dir).__name__}"
            )

    def _write(self, step, scalars, histograms):
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, (counts, edges) in histograms.items():
            centers = (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(
                tag,
                min=edges[0].item(),
                max=edges[-1].item(),
                num=counts.sum().item(),
                sum=(counts * centers).sum().item(),
                sum_squares=(counts * centers**2).sum().item(),
                bucket_limits=edges[1:].tolist(),  # TensorBoard takes each bin's right edge
                bucket_counts=counts.tolist(),
                global_step=step,
            )

    def _flush(self):
        self.writer.flush()

    def close(self):
        """Close the writer this logger made (flush one that was handed in)."""
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


class WandbLogger(CockpitLogger):
    """Logs a cockpit's output to a Weights & Biases run (see the module's docstring for the keys).

    Each tracked step is one ``run.log`` call with the step as ``cockpit/step``, the x-axis of
    every ``cockpit/*`` key (W&B's own step must grow, and Alpha of a step arrives one step
    late); histograms are ``wandb.Histogram`` s of the cockpit's counts and edges.

    Args:
        run (optional): The ``wandb`` run to log to. Defaults to the active one (``wandb.run``).
        names (list of str, optional), per_parameter (bool, optional): See :class:`CockpitLogger`.

    Raises:
        cockpit_fast._optional.MissingDependency: An ``ImportError``, if wandb is not installed.
        ValueError: If no run is given and none is active (``wandb.init()`` not called yet).
    """

    def __init__(self, run=None, names=None, per_parameter=True):
        super().__init__(names, per_parameter)
        self._wandb = require("wandb", "wandb", "WandbLogger")
        self.run = run if run is not None else self._wandb.run
        if self.run is None:
            raise ValueError("run is None and no W&B run is active: call wandb.init() first or pass run")
        self._step_key = f"{TAG_PREFIX}{SEPARATOR}step"
        self.run.define_metric(self._step_key)
        self.run.define_metric(f"{TAG_PREFIX}{SEPARATOR}*", step_metric=self._step_key)

    def _write(self, step, scalars, histograms):
        record = {self._step_key: step, **scalars}
        for tag, (counts, edges) in histograms.items():
            record[tag] = self._wandb.Histogram(np_histogram=(counts.numpy(), edges.numpy()))
        self.run.log(record)
