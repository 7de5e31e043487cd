"""The demo run: a small CNN learns scikit-learn's handwritten digits under a cockpit.

Plain training (no cockpit) and tracked training of the same model, optimizer and batches take
their steps in turn, and so does the same tracking with Cockpit 1.0.2 for the first few steps
when it is installed: all three are timed in one process, under the same load, with a fixed
number of threads. The summary gives each one's median time per step with its quartiles, and
the median and quartiles of the step-by-step ratios (a slow spell of the machine slows the
steps on both sides of a ratio); it warns when the machine was busy while timing, as then
another run may tell another story. The run folder receives the cockpit's JSON log, its
dashboard as PNG and, when TensorBoard is installed, event files written by
:class:`cockpit_fast.loggers.TensorBoardLogger`.
"""

import copy
import importlib
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
COCKPIT_ORIGINAL = "1.0.2"  # the Cockpit release the demo compares with
BUSY_SPREAD = 0.25
"""Distance between the quartiles of cockpit_fast's step-by-step ratio to plain steps, relative to
its median, above which the demo warns that the machine was busy (two default runs on 2 cores
shared with other jobs: 9% and 10%, while the quartiles of the step times were up to 36% apart)."""


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


def timed(device, function):
    """``(seconds, function())``: wall-clock time of ``function()``, queued GPU work included."""
    synchronize(device)
    start = time.perf_counter()
    result = function()
    synchronize(device)
    return time.perf_counter() - start, result


def accuracy(outputs, targets):
    """Fraction of rows of ``outputs`` whose largest logit is the target class."""
    return (outputs.argmax(dim=1) == targets).float().mean().item()


def evaluate(model, images, labels):
    """Mean loss and accuracy of ``model`` on a whole data set."""
    with torch.no_grad():
        outputs = model(images)
        return torch.nn.functional.cross_entropy(outputs, labels).item(), accuracy(outputs, labels)


class PlainTraining:
    """Plain SGD on ``model`` (a ``Sequential`` of layers), no cockpit and no individual losses.

    The forward pass calls each layer's ``forward`` itself: a cockpit_fast cockpit watches every
    module call of the process while it lives (global forward hooks), which would bill the plain
    steps taken in turn with the tracked ones about a tenth more on the demo's CNN.
    """

    def __init__(self, model):
        self.model = model
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)

    def _forward(self, inputs):
        for layer in self.model:
            inputs = layer.forward(inputs)
        return inputs

    def step(self, step, inputs, targets, device):
        """One plain step; returns its seconds."""
        seconds, _ = timed(
            device, lambda: training_step(self._forward, self.optimizer, (inputs, targets), None, loss_fn=self.loss_fn)
        )
        return seconds


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
        seconds, (outputs, loss, _) = timed(
            device,
            lambda: training_step(
                self.model,
                self.optimizer,
                (inputs, targets),
                self.individual_loss_fn,
                loss_fn=self.loss_fn,
                cockpit=self.cockpit,
                step=step,
                quiet=True,  # torch's backward-hook notices, once per step
            ),
        )
        return seconds, loss, outputs


def original_training(model, config, track_every):
    """The same tracking with Cockpit 1.0.2 as ``(training, name)``, or ``(None, why it cannot run)``."""
    try:
        version = metadata.version("cockpit-for-pytorch")
    except metadata.PackageNotFoundError:
        return None, f"Cockpit is not installed (pip install cockpit-for-pytorch=={COCKPIT_ORIGINAL} to compare)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Cockpit imports the deprecated pkg_resources
            return TrackedTraining(model, "cockpit", config, track_every), f"Cockpit {version}"
    except ImportError as error:  # e.g. pkg_resources, gone from setuptools 81
        return None, f"Cockpit {version} is installed but does not import ({error})"


