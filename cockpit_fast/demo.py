"""The demo run: a small CNN learns scikit-learn's handwritten digits under a cockpit.

Plain training (no cockpit) and tracked training of the same model, optimizer and batches run
one after the other, then a few steps of the same tracking with Cockpit 1.0.2 when it is
installed, so that the time per step of all three is measured on the same machine in the same
process. The run folder receives the cockpit's JSON log, its dashboard as PNG and, when
TensorBoard is installed, event files with every scalar quantity and the gradient histograms.
"""

import copy
import importlib
import math
import os
import statistics
import time
import warnings
from importlib import metadata

import torch

from cockpit_fast import BACKPACK_ON_CPU
from cockpit_fast._optional import MissingDependency, require
from cockpit_fast.utils.training import training_step

LEARNING_RATE = 0.3  # plain SGD, the optimizer all of Cockpit's quantities support
VALIDATION_FRACTION = 0.2
PARAMETER_SEPARATOR = "/"
COCKPIT_ORIGINAL = "1.0.2"  # the Cockpit release the demo compares with


class UsageError(ValueError):
    """Options that cannot make a run (the command line reports these in one line)."""


def check_dependencies():
    """Raise :class:`~cockpit_fast._optional.MissingDependency` for the first package the demo lacks."""
    require("sklearn", "scikit-learn", "the demo (its digits data set)", extra="demo")
    require("tqdm", "tqdm", "the demo", extra="demo")
    require("matplotlib", "matplotlib", "the demo's dashboard", extra="demo")
    require("backpack", "backpack-for-pytorch", "the demo's cockpit", note=BACKPACK_ON_CPU)


def load_digits_split(seed, device):
    """Scikit-learn's 8x8 digits as image tensors, split into training and validation sets.

    Returns:
        tuple: ``(train_images, train_labels, valid_images, valid_labels)`` on ``device``,
        images of shape ``(N, 1, 8, 8)`` scaled to [0, 1].
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    valid_count = int(VALIDATION_FRACTION * len(labels))
    valid, train = order[:valid_count], order[valid_count:]
    return tuple(t.to(device) for t in (images[train], labels[train], images[valid], labels[valid]))


def build_model():
    """A small CNN for 8x8 single-channel images, made of layers BackPACK supports."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


def batches(images, labels, batch_size, epochs, max_steps, seed):
    """Yield ``(epoch, inputs, targets)`` of shuffled full batches, at most ``max_steps`` of them."""
    generator = torch.Generator().manual_seed(seed)
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=generator).to(labels.device)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            if step == max_steps:
                return
            index = order[start : start + batch_size]
            yield epoch, images[index], labels[index]
            step += 1


