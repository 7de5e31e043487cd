"""Time of one training step: plain, under Cockpit 1.0.2, and under cockpit_fast, side by side.

For every quantity alone and for the ``economy`` configuration, on an MLP 784-256-10 (N=128),
a small CNN (N=64) and a Hugging Face GPT-2 built from a config (4 layers, width 128, 4 heads,
random weights; N=16 sequences of T=64 tokens), which Cockpit 1.0.2 cannot track. A timed run is ``--steps`` steps plus the final ``get_output()``
(cockpit_fast converts results there, Cockpit during the step), divided by the steps; each
variant's best of ``--repeats`` runs is reported, the three variants interleaved so that a
change in machine load hits them alike.

On CUDA (``--device cuda``) the steps are timed with the device synchronised at both ends;
``--gpt2-size 124m`` takes GPT-2's own size (12 layers, width 768, 12 heads, T=1024, N=8 sequences)
and ``--bf16`` runs every step under bf16 autocast.

Curvature quantities on GPT-2 are refused (BackPACK does not know its Conv1D): their rows say
so. ``--quick`` runs fewer steps, and GPT-2 for ``economy`` alone.

Usage: ``python benchmarks/bench_step.py [--quick] [--model mlp|cnn|gpt2] [--only NAME ...]
[--device cpu|cuda] [--gpt2-size small|124m] [--bf16]``
"""

import contextlib

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from backpack import extend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' GPT-2
import cockpit_fast  # noqa: E402
from cockpit_fast import quantities as fast_quantities  # noqa: E402
from cockpit_fast.cockpit import Cockpit as FastCockpit  # noqa: E402
from cockpit_fast.utils import configuration as fast_configuration  # noqa: E402
from cockpit_fast.utils import schedules as fast_schedules  # noqa: E402
from cockpit_fast.utils import training  # noqa: E402
from any_models import hf_gpt2, token_losses  # noqa: E402

# Cheapest first; HessMaxEV is left out (power iteration dominates and is the same in both).
CASES = [
    "Loss",
    "GradNorm",
    "Distance",
    "UpdateSize",
    "MeanGSNR",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "CABS",
    "EarlyStopping",
    "GradHist1d",
    "GradHist2d",
    "Alpha",
    "HessTrace",
    "TICDiag",
    "economy",
]


GPT2_VOCAB = 50257
# (layers, width, heads, tokens per sequence, sequences per batch)
GPT2_SIZES = {"small": (4, 128, 4, 64, 16), "124m": (12, 768, 12, 1024, 8)}
SETTINGS = {"device": "cpu", "gpt2_size": "small", "bf16": False}


def build(model_name):
    """Model, input shape and batch size of a benchmark problem (input shape None: tokens)."""
    if model_name == "gpt2":  # GPT-2's vocabulary and dropout
        layers, width, heads, tokens, n = GPT2_SIZES[SETTINGS["gpt2_size"]]
        return hf_gpt2(layers=layers, width=width, heads=heads, vocab=GPT2_VOCAB, positions=tokens, dropout=0.1), None, n
    if model_name == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        return model, (1, 28, 28), 128
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 10),
    )
    return model, (3, 32, 32), 64


def make_quantities(case, quantities, configuration, schedules):
    """The quantities of ``case`` from one package, tracked every step."""
    every = schedules.linear(1)
    if case == "economy":
        return configuration.configuration("economy", track_schedule=every)
    if case in ("HessTrace", "TICDiag"):  # the cheap curvature, as one would track it often
        return [getattr(quantities, case)(every, curvature="diag_ggn_mc")]
    return [getattr(quantities, case)(every)]


def training_step(model, params, cockpit, batch):
    """``step(i)``: one SGD step of ``model`` on ``batch(i) = (inputs, labels)``, tracked by
    ``cockpit`` (None: a plain step)."""
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    opt = torch.optim.SGD(params, lr=0.01)

    def step(i):
        inputs, labels = batch(i)
        with autocast():
            one_step(inputs, labels, i)

    def one_step(inputs, labels, i):
        if labels is None:  # language modelling: the sequences are their own labels
            training.training_step(model, opt, (inputs, inputs), token_losses, cockpit=cockpit, step=i)
        else:
            training.training_step(
                model, opt, (inputs, labels), individual_loss_fn, loss_fn=loss_fn, cockpit=cockpit, step=i
            )

    return step


def add_problem_arguments(parser, model, cases):
    """The arguments of the scripts built on this one that choose one problem: the model, the
    case (one of ``cases``), the device, GPT-2's size and bf16 autocast; :func:`use_problem` takes them."""
    parser.add_argument("--model", choices=["mlp", "cnn", "gpt2"], default=model)
    parser.add_argument("--case", choices=cases, default="economy")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpt2-size", choices=sorted(GPT2_SIZES), default="small")
    parser.add_argument("--bf16", action="store_true", help="every step under bf16 autocast")


def use_problem(args):
    """Set the device, GPT-2's size and bf16 autocast that :func:`add_problem_arguments` read."""
    SETTINGS.update(device=args.device, gpt2_size=args.gpt2_size, bf16=args.bf16)


