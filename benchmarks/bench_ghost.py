"""Closed forms against materialised per-sample gradients: step time and peak memory.

For a step tracking GradHist1d, GradHist2d or the ``economy`` configuration on one of
``bench_step.py``'s problems (``--model``: the MLP 784-256-10 with N = 128 by default, the small
CNN, or GPT-2), side by side in one run: a plain step, Cockpit 1.0.2 (where it can run),
cockpit_fast with every statistic from formed per-sample gradients (``per_sample_route=
"grad_batch"``), and cockpit_fast's default route. Times are ms per step, the best of ``--repeats`` interleaved runs (as in
``bench_step.py``). Peak memory is the growth of the peak resident set size over a few steps,
measured in a fresh process per variant from just before the model is built (so it holds
model, data, activations, gradients and what tracking adds; on CPU the allocator returns large
blocks to the system, so the peak RSS follows the live tensors).

Usage: ``python benchmarks/bench_ghost.py [--quick] [--model mlp|cnn|gpt2] [--only CASE ...]``
"""

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from bench_step import best_times, make_quantities, time_run  # noqa: E402

import cockpit_fast  # noqa: E402
from cockpit_fast import quantities as fast_quantities  # noqa: E402
from cockpit_fast.cockpit import Cockpit as FastCockpit  # noqa: E402
from cockpit_fast.utils import configuration as fast_configuration  # noqa: E402
from cockpit_fast.utils import schedules as fast_schedules  # noqa: E402

CASES = ["GradHist1d", "GradHist2d", "economy"]
VARIANTS = ["plain", "cockpit", "materialised", "factors"]


def factory(variant, case):
    """The cockpit of ``variant`` tracking ``case`` (None: a plain step)."""
    if variant == "plain":
        return None
    if variant == "cockpit":
        import cockpit
        from cockpit.utils import configuration, schedules

        return lambda p: cockpit.Cockpit(p, make_quantities(case, cockpit.quantities, configuration, schedules))
    route = "grad_batch" if variant == "materialised" else "auto"
    modules = (fast_quantities, fast_configuration, fast_schedules)
    return lambda p: FastCockpit(p, make_quantities(case, *modules), per_sample_route=route)


def peak_growth_mib(variant, case, model):
    """Peak RSS growth (MiB) over a few steps of ``variant``, measured in a fresh process."""
    child = subprocess.run(
        [sys.executable, __file__, "--memory-of", variant, case, model], capture_output=True, text=True, check=True
    )
    return float(child.stdout.strip().splitlines()[-1])


def _status_kib(field):
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: peak resident)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


_A_MODULE = torch.nn.Identity()


def next_forward_starts():
    """A module call, as the next step's forward pass starts with one: the work a tracked step
    leaves to it (Alpha's projection of the individual gradients it keeps with Adam) then counts
    in that step, not in whichever step of an interleaved benchmark runs next."""
    _A_MODULE(None)


def measure_memory_here(variant, case, model):
    warnings.simplefilter("ignore")
    make = factory(variant, case)  # imports done before the baseline
    if model == "gpt2":
        import transformers  # noqa: F401  (imported before the baseline too)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak (VmHWM) to the current resident size (Linux >= 4.0)
    before = _status_kib("VmRSS")
    time_run(model, make, steps=3)
    print((_status_kib("VmHWM") - before) / 1024)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--only", nargs="+", choices=CASES, help="cases to run; default all")
    parser.add_argument("--model", choices=["mlp", "cnn", "gpt2"], default="mlp")
    parser.add_argument("--memory-of", nargs=3, metavar=("VARIANT", "CASE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        return measure_memory_here(*args.memory_of)
    steps, repeats = (3, 1) if args.quick else (10, 3)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused ops: {cockpit_fast.has_extension()}")
    print(f"model {args.model}; {steps} steps per run, best of {repeats}; peak RSS growth over model set-up and 3 steps\n")
    header = f"{'case':11} {'variant':13} {'ms/step':>8} {'x plain':>8} {'cockpit/this':>13} {'peak MiB':>9} {'x plain':>8}"
    print(header)
    print("-" * len(header))
    # Cockpit 1.0.2 cannot run on GPT-2 (layers BackPACK does not know).
    variants = [v for v in VARIANTS if not (args.model == "gpt2" and v == "cockpit")]
    for case in args.only or CASES:
        times = best_times(repeats, args.model, [factory(v, case) for v in variants], steps)
        memory = [peak_growth_mib(v, case, args.model) for v in variants]
        cockpit_seconds = dict(zip(variants, times)).get("cockpit")
        for variant, seconds, mib in zip(variants, times, memory):
            versus = f"{cockpit_seconds / seconds:12.1f}x" if cockpit_seconds else f"{'-':>13}"
            print(
                f"{case:11} {variant:13} {1e3 * seconds:8.2f} {seconds / times[0]:8.2f} {versus}"
                f" {mib:9.1f} {mib / memory[0]:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