def step_count(train_size, batch_size, epochs, max_steps):
    """Number of steps :func:`batches` yields (``max_steps`` ``None``: no cap but ``epochs``)."""
    per_epochs = epochs * (train_size // batch_size)
    return per_epochs if max_steps is None else min(max_steps, per_epochs)


def synchronize(device):
    """Wait for queued GPU work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accuracy(outputs, targets):
    """Fraction of rows of ``outputs`` whose largest logit is the target class."""
    return (outputs.argmax(dim=1) == targets).float().mean().item()


def train_plain(model, data, device):
    """Plain SGD training over ``data``; returns the seconds each step took."""
    loss_fn = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    seconds = []
    for _, inputs, targets in data:
        synchronize(device)
        start = time.perf_counter()
        training_step(model, optimizer, (inputs, targets), None, loss_fn=loss_fn)  # plain: no individual losses
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


class TensorBoardExport:
    """Writes a cockpit's output to TensorBoard: scalars as they are, histograms from their counts.

    Numbers become scalars tagged with the quantity's name; per-parameter lists become one
    scalar per parameter (``Quantity/parameter``), and GradNorm also the norm over all
    parameters (``GradNorm/all``). GradHist1d's ``hist`` and ``edges`` are handed to
    ``add_histogram_raw`` unchanged, and so is GradHist2d's marginal over the gradient axis
    (summed from its counts), so nothing is recomputed from the gradients. Most gradients sit
    in the bins around zero, whose spike flattens every other bin on TensorBoard's linear
    axis: each histogram is written a second time with log10(1 + count) per bin
    (``<tag>/log10``). Entries are written once, so the export can run again as more steps
    are tracked.
    """

    def __init__(self, logdir, parameter_names):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)
        self.parameter_names = parameter_names
        self._written = set()

    def export(self, output):
        """Write the entries of ``output`` (``{step: {name: value}}``) not written yet."""
        for step in sorted(output):
            for name, value in output[step].items():
                if (step, name) not in self._written and value is not None:
                    self._write(name, value, step)
                    self._written.add((step, name))
        self.writer.flush()

    def _write(self, name, value, step):
        """One log entry, by its kind; other entries (e.g. per-parameter 2D histograms) are left out."""
        if isinstance(value, (int, float)):
            self.writer.add_scalar(name, value, step)
        elif isinstance(value, list) and len(value) == len(self.parameter_names):
            for parameter, number in zip(self.parameter_names, value):
                self.writer.add_scalar(f"{name}{PARAMETER_SEPARATOR}{parameter}", number, step)
            if name == "GradNorm":
                self.writer.add_scalar(f"{name}{PARAMETER_SEPARATOR}all", math.hypot(*value), step)
        elif isinstance(value, dict) and name == "GradHist1d":
            self._add_histogram(name, value["hist"], value["edges"], step)
        elif isinstance(value, dict) and name == "GradHist2d":
            gradient_counts = torch.as_tensor(value["hist"]).sum(dim=1)  # bins: (gradient, parameter)
            tag = f"{name}{PARAMETER_SEPARATOR}gradients"
            self._add_histogram(tag, gradient_counts, value["edges"][0], step)

    def _add_histogram(self, tag, counts, edges, step):
        """The histogram, and its log10(1 + count) view as ``<tag>/log10``."""
        counts = torch.as_tensor(counts, dtype=torch.float64)
        edges = torch.as_tensor(edges, dtype=torch.float64)
        self._add_raw_histogram(tag, counts, edges, step)
        self._add_raw_histogram(f"{tag}{PARAMETER_SEPARATOR}log10", torch.log10(1 + counts), edges, step)

    def _add_raw_histogram(self, tag, counts, edges, step):
        """Histogram with the given bin counts; TensorBoard takes each bin's right edge."""
        centers = (edges[:-1] + edges[1:]) / 2
        total = counts.sum().item()
        self.writer.add_histogram_raw(
            tag,
            min=edges[0].item(),
            max=edges[-1].item(),
            num=total,
            sum=(counts * centers).sum().item(),
            sum_squares=(counts * centers**2).sum().item(),
            bucket_limits=edges[1:].tolist(),
            bucket_counts=counts.tolist(),
            global_step=step,
        )

    def close(self):
        self.writer.close()


def tensorboard_export(logdir, parameter_names):
    """A :class:`TensorBoardExport`, or ``None`` (with a note) when TensorBoard is not installed."""
    try:
        require("tensorboard", "tensorboard", "the demo's TensorBoard event files", extra="demo")
    except MissingDependency as error:
        print(f"Skipping the event files: {error}")
        return None
    return TensorBoardExport(logdir, parameter_names)


def evaluate(model, images, labels):
    """Mean loss and accuracy of ``model`` on a whole data set."""
    with torch.no_grad():
        outputs = model(images)
        return torch.nn.functional.cross_entropy(outputs, labels).item(), accuracy(outputs, labels)


class TrackedTraining:
    """Plain SGD on ``model`` (extended by BackPACK in place) under a cockpit of ``cockpit_package``.

    ``cockpit_package`` is ``cockpit_fast`` or Cockpit 1.0.2's ``cockpit``: both have the same
    ``Cockpit``, ``utils.schedules`` and ``utils.configuration``, so both run the very same steps.
    """

    def __init__(self, model, cockpit_package, config, track_every):
        import backpack

        configuration = importlib.import_module(f"{cockpit_package}.utils.configuration").configuration
        schedules = importlib.import_module(f"{cockpit_package}.utils.schedules")
        cockpit_class = importlib.import_module(cockpit_package).Cockpit
        self.model = backpack.extend(model)
        self.loss_fn = backpack.extend(torch.nn.CrossEntropyLoss(reduction="mean"))
        self.individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
        quantities = configuration(config, track_schedule=schedules.linear(interval=track_every))
        self.cockpit = cockpit_class(self.model.parameters(), quantities=quantities)

    def step(self, step, inputs, targets, device):
        """One tracked step; returns its seconds, the mini-batch loss and the outputs."""
        synchronize(device)
        start = time.perf_counter()
        outputs, loss, _ = training_step(
            self.model,
            self.optimizer,
            (inputs, targets),
            self.individual_loss_fn,
            loss_fn=self.loss_fn,
            cockpit=self.cockpit,
            step=step,
            quiet=True,  # torch's backward-hook notices, once per step
        )
        synchronize(device)
        return time.perf_counter() - start, loss, outputs


def train_tracked(model, data, total_steps, config, track_every, valid_set, out, device):
    """Plain SGD training under a cockpit_fast cockpit; returns the cockpit and the seconds each step took.

    Per-epoch losses and accuracies go to ``cockpit.log`` for the dashboard's performance panel;
    TensorBoard receives the new entries after every epoch, in ``<out>/tensorboard/<run>``
    (TensorBoard names a run by its folder).
    """
    from tqdm import tqdm

    training = TrackedTraining(model, "cockpit_fast", config, track_every)
    cockpit = training.cockpit
    parameter_names = [name for name, _ in training.model.named_parameters()]
    board = tensorboard_export(tensorboard_run_folder(out), parameter_names)

    seconds = []
    epoch_losses, epoch_accuracies = [], []
    progress = tqdm(total=total_steps, desc="tracked training", unit="step")

    def end_epoch(step, epoch):
        valid_loss, valid_accuracy = evaluate(training.model, *valid_set)
        cockpit.log(
            step,
            epoch,
            statistics.fmean(epoch_losses),
            valid_loss,
            None,
            statistics.fmean(epoch_accuracies),
            valid_accuracy,
            None,
            LEARNING_RATE,
        )
        epoch_losses.clear()
        epoch_accuracies.clear()
        if board is not None:
            board.export(cockpit.get_output())

    step, epoch = 0, 0
    for step, (batch_epoch, inputs, targets) in enumerate(data):
        if batch_epoch != epoch:
            end_epoch(step - 1, epoch)
            epoch = batch_epoch
        step_seconds, loss, outputs = training.step(step, inputs, targets, device)
        seconds.append(step_seconds)
        epoch_losses.append(loss.item())
        epoch_accuracies.append(accuracy(outputs, targets))
        progress.set_postfix({"loss": f"{epoch_losses[-1]:.3f}", "acc": f"{epoch_accuracies[-1]:.2f}"})
        progress.update()
    end_epoch(step, epoch)
    progress.close()
    if board is not None:
        board.close()
    return cockpit, seconds


def tensorboard_run_folder(out):
    """``<out>/tensorboard/<name of out>``: TensorBoard lists the run under the run folder's name."""
    return os.path.join(out, "tensorboard", os.path.basename(os.path.normpath(out)))


def time_original_cockpit(model, data, config, track_every, device):
    """Seconds per step of the same tracking with Cockpit 1.0.2, or the reason it cannot run."""
    try:
        version = metadata.version("cockpit-for-pytorch")
    except metadata.PackageNotFoundError:
        return None, f"Cockpit is not installed (pip install cockpit-for-pytorch=={COCKPIT_ORIGINAL} to compare)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Cockpit imports the deprecated pkg_resources
            training = TrackedTraining(model, "cockpit", config, track_every)
    except ImportError as error:  # e.g. pkg_resources, gone from setuptools 81
        return None, f"Cockpit {version} is installed but does not import ({error})"
    seconds = [training.step(step, inputs, targets, device)[0] for step, (_, inputs, targets) in enumerate(data)]
    return (seconds, f"Cockpit {version}"), None


def resolve_device(choice):
    """``torch.device`` for ``"cpu"``, ``"cuda"`` or ``"auto"`` (the GPU when there is one)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def milliseconds_per_step(seconds):
    """Mean step time in ms, leaving out the first step (warm-up) when there are others.

    The mean, not the median: with ``--track-every`` above 2 most steps are untracked, and the
    median would hide what tracking costs.
    """
    return 1000 * statistics.fmean(seconds[1:] or seconds)


def run(steps, epochs, batch_size, device, config, seed, out, track_every, compare_steps):
    """Train plainly, then under the cockpit, time Cockpit 1.0.2, write the outputs and print a summary.

    Args:
        steps (int or None): Most steps per training run (``None``: all steps of ``epochs``).
        epochs (int): Most passes over the training set.
        batch_size (int): Samples per step.
        device (str): ``"cpu"``, ``"cuda"`` or ``"auto"``.
        config (str): Cockpit configuration, ``"economy"``, ``"business"`` or ``"full"``.
        seed (int): Seed of the initial weights and of the batch order.
        out (str): Run folder.
        track_every (int): Track the quantities every this many steps.
        compare_steps (int): Steps timed with Cockpit 1.0.2 when it is installed (0: none).

    Raises:
        UsageError: If a batch is larger than the training set or smaller than 2, or ``out``
            cannot be written.
    """
    from cockpit_fast.plotter import CockpitPlotter

    device = resolve_device(device)
    train_images, train_labels, *valid_set = load_digits_split(seed, device)
    if batch_size > len(train_labels):
        raise UsageError(f"--batch-size {batch_size} is larger than the {len(train_labels)} training images")
    if batch_size < 2:
        raise UsageError("--batch-size must be at least 2: the gradient tests estimate variances over the samples")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot write the run folder {out}: {error}") from None
    total_steps = step_count(len(train_labels), batch_size, epochs, steps)
    print(
        f"Digits: {len(train_labels)} training / {len(valid_set[1])} validation images, "
        f"{total_steps} steps of {batch_size} on {device}, cockpit configuration '{config}'."
    )

    torch.manual_seed(seed)
    model = build_model().to(device)
    initial_model = copy.deepcopy(model)  # same initial weights for every run

    def data(most_steps=total_steps):
        return batches(train_images, train_labels, batch_size, epochs, most_steps, seed)

    plain_seconds = train_plain(copy.deepcopy(initial_model), data(), device)
    cockpit, tracked_seconds = train_tracked(
        model, data(), total_steps, config, track_every, valid_set, out, device
    )
    cockpit.write(os.path.join(out, "cockpit"))
    CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=out)
    _, valid_accuracy = evaluate(model, *valid_set)

    original, why_not = None, "not timed (--compare-steps 0)"
    if compare_steps > 0:
        print(f"Timing {compare_steps} steps of the same tracking with Cockpit {COCKPIT_ORIGINAL} ...")
        original, why_not = time_original_cockpit(
            copy.deepcopy(initial_model), data(compare_steps), config, track_every, device
        )
    rows = [("plain (no cockpit)", plain_seconds), (f"cockpit_fast ('{config}')", tracked_seconds)]
    note = f"Cockpit {COCKPIT_ORIGINAL}: {why_not}"
    if original is not None:
        seconds, name = original
        rows.append((f"{name} ('{config}', {len(seconds)} steps)", seconds))
        ratio = milliseconds_per_step(seconds) / milliseconds_per_step(tracked_seconds)
        note = f"{name} takes {ratio:.1f}x the time of cockpit_fast per step"
    print_summary(rows, note, track_every, valid_accuracy, out)


def print_summary(rows, note, track_every, valid_accuracy, out):
    """Table of the time per step of each run against plain training, a note, and where the outputs are.

    Args:
        rows (list): ``(label, seconds of each step)``, plain training first.
        note (str): The comparison with Cockpit 1.0.2, or why there is none.
    """
    plain = milliseconds_per_step(rows[0][1])
    table = [("training", "ms / step", "vs plain")]
    for label, seconds in rows:
        milliseconds = milliseconds_per_step(seconds)
        table.append((label, f"{milliseconds:.2f}", f"{milliseconds / plain:.1f}x"))
    widths = [max(len(row[column]) for row in table) for column in range(3)]
    print()
    for row in table:
        print(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}")
    every = "every step" if track_every == 1 else f"every {track_every} steps"
    print(f"  (tracking {every}; mean over the steps, first step left out)")
    print(f"  {note}")
    print(f"  validation accuracy after tracked training: {valid_accuracy:.3f}")
    print()
    outputs = [
        ("log", os.path.join(out, "cockpit.json")),
        ("dashboard", os.path.join(out, "cockpit__primary.png")),
    ]
    tensorboard_dir = os.path.join(out, "tensorboard")
    if os.path.isdir(tensorboard_dir):
        run_name = os.path.basename(tensorboard_run_folder(out))
        outputs.append(("tensorboard", f"tensorboard --logdir {tensorboard_dir}  (the run '{run_name}')"))
    for label, where in outputs:
        print(f"  {label + ':':<12} {where}")