def autocast():
    if SETTINGS["bf16"]:
        return torch.autocast(SETTINGS["device"], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize():
    if SETTINGS["device"] == "cuda":
        torch.cuda.synchronize()


def tracked_problem(model_name, cockpit_factory, seed=0):
    """``(cockpit, step)`` of a benchmark problem on ``SETTINGS["device"]``: ``step(i)`` trains on
    one of four fixed batches under the cockpit ``cockpit_factory`` makes (None: a plain step)."""
    torch.manual_seed(seed)
    model, input_shape, n = build(model_name)
    device = SETTINGS["device"]
    model = extend(model.to(device))
    cockpit = cockpit_factory(model.parameters()) if cockpit_factory else None
    data = torch.Generator().manual_seed(seed)
    if input_shape is None:
        tokens = GPT2_SIZES[SETTINGS["gpt2_size"]][3]
        batches = [(torch.randint(0, GPT2_VOCAB, (n, tokens), generator=data).to(device), None) for _ in range(4)]
    else:
        batches = [
            (torch.randn(n, *input_shape, generator=data).to(device), torch.randint(0, 10, (n,), generator=data).to(device))
            for _ in range(4)
        ]
    return cockpit, training_step(model, model.parameters(), cockpit, lambda i: batches[i % len(batches)])


def time_run(model_name, cockpit_factory, steps, seed=0):
    """Seconds per step of ``steps`` SGD steps (plus reading the output) under a cockpit or none."""
    cockpit, step = tracked_problem(model_name, cockpit_factory, seed)
    step(0)  # warm-up: allocations, first-call costs, Distance's reference copy
    synchronize()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    if cockpit is not None:
        cockpit.get_output()
    synchronize()
    return (time.perf_counter() - start) / steps


def best_times(repeats, model_name, factories, steps):
    """Best seconds per step of each cockpit factory (None: plain), runs interleaved."""
    times = [float("inf")] * len(factories)
    for _ in range(repeats):
        for i, factory in enumerate(factories):
            times[i] = min(times[i], time_run(model_name, factory, steps))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats; GPT-2 economy only")
    parser.add_argument("--model", choices=["mlp", "cnn", "gpt2"], action="append", help="problem(s); default all")
    parser.add_argument("--only", nargs="+", choices=CASES, help="cases to run; default all")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gpt2-size", choices=sorted(GPT2_SIZES), default="small")
    parser.add_argument("--bf16", action="store_true", help="every step under bf16 autocast")
    args = parser.parse_args()
    SETTINGS.update(device=args.device, gpt2_size=args.gpt2_size, bf16=args.bf16)
    steps = args.steps or (3 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 3)

    import cockpit
    from cockpit.utils import configuration as ref_configuration
    from cockpit.utils import schedules as ref_schedules

    ref_modules, fast_modules = (ref_configuration, ref_schedules), (fast_configuration, fast_schedules)
    warnings.simplefilter("ignore")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, fused ops: {cockpit_fast.has_extension()}, bf16 autocast: {args.bf16}")
    print(f"{steps} steps per run, best of {repeats}; ms per training step\n")
    header = (
        f"{'model':5} {'case':14} {'plain':>8} {'cockpit':>9} {'fast':>8}"
        f" {'cockpit/plain':>14} {'fast/plain':>11} {'speed-up':>9}"
    )
    print(header)
    print("-" * len(header))
    for model_name in args.model or ["mlp", "cnn", "gpt2"]:
        for case in args.only or (["economy"] if args.quick and model_name == "gpt2" else CASES):
            reference_factory = lambda p: cockpit.Cockpit(p, make_quantities(case, cockpit.quantities, *ref_modules))  # noqa: E731
            factories = [None, lambda p: FastCockpit(p, make_quantities(case, fast_quantities, *fast_modules))]
            try:  # Cockpit 1.0.2 fails on models of layers BackPACK does not know
                time_run(model_name, reference_factory, 1)
                factories.insert(1, reference_factory)
            except Exception as error:  # noqa: BLE001 (whatever it raises, the row says so)
                failure = type(error).__name__
            try:
                times = best_times(repeats, model_name, factories, steps)
            except ValueError as error:  # curvatures need BackPACK, which does not know GPT-2's Conv1D: refused
                print(f"{model_name:5} {case:14} {'':>8} cockpit_fast refuses: {str(error).split(':')[0]}", flush=True)
                continue
            plain, fast = times[0], times[-1]
            if len(times) == 3:
                reference = times[1]
                cells = f"{1e3 * reference:9.2f} {1e3 * fast:8.2f} {reference / plain:14.2f} {fast / plain:11.2f} {reference / fast:8.2f}x"
            else:
                cells = f"{'fails':>9} {1e3 * fast:8.2f} {'-':>14} {fast / plain:11.2f} {'-':>9} (Cockpit: {failure})"
            print(f"{model_name:5} {case:14} {1e3 * plain:8.2f} {cells}", flush=True)

if __name__ == "__main__":
    main()