def tensorboard_export(logdir, parameter_names):
    """A :class:`~cockpit_fast.loggers.TensorBoardLogger`, or ``None`` (with a note) when
    TensorBoard is not installed."""
    from cockpit_fast.loggers import TensorBoardLogger

    try:
        require("tensorboard", "tensorboard", "the demo's TensorBoard event files", extra="demo")
    except MissingDependency as error:
        print(f"Skipping the event files: {error}")
        return None
    return TensorBoardLogger(logdir, names=parameter_names)


def tensorboard_run_folder(out):
    """``<out>/tensorboard/<name of out>``: TensorBoard lists the run under the run folder's name."""
    return os.path.join(out, "tensorboard", os.path.basename(os.path.normpath(out)))


def train_in_turn(plain, tracked, original, compare_steps, data, total_steps, valid_set, out, device):
    """Each step of ``data`` with ``plain``, then ``tracked``, then (the first ``compare_steps``)
    ``original``, so that all three are timed under the same load.

    Per-epoch losses and accuracies of the tracked training go to its cockpit's ``log`` for the
    dashboard's performance panel; TensorBoard receives the new entries after every epoch, in
    ``<out>/tensorboard/<run>`` (TensorBoard names a run by its folder).

    Returns:
        tuple: The seconds of each step of ``plain``, ``tracked`` and ``original`` (empty
        without it).
    """
    from tqdm import tqdm

    cockpit = tracked.cockpit
    parameter_names = [name for name, _ in tracked.model.named_parameters()]
    board = tensorboard_export(tensorboard_run_folder(out), parameter_names)

    plain_seconds, tracked_seconds, original_seconds = [], [], []
    epoch_losses, epoch_accuracies = [], []
    progress = tqdm(total=total_steps, desc="training", unit="step")

    def end_epoch(step, epoch):
        valid_loss, valid_accuracy = evaluate(tracked.model, *valid_set)
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
            board.log(cockpit)

    step, epoch = 0, 0
    for step, (batch_epoch, inputs, targets) in enumerate(data):
        if batch_epoch != epoch:
            end_epoch(step - 1, epoch)
            epoch = batch_epoch
        plain_seconds.append(plain.step(step, inputs, targets, device))
        step_seconds, loss, outputs = tracked.step(step, inputs, targets, device)
        tracked_seconds.append(step_seconds)
        if original is not None and step < compare_steps:
            original_seconds.append(original.step(step, inputs, targets, device)[0])
        epoch_losses.append(loss.item())
        epoch_accuracies.append(accuracy(outputs, targets))
        progress.set_postfix({"loss": f"{epoch_losses[-1]:.3f}", "acc": f"{epoch_accuracies[-1]:.2f}"})
        progress.update()
    end_epoch(step, epoch)
    progress.close()
    if board is not None:
        board.close()
    return plain_seconds, tracked_seconds, original_seconds


def resolve_device(choice):
    """``torch.device`` for ``"cpu"``, ``"cuda"`` or ``"auto"`` (the GPU when there is one)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def block_times(seconds, track_every):
    """Mean step time of each block of ``track_every`` consecutive steps, whole blocks only (all
    steps as one block when there is none).

    A block holds one tracked step: its mean is the cost per step of tracking every
    ``track_every`` steps, which the median over single steps would hide (most are untracked).
    """
    whole = len(seconds) - len(seconds) % track_every
    blocks = [seconds[start : start + track_every] for start in range(0, whole, track_every)] or [seconds]
    return [statistics.fmean(block) for block in blocks]


def steady(values):
    """``values`` without the first (the warm-up) when there are others."""
    return values[1:] or values


def quartiles(values):
    """``(first quartile, median, third quartile)``, interpolated between the sorted values as
    NumPy's percentiles are."""
    if len(values) == 1:
        return (values[0],) * 3
    return tuple(statistics.quantiles(values, n=4, method="inclusive"))


def paired_ratios(seconds, reference, track_every):
    """Step-by-step (block-by-block) ratios of ``seconds`` to ``reference``, taken in turn with
    them, over the blocks both have, the warm-up left out."""
    return steady([a / b for a, b in zip(block_times(seconds, track_every), block_times(reference, track_every))])


