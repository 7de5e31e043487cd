"""Command line of cockpit_fast: ``python -m cockpit_fast {demo,plot,bench,info}``.

User errors (bad options, a missing log, CUDA asked for without a GPU) end with one line on
stderr and exit code 2, never with a traceback.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = REPOSITORY / "benchmarks"  # present in a repository checkout only
BENCHMARKS = ("bench_ops.py", "bench_step.py", "bench_gradient_metrics.py")
CONFIGURATIONS = ("economy", "business", "full")


class OneLineParser(argparse.ArgumentParser):
    """Argument parser whose errors are a single line on stderr (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def default_run_folder():
    """``runs/demo-<timestamp>``, so that runs do not overwrite each other."""
    from datetime import datetime

    return os.path.join("runs", "demo-" + datetime.now().strftime("%Y%m%d-%H%M%S"))


def build_parser():
    """The parser of all commands and their options."""
    parser = OneLineParser(prog="python -m cockpit_fast", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="train a small CNN on the digits data set under a cockpit")
    demo.add_argument("--steps", type=positive_int, default=200, help="most training steps (default: 200)")
    demo.add_argument("--epochs", type=positive_int, default=8, help="most epochs (default: 8)")
    demo.add_argument("--batch-size", type=positive_int, default=64, help="samples per step (default: 64)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: the GPU if any")
    demo.add_argument(
        "--config", choices=CONFIGURATIONS, default="full", help="quantities to track (default: full)"
    )
    demo.add_argument("--track-every", type=positive_int, default=1, help="track every N steps (default: 1)")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and batch order (default: 0)")
    demo.add_argument("--out", default=None, help="run folder (default: runs/demo-<timestamp>)")

    plot = commands.add_parser("plot", help="draw the dashboard of a written cockpit log")
    plot.add_argument("log", help="JSON log written by Cockpit.write (cockpit_fast or Cockpit 1.0.2)")
    plot.add_argument("-o", "--output", default=None, help="image file (default: the log's name with .png)")

    bench = commands.add_parser("bench", help="run the repository's benchmark scripts")
    bench.add_argument("--quick", action="store_true", help="short runs (passed on to every script)")

    commands.add_parser("info", help="versions, extension build and device")
    return parser


def run_demo(args, parser):
    """Run :func:`cockpit_fast.demo.run` with the parsed options."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available")
    from cockpit_fast import demo

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
        )
    except demo.UsageError as error:
        parser.error(str(error))
    return 0


def run_plot(args, parser):
    """Draw the dashboard of ``args.log`` into ``args.output``, in the format its suffix names."""
    if not os.path.isfile(args.log):
        parser.error(f"no such log file: {args.log}")
    output = args.output or os.path.splitext(args.log)[0] + ".png"
    image_format = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    from matplotlib.figure import Figure

    from cockpit_fast.plotter import CockpitPlotter

    # Checked before the dashboard is drawn, not after.
    formats = Figure().canvas.get_supported_filetypes()
    if image_format not in formats:
        parser.error(f"cannot save a dashboard as .{image_format}: use one of {sorted(formats)}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    except OSError as error:
        parser.error(f"cannot write {output}: {error}")
    # The plotter saves as <savedir>/<savename>__primary.<format>: save in a scratch folder, then move.
    with tempfile.TemporaryDirectory() as scratch:
        try:
            CockpitPlotter().plot(
                args.log,
                show_plot=False,
                save_plot=True,
                savedir=scratch,
                savefig_kwargs={"format": image_format},
            )
        except (ValueError, TypeError, AttributeError, KeyError) as error:  # json's errors are ValueErrors
            parser.error(f"cannot read the log {args.log}: {error}")
        shutil.move(os.path.join(scratch, f"cockpit__primary.{image_format}"), output)
    print(f"Dashboard saved in {output}")
    return 0


def run_bench(args, parser):
    """Run each benchmark script present in the repository; exit code 1 if none is or any failed."""
    scripts = [BENCHMARKS_DIR / name for name in BENCHMARKS if (BENCHMARKS_DIR / name).is_file()]
    if not scripts:
        print(
            f"No benchmark scripts in {BENCHMARKS_DIR}: they come with the repository checkout.",
            file=sys.stderr,
        )
        return 1
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
        print(f"Failed: {', '.join(failed)}", file=sys.stderr)
        return 1
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


def main(argv=None):
    """Parse ``argv`` (default: the process's arguments) and run the command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args, parser)
