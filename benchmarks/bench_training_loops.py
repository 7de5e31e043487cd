"""Training loops side by side in one process: gradient accumulation and the Hugging Face Trainer.

Model: Hugging Face GPT-2 from a config (random weights, dropout 0), 4 layers, width 128, 4 heads,
a vocabulary of 512 tokens, N = 16 sequences of T = 64 tokens per optimizer step; the cockpit
tracks the ``economy`` configuration.

1. Accumulation: one tracked step over k = 4 micro-batches of 4 sequences
   (``tracked.micro_batch``), against k tracked steps of 4 sequences each (one backward pass
   each), and a plain accumulated step (no cockpit). Printed: median ms over ``--repeats``
   interleaved rounds, the ratio of the accumulated step to the k single steps (issue target:
   at most 1.05), and the bytes the accumulated step kept for InnerTest, OrthoTest and Alpha
   (each micro-batch's per-sample gradient factors, until the last backward pass) next to the
   bytes of the model's parameters.
2. The Trainer: the time of an optimizer step (``on_step_begin`` to ``on_step_end``, gradient
   accumulation 1, batch 16) of a plain ``transformers.Trainer`` and of one with
   ``CockpitCallback("economy")``; medians over the steps after ``--warmup``, the two trainers
   run in turn ``--rounds`` times (issue target: at most 1.6x).

3. ``torch.compile`` (an MLP, 4 layers of width 512, N = 128, ``economy`` tracking NormTest,
   InnerTest, GradHist1d, GradNorm): eager and compiled, each plain, tracked, and with a cockpit
   that does not track the step (its schedule skips it); ratios to the plain step of the same
   mode (issue targets: the compiled tracked ratio at most the eager one's; an untracked step
   costs what a plain step costs).

Timings on a shared machine are noisy: read the ratios, and note the load printed at the start.

Usage: ``OMP_NUM_THREADS=2 python benchmarks/bench_training_loops.py [--threads 1] [--repeats 7]``
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import transformers  # noqa: E402

from cockpit_fast import Cockpit  # noqa: E402
from cockpit_fast.integrations.language_models import causal_lm_losses  # noqa: E402
from cockpit_fast.integrations.transformers import CockpitCallback  # noqa: E402
from cockpit_fast.utils.configuration import configuration  # noqa: E402

N, TOKENS, VOCAB, MICRO = 16, 64, 512, 4


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def batch(seed):
    return torch.randint(0, VOCAB, (N, TOKENS), generator=torch.Generator().manual_seed(seed))


def accumulated_step(model, opt, cockpit, step, ids, kept):
    opt.zero_grad()
    parts = ids.split(len(ids) // MICRO)
    if cockpit is None:
        for part in parts:
            (causal_lm_losses(model(part).logits, part).sum() / len(ids)).backward()
    else:
        with cockpit(step, info={"batch_size": len(ids), "optimizer": opt}) as tracked:
            for part in parts:
                losses = causal_lm_losses(model(part).logits, part)
                loss = losses.sum() / len(ids)
                tracked.micro_batch(individual_losses=losses, loss=loss)
                loss.backward()
        kept.append(tracked._statistics.kept_bytes)
    opt.step()


def single_steps(model, opt, cockpit, step, ids):
    for k, part in enumerate(ids.split(len(ids) // MICRO)):
        opt.zero_grad()
        losses = causal_lm_losses(model(part).logits, part)
        loss = losses.mean()
        info = {"batch_size": len(part), "individual_losses": losses, "loss": loss, "optimizer": opt}
        with cockpit(MICRO * step + k, info=info):
            loss.backward()
        opt.step()


def timed(run):
    start = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - start)


def bench_accumulation(repeats):
    variants = {}
    for name in ("plain", "accumulated", "single"):
        model = gpt2()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        cockpit = None if name == "plain" else Cockpit(model.parameters(), quantities=configuration("economy"))
        variants[name] = (model, opt, cockpit)
    kept, times = [], {name: [] for name in variants}
    for round_ in range(repeats + 2):  # two warm-up rounds (the engine's checks on the first)
        ids = batch(round_)
        order = list(variants) if round_ % 2 else list(reversed(variants))
        for name in order:
            model, opt, cockpit = variants[name]
            if name == "single":
                ms = timed(lambda: single_steps(model, opt, cockpit, round_, ids))
            else:
                ms = timed(lambda: accumulated_step(model, opt, cockpit, round_, ids, kept))
            if round_ >= 2:
                times[name].append(ms)
    medians = {name: statistics.median(values) for name, values in times.items()}
    params = sum(p.numel() * p.element_size() for p in variants["plain"][0].parameters())
    print(f"accumulation, k = {MICRO} micro-batches of {N // MICRO} (N = {N}, T = {TOKENS}), economy:")
    print(f"  plain accumulated step     {medians['plain']:8.1f} ms")
    print(f"  tracked accumulated step   {medians['accumulated']:8.1f} ms")
    print(f"  {MICRO} tracked single steps     {medians['single']:8.1f} ms")
    print(f"  accumulated / {MICRO} single    {medians['accumulated'] / medians['single']:8.3f}x   (target <= 1.05)")
    print(f"  tracked / plain accumulated {medians['accumulated'] / medians['plain']:7.3f}x")
    print(f"  kept for InnerTest, OrthoTest, Alpha: {max(kept) / 2**20:.1f} MiB (parameters: {params / 2**20:.1f} MiB)")


class StepTimer(transformers.TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(1e3 * (time.perf_counter() - self._start))


class Texts(torch.utils.data.Dataset):
    def __init__(self, count):
        self.ids = torch.randint(0, VOCAB, (count, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, n):
        return {"input_ids": self.ids[n], "labels": self.ids[n]}


def trainer_steps(tracked, steps, workdir):
    timer = StepTimer()
    callbacks = [CockpitCallback("economy"), timer] if tracked else [timer]
    args = transformers.TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=N, max_steps=steps, learning_rate=1e-3,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, logging_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=Texts(N * steps), callbacks=callbacks)
    trainer.train()
    return timer.times


def bench_trainer(rounds, steps, warmup, workdir):
    times = {False: [], True: []}
    for round_ in range(rounds):
        for tracked in ((False, True) if round_ % 2 == 0 else (True, False)):
            times[tracked] += trainer_steps(tracked, steps, workdir)[warmup:]
    plain, tracked = statistics.median(times[False]), statistics.median(times[True])
    print(f"HF Trainer, GPT-2 (N = {N}, T = {TOKENS}), {len(times[True])} steps each:")
    print(f"  plain Trainer step         {plain:8.1f} ms")
    print(f"  with CockpitCallback       {tracked:8.1f} ms")
    print(f"  ratio                      {tracked / plain:8.3f}x   (target <= 1.6)")


def mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 512), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))


def bench_compile(repeats):
    from cockpit_fast import quantities as q

    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    every = lambda step: True  # noqa: E731
    never = lambda step: False  # noqa: E731

    def tracked_set(schedule):
        return [q.NormTest(schedule), q.InnerTest(schedule), q.GradHist1d(schedule), q.GradNorm(schedule)]

    variants = {}
    for mode in ("eager", "compiled"):
        for kind in ("plain", "tracked", "untracked"):
            model = mlp()
            cockpit = None if kind == "plain" else Cockpit(model.parameters(), quantities=tracked_set(every if kind == "tracked" else never))
            run = torch.compile(model) if mode == "compiled" else model
            variants[mode, kind] = (model, run, cockpit)

    def step(name, index):
        model, run, cockpit = variants[name]
        model.zero_grad()
        losses = torch.nn.functional.cross_entropy(run(x), y, reduction="none")
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
            return
        with cockpit(index, info={"batch_size": len(x), "individual_losses": losses, "loss": loss}):
            loss.backward()

    for index, name in enumerate(variants):  # compile and check first, untimed
        for warm in range(3):
            step(name, warm)
    times = {name: [] for name in variants}
    for round_ in range(repeats):
        for name in variants if round_ % 2 else reversed(list(variants)):
            times[name].append(timed(lambda: step(name, 10 + round_)))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print("torch.compile, MLP 64-512-512-512-10, N = 128:")
    for mode in ("eager", "compiled"):
        plain = medians[mode, "plain"]
        print(
            f"  {mode:8s} plain {plain:7.2f} ms   tracked {medians[mode, 'tracked']:7.2f} ms "
            f"({medians[mode, 'tracked'] / plain:5.2f}x)   cockpit, step not tracked "
            f"{medians[mode, 'untracked']:7.2f} ms ({medians[mode, 'untracked'] / plain:5.2f}x)"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    bench_accumulation(args.repeats)
    bench_trainer(args.rounds, args.steps, args.warmup, Path("/tmp/bench_training_loops"))
    bench_compile(3 * args.repeats)


if __name__ == "__main__":
    main()