def load_average():
    """The 1-minute load average, or ``None`` where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows; an unreadable /proc
        return None


def usable_cores():
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows
        return os.cpu_count() or 1


def busy_warning(loads, cores, ratio_quartiles):
    """The line warning that the machine was busy while timing, or ``None``; it says why.

    Busy: a 1-minute load average (``loads``: before and after timing) above the ``cores`` (more
    runnable threads than cores, so the timed ones waited), or quartiles of cockpit_fast's ratio
    to plain steps further apart than :data:`BUSY_SPREAD` of its median.
    """
    reasons = []
    loaded = [
        f"{load:.1f} {when}" for load, when in zip(loads, ("before", "after")) if load is not None and load > cores
    ]
    if loaded:
        reasons.append(f"load average {', '.join(loaded)}, on {cores} cores")
    low, median, high = ratio_quartiles
    spread = (high - low) / median
    if spread > BUSY_SPREAD:
        reasons.append(f"cockpit_fast/plain quartiles {spread:.0%} of the median apart, above {BUSY_SPREAD:.0%}")
    if not reasons:
        return None
    return f"warning: the machine was busy while timing ({'; '.join(reasons)}): another run may differ"


def run(steps, epochs, batch_size, device, config, seed, out, track_every, compare_steps, threads=1):
    """Train plainly, under the cockpit and (a few steps) under Cockpit 1.0.2 in turn, write the
    outputs and print a summary.

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
        threads (int, optional): Threads of torch's CPU operations while the demo runs
            (``torch.set_num_threads``), fixed so that runs compare. Defaults to 1.

    Raises:
        UsageError: If a batch is larger than the training set or smaller than 2, ``threads``
            is below 1, or ``out`` cannot be written.
    """
    if threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _run(steps, epochs, batch_size, device, config, seed, out, track_every, compare_steps, threads)
    finally:
        torch.set_num_threads(previous_threads)


def _run(steps, epochs, batch_size, device, config, seed, out, track_every, compare_steps, threads):
    from cockpit_fast.plotter import CockpitPlotter

    device = resolve_device(device)
    train_images, train_labels, *valid_set = load_digits_split(seed, device)
    if batch_size > len(train_labels):
        raise UsageError(f"--batch-size {batch_size} is larger than the {len(train_labels)} training images")
    if batch_size < 2:
        raise UsageError("--batch-size must be at least 2: the gradient tests estimate variances over the samples")
    try:
        os.makedirs(out, exist_ok=True)
    except FileExistsError:  # (a file of that name, or on the way to it)
        raise UsageError(f"cannot write the run folder {out}: a file is there, or on the way to it") from None
    except OSError as error:
        raise UsageError(f"cannot write the run folder {out}: {error.strerror or error}") from None
    total_steps = step_count(len(train_labels), batch_size, epochs, steps)
    print(
        f"Digits: {len(train_labels)} training / {len(valid_set[1])} validation images, "
        f"{total_steps} steps of {batch_size} on {device} with {threads} thread{'s' if threads > 1 else ''}, "
        f"cockpit configuration '{config}'."
    )

    torch.manual_seed(seed)
    model = build_model().to(device)
    initial_model = copy.deepcopy(model)  # same initial weights for every run
    plain = PlainTraining(copy.deepcopy(initial_model))
    tracked = TrackedTraining(model, "cockpit_fast", config, track_every)
    original, original_name = None, "not timed (--compare-steps 0)"
    if compare_steps > 0:
        original, original_name = original_training(copy.deepcopy(initial_model), config, track_every)
        if original is not None:
            print(f"Timing {_counted(min(compare_steps, total_steps), 'step')} with {original_name} too, in turn with the others.")

    loads = [load_average()]
    data = batches(train_images, train_labels, batch_size, epochs, total_steps, seed)
    plain_seconds, tracked_seconds, original_seconds = train_in_turn(
        plain, tracked, original, compare_steps, data, total_steps, valid_set, out, device
    )
    loads.append(load_average())

    cockpit = tracked.cockpit
    cockpit.write(os.path.join(out, "cockpit"))
    CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=out)
    _, valid_accuracy = evaluate(model, *valid_set)

    runs = [("plain (no cockpit)", plain_seconds), (f"cockpit_fast ('{config}')", tracked_seconds)]
    if original is not None:
        runs.append((f"{original_name} ('{config}', {_counted(len(original_seconds), 'step')})", original_seconds))
    table = timing_table(runs, track_every)
    fast_ratio = table[1][2]
    note = f"Cockpit {COCKPIT_ORIGINAL}: {original_name}"
    if original is not None:
        note = f"{original_name} takes {compared_to(table[2][2], fast_ratio)} the time of cockpit_fast per step"
    busy = busy_warning(loads, usable_cores(), fast_ratio)
    print_summary(table, len(block_times(plain_seconds, track_every)), track_every, note, busy, valid_accuracy, out)


def timing_table(runs, track_every):
    """``(label, quartiles of the ms per step, quartiles of the ratio to plain steps)`` of each run.

    Args:
        runs (list): ``(label, seconds of each step)``, plain training first, in the order they ran.
    """
    plain_seconds = runs[0][1]
    return [
        (
            label,
            tuple(1000 * value for value in quartiles(steady(block_times(seconds, track_every)))),
            quartiles(paired_ratios(seconds, plain_seconds, track_every)),
        )
        for label, seconds in runs
    ]


def compared_to(ratio, reference_ratio):
    """``"<median>x (<low>-<high>)"``: one run's time over another's, from the quartiles of their
    ratios to plain steps (the widest quotients of the quartiles as the range).

    Cockpit 1.0.2 runs a few steps only: each run against the plain steps it ran in turn with,
    and the two medians divided, takes cockpit_fast's median over all its steps, not over those
    few (two demo runs on one machine paired step by step gave 1.8x and 2.5x, this 1.9x and 2.1x).
    """
    low, median, high = ratio
    reference_low, reference_median, reference_high = reference_ratio
    return f"{median / reference_median:.1f}x ({low / reference_high:.1f}-{high / reference_low:.1f})"


def print_summary(table, block_count, track_every, note, busy, valid_accuracy, out):
    """The :func:`timing_table`, a note, the busy-machine warning if any, and where the outputs are.

    Args:
        block_count (int): Blocks of ``track_every`` steps timed, the first (warm-up) included.
        note (str): The comparison with Cockpit 1.0.2, or why there is none.
        busy (str or None): :func:`busy_warning`'s line.
    """
    cells = [("training", "ms / step", "(quartiles)", "vs plain", "(quartiles)")]
    for index, (label, (low, median, high), (ratio_low, ratio, ratio_high)) in enumerate(table):
        ratio_spread = f"({ratio_low:.1f}-{ratio_high:.1f})" if index else ""  # plain against itself: 1
        cells.append((label, f"{median:.2f}", f"({low:.2f}-{high:.2f})", f"{ratio:.1f}x", ratio_spread))
    widths = [max(len(row[column]) for row in cells) for column in range(5)]
    print()
    for row in cells:
        aligned = [f"{row[0]:<{widths[0]}}"] + [f"{cell:>{width}}" for cell, width in zip(row[1:4], widths[1:4])]
        print("  " + "  ".join(aligned + [row[4]]).rstrip())
    warm_up = block_count > 1  # left out
    count = block_count - warm_up
    unit = _counted(count, "step") if track_every == 1 else f"{_counted(count, 'block')} of {track_every} steps (one tracked)"
    print(f"  (medians and quartiles of {unit}, run in turn{', the first left out' if warm_up else ''})")
    print(f"  {note}")
    if busy is not None:
        print(f"  {busy}")
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


def _counted(count, noun):
    """``"1 step"``, ``"3 steps"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
