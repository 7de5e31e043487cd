"""Command line of cockpit_fast: ``cockpit-fast`` (or ``python -m cockpit_fast``) ``{demo,plot,bench,info}``.

Every error is one line on stderr, ``<command>: error: <what>``, never a traceback: exit code 2
for bad options (a missing or malformed log, an output that cannot be written, CUDA asked for
without a GPU), 1 for what the machine lacks (a package that is not installed, the benchmarks
outside a source checkout), a failed benchmark or any other file-system error.
"""

import argparse
import functools
import os
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

from cockpit_fast import __version__
from cockpit_fast._optional import MissingDependency, require

REPOSITORY = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = REPOSITORY / "benchmarks"  # present in a repository checkout only
BENCHMARKS = ("bench_ops.py", "bench_step.py", "bench_gradient_metrics.py")
DESCRIPTION = "The command line of cockpit_fast: a demo run, the dashboard of a log, benchmarks, versions."
CONFIGURATIONS = ("economy", "business", "full")
DEFAULT_EPOCHS = 8
DEMO_DESCRIPTION = """\
Trains a small CNN on scikit-learn's 8x8 digits (bundled, nothing is downloaded) from the same
weights plainly, under a cockpit_fast cockpit tracking the --config quantities and (a few steps)
under Cockpit 1.0.2 when it is installed, the steps timed in turn on --threads threads, and
prints the median time per step of each with its spread, and a warning when the machine was busy. The run folder (--out) receives the cockpit's log
(cockpit.json), its dashboard (cockpit__primary.png) and, with TensorBoard installed, event
files (tensorboard/)."""


class OneLineParser(argparse.ArgumentParser):
    """Argument parser whose errors are one line on stderr, prefixed by the command's name."""

    def __init__(self, *args, command=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command or self.prog  # subcommands' parsers report under the command's name

    def error(self, message):
        self.fail(message, status=2)

    def fail(self, message, status=1):
        """End with ``<command>: error: <message>`` on stderr and exit code ``status``."""
        self.exit(status, f"{self.command}: error: {message}\n")

    def warn(self, message):
        """``<command>: warning: <message>`` on stderr."""
        print(f"{self.command}: warning: {message}", file=sys.stderr)


def positive_int(text):
    """argparse type: an integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text):
    """argparse type: an integer of at least 0."""
    return _int_at_least(text, 0, "an integer of at least 0")


def _int_at_least(text, least, expected):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def os_error_reason(error, with_file=False):
    """An ``OSError``'s reason without errno's number, and the file it names if ``with_file``."""
    reason = error.strerror or str(error)
    return f"{reason}: {error.filename}" if with_file and error.filename is not None else reason


def _file_on_the_way(path):
    """The nearest folder of ``path`` that is a file."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isfile(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def default_run_folder():
    """``runs/demo-<timestamp>``, so that runs do not overwrite each other."""
    from datetime import datetime

    return os.path.join("runs", "demo-" + datetime.now().strftime("%Y%m%d-%H%M%S"))


def build_parser(prog="cockpit-fast"):
    """The parser of all commands and their options."""
    parser = OneLineParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"cockpit_fast {__version__}")
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        parser_class=functools.partial(OneLineParser, command=prog),
    )

    demo = commands.add_parser(
        "demo",
        help="train a small CNN under a cockpit; compare with plain training and Cockpit 1.0.2",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--steps", type=positive_int, default=None, help="most training steps (default: all of --epochs)"
    )
    demo.add_argument(
        "--epochs", type=positive_int, default=DEFAULT_EPOCHS, help=f"passes over the data (default: {DEFAULT_EPOCHS})"
    )
    demo.add_argument("--batch-size", type=positive_int, default=64, help="samples per step (default: 64)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: the GPU if any")
    demo.add_argument(
        "--config",
        choices=CONFIGURATIONS,
        default="economy",
        help="quantities to track: Cockpit's configurations, cheapest first (default: economy)",
    )
    demo.add_argument("--track-every", type=positive_int, default=1, help="track every N steps (default: 1)")
    demo.add_argument(
        "--compare-steps",
        type=non_negative_int,
        default=10,
        help="steps timed with Cockpit 1.0.2 when installed; 0 skips them (default: 10)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and batch order (default: 0)")
    demo.add_argument("--threads", type=positive_int, default=1, help="torch threads while timing (default: 1)")
    demo.add_argument("--out", default=None, help="run folder (default: runs/demo-<timestamp>)")

    plot = commands.add_parser("plot", help="draw the dashboard of a written cockpit log")
    plot.add_argument("log", help="JSON log written by Cockpit.write (cockpit_fast or Cockpit 1.0.2)")
    plot.add_argument("-o", "--output", default=None, help="image file (default: the log's name with .png)")

    bench = commands.add_parser("bench", help="run the benchmark scripts of a source checkout")
    bench.add_argument("--quick", action="store_true", help="short runs (passed on to every script)")

    commands.add_parser("info", help="versions, extension build and device")
    return parser


def run_demo(args, parser):
    """Run :func:`cockpit_fast.demo.run` with the parsed options."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available")
    from cockpit_fast import demo

    demo.check_dependencies()
    try:
        demo.run(
            steps=args.steps,
            epochs=args.epochs,
            batch_size=args.batch_size,
            device=args.device,
            config=args.config,
            seed=args.seed,
            out=args.out or default_run_folder(),
            track_every=args.track_every,
            compare_steps=args.compare_steps,
            threads=args.threads,
        )
    except demo.UsageError as error:
        parser.error(str(error))
    return 0


def run_plot(args, parser):
    """Draw the dashboard of ``args.log`` into ``args.output``, in the format its suffix names."""
    if not os.path.isfile(args.log) and os.path.isfile(args.log + ".json"):
        args.log += ".json"  # (the name Cockpit.write and logpath take, as the plotter reads it)
    if os.path.isdir(args.log):
        parser.error(f"{args.log} is a directory: name the log file in it (a .json file)")
    if not os.path.isfile(args.log):
        parser.error(f"no such log file: {args.log}")
    if os.path.getsize(args.log) == 0:
        parser.error(f"the log {args.log} is empty")
    output = args.output or os.path.splitext(args.log)[0] + ".png"
    image_format = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    Figure = require("matplotlib.figure", "matplotlib", "plot", extra="plot").Figure
    from cockpit_fast.plotter import CockpitPlotter

    # Checked before the dashboard is drawn, not after.
    formats = Figure().canvas.get_supported_filetypes()
    if image_format not in formats:
        parser.error(f"cannot save a dashboard as .{image_format}: use one of {sorted(formats)}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    except FileExistsError:  # (a file where a folder of the path should be)
        parser.error(f"cannot write {output}: {_file_on_the_way(output)} is a file, not a folder")
    except OSError as error:
        parser.error(f"cannot write {output}: {os_error_reason(error)}")
    plotter = CockpitPlotter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plotter.plot(args.log, show_plot=False)
        except OSError as error:
            parser.error(f"cannot read the log {args.log}: {os_error_reason(error)}")
        # What a malformed log raises (json's errors are ValueErrors).
        except (ValueError, TypeError, AttributeError, LookupError, ArithmeticError) as error:
            parser.error(f"cannot read the log {args.log}: {error}")
    for warning in caught:
        parser.warn(str(warning.message))
    try:
        plotter.save_figure(plotter.fig, output, format=image_format)
    except OSError as error:
        parser.error(f"cannot write {output}: {os_error_reason(error)}")
    print(f"Dashboard saved in {output}")
    return 0


def run_bench(args, parser):
    """Run each benchmark script of the source checkout; exit code 1 if there is none or any failed."""
    scripts = [BENCHMARKS_DIR / name for name in BENCHMARKS if (BENCHMARKS_DIR / name).is_file()]
    if not scripts:
        parser.fail(
            "the benchmarks live in the source repository, not in the installed package: "
            f"run `python -m cockpit_fast bench` in a checkout (no {BENCHMARKS_DIR})"
        )
    env = dict(os.environ)
    # The scripts import cockpit_fast: make this copy importable from the benchmark folder too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    failed = []
    for script in scripts:
        print(f"== {script.name} ==", flush=True)
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if subprocess.run(command, env=env).returncode != 0:
            failed.append(script.name)
        print(flush=True)
    if failed:
        parser.fail(f"benchmarks failed: {', '.join(failed)}")
    return 0


def installed_version(distribution):
    """Version of an installed distribution, or ``"not installed"``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_info(args, parser):
    """Print versions, whether the extension (and its CUDA kernels) is built, and the device."""
    import torch

    import cockpit_fast
    from cockpit_fast.demo import resolve_device

    rows = [
        ("cockpit_fast", cockpit_fast.__version__),
        ("torch", torch.__version__),
        ("extension built", "yes" if cockpit_fast.has_extension() else "no (pure-torch reference ops)"),
        ("CUDA kernels", "yes" if cockpit_fast.has_cuda_kernels() else "no"),
        ("device", str(resolve_device("auto"))),
        ("backpack-for-pytorch", installed_version("backpack-for-pytorch")),
        ("cockpit-for-pytorch", installed_version("cockpit-for-pytorch")),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label + ':':<{width + 1}} {value}")
    return 0


COMMANDS = {"demo": run_demo, "plot": run_plot, "bench": run_bench, "info": run_info}


def main(argv=None, prog="cockpit-fast"):
    """Parse ``argv`` (default: the process's arguments) and run the command; returns the exit code."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args, parser)
    except MissingDependency as error:
        parser.fail(str(error))
    except OSError as error:  # the file system's other refusals (a full disk, a file where a folder goes)
        parser.fail(os_error_reason(error, with_file=True))
