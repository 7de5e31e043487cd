"""A step tracked by cockpit_fast's ``economy`` configuration against a plain step, per model family.

For each family (Hugging Face GPT-2, Llama, BERT, ViT and T5 built from small configs with random
weights, nn.GRU and nn.LSTM classifiers, an nn.TransformerEncoder, a weight_norm MLP, an MLP
under bfloat16 autocast, a top-1 mixture of experts, ``bench_step.py``'s small CNN and that CNN
with nn.BatchNorm2d in training mode; dropout 0 everywhere): N = 32 sequences of T = 32 tokens
or 32x32 images (the MLPs: N = 128), width 128, language models over a vocabulary of
``--vocab`` tokens. Each step is ``cockpit_fast.utils.training.training_step``: forward, each
sample's loss (next-token cross-entropy averaged over the sample's positions for language
models, a seq2seq cross-entropy for T5, cross-entropy for classifiers), their mean, backward,
an optimizer step (``--optimizer``: SGD by default, or AdamW); the tracked step hands the cockpit ``info`` with batch_size, individual_losses, loss and
optimizer.

Printed per family and thread count: the first tracked step (it runs the engine's checks), the
median ms of a plain and of a tracked step over ``--repeats`` interleaved pairs (after warm-up
steps; the pair's order alternates) on two copies of the model, the ratio of the medians, the
spread of the pairs' ratios (min-max), the peak memory ratio, and how many parameters take each
route (``Cockpit.routes()`` after the first tracked step; "rule" and "replayed" are module-local).

Memory: each variant runs in a fresh process that resets the peak resident set size after its
imports and a throwaway build (``/proc/self/clear_refs``), then builds the model and batch and
runs the first step and three more; the growth of the peak RSS (VmHWM) over the resident size
before the build holds model, data, activations, gradients and what tracking adds, the first
tracked step's checks included. "mem x" is the tracked growth over the plain growth. The
children run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``): every
larger block is then mapped on its own and handed back when freed, so the peak RSS follows the
live tensors (by default glibc raises the threshold after the first large frees and keeps later
blocks in its heap: 40 to 100 MiB more resident after a step, plain or tracked, than its tensors).

Timings on a shared machine are noisy: the ratios, taken pair by pair, are the figures to read.

With ``--device cuda`` the models and batches live on the GPU, each timed step ends with a
synchronisation, and "mem x" is the growth of the peak of ``torch.cuda.max_memory_allocated``.

Usage: ``python benchmarks/bench_families.py [--quick] [--threads 1 2] [--only NAME ...] [--vocab V]
[--device cuda] [--optimizer sgd|adamw]``
"""

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' Hugging Face wrappers
import bench_step  # noqa: E402
from any_models import _LogitsOnly, _Seq2SeqLogits, class_losses, hf_gpt2, token_losses  # noqa: E402
from bench_ghost import _status_kib, next_forward_starts  # noqa: E402

import cockpit_fast  # noqa: E402
from cockpit_fast.cockpit import Cockpit  # noqa: E402
from cockpit_fast.utils.configuration import configuration  # noqa: E402
from cockpit_fast.utils.training import training_step  # noqa: E402

N, TOKENS, WIDTH, CLASSES, HEADS = 32, 32, 128, 10, 4
MLP_N = 128
MEMORY_STEPS = 3  # after the first step


def seq2seq_losses(logits, ids):
    """T5's loss: cross-entropy of each target position (the decoder reads them shifted right),
    averaged over each sample's positions: (N,)."""
    return F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)


class RecurrentClassifier(nn.Module):
    """Token embedding, one nn.GRU or nn.LSTM layer, a linear head on the last step's output."""

    def __init__(self, recurrent_cls, vocab):
        super().__init__()
        self.embedding = nn.Embedding(vocab, WIDTH)
        self.recurrent = recurrent_cls(WIDTH, WIDTH, num_layers=1, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        out, _ = self.recurrent(self.embedding(ids))
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """Token embedding, an nn.TransformerEncoder of 2 layers (batch first), mean pooling, a head."""

    def __init__(self, vocab):
        super().__init__()
        self.embedding = nn.Embedding(vocab, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        return self.head(self.encoder(self.embedding(ids)).mean(1))


class Top1MoE(nn.Module):
    """A mixture-of-experts layer: a router picks one expert MLP per token; tokens reach their
    expert by index_select and come back by index_add, weighted by the router's probability."""

    def __init__(self, experts=4):
        super().__init__()
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(experts)
        )

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(tokens).softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            index = (choice == e).nonzero().squeeze(1)
            if len(index):
                out = out.index_add(0, index, gate[index, None] * expert(tokens.index_select(0, index)))
        return out.reshape(x.shape)


class MoELanguageModel(nn.Module):
    """Token embedding, a residual top-1 MoE block after a LayerNorm, a final LayerNorm, a head."""

    def __init__(self, vocab):
        super().__init__()
        self.embedding = nn.Embedding(vocab, WIDTH)
        self.norm, self.moe, self.norm_f = nn.LayerNorm(WIDTH), Top1MoE(), nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, ids):
        x = self.embedding(ids)
        x = x + self.moe(self.norm(x))
        return self.head(self.norm_f(x))


class Autocast(nn.Module):
    """``model``'s forward pass under bfloat16 autocast, its logits back in float32."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.model(x).float()


def mlp(weight_norm=False):
    layers = [nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)]
    if weight_norm:
        layers = [nn.utils.parametrizations.weight_norm(m) if isinstance(m, nn.Linear) else m for m in layers]
    return nn.Sequential(*layers)


def cnn(batch_norm=False):
    """``bench_step.py``'s small CNN, with nn.BatchNorm2d after each convolution if ``batch_norm``."""
    model, _, _ = bench_step.build("cnn")
    if batch_norm:
        layers = [[m, nn.BatchNorm2d(m.out_channels)] if isinstance(m, nn.Conv2d) else [m] for m in model]
        model = nn.Sequential(*[m for pair in layers for m in pair])
    return model


def hf(config_cls, model_cls, input_name="input_ids", **config):
    import transformers

    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    return _LogitsOnly(model, input_name)


def hf_t5(vocab):
    import transformers

    config = transformers.T5Config(
        vocab_size=vocab, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=4 * WIDTH, num_layers=1, num_decoder_layers=1,
        num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
    )
    return _Seq2SeqLogits(transformers.T5ForConditionalGeneration(config))


def tokens(vocab, gen):
    return torch.randint(0, vocab, (N, TOKENS), generator=gen)


def labels(n, gen):
    return torch.randint(0, CLASSES, (n,), generator=gen)


# name -> (model(vocab), batch(vocab, generator) -> (inputs, labels), per-sample loss(outputs, labels))
LM = (lambda v, g: (tokens(v, g),) * 2, token_losses)  # the sequences are their own labels
TEXT_CLASSIFIER = (lambda v, g: (tokens(v, g), labels(N, g)), class_losses)
IMAGES = (lambda v, g: (torch.randn(N, 3, 32, 32, generator=g), labels(N, g)), class_losses)
FLAT_IMAGES = (lambda v, g: (torch.randn(MLP_N, 784, generator=g), labels(MLP_N, g)), class_losses)
FAMILIES = {
    "gpt2": (lambda v: hf_gpt2(layers=4, width=WIDTH, heads=HEADS, vocab=v, positions=TOKENS), *LM),
    "llama": (
        lambda v: hf(
            "LlamaConfig", "LlamaForCausalLM", vocab_size=v, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=256, max_position_embeddings=TOKENS,
        ),
        *LM,
    ),
    "bert": (
        lambda v: hf(
            "BertConfig", "BertForSequenceClassification", vocab_size=v, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, intermediate_size=4 * WIDTH, max_position_embeddings=TOKENS,
            num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        *TEXT_CLASSIFIER,
    ),
    "vit": (
        lambda v: hf(
            "ViTConfig", "ViTForImageClassification", "pixel_values", image_size=32, patch_size=4, num_channels=3,
            hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=4 * WIDTH,
            num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        *IMAGES,
    ),
    "t5": (hf_t5, LM[0], seq2seq_losses),
    "gru": (lambda v: RecurrentClassifier(nn.GRU, v), *TEXT_CLASSIFIER),
    "lstm": (lambda v: RecurrentClassifier(nn.LSTM, v), *TEXT_CLASSIFIER),
    "transformer_encoder": (EncoderClassifier, *TEXT_CLASSIFIER),
    "weight_norm_mlp": (lambda v: mlp(weight_norm=True), *FLAT_IMAGES),
    "autocast_bf16_mlp": (lambda v: Autocast(mlp()), *FLAT_IMAGES),
    "moe_top1": (MoELanguageModel, *LM),
    "cnn": (lambda v: cnn(), *IMAGES),
    "cnn_batchnorm": (lambda v: cnn(batch_norm=True), *IMAGES),
}


def build(name, vocab, device="cpu"):
    """Model, batch and per-sample loss of family ``name`` on ``device``, the same in every process."""
    make_model, make_batch, losses = FAMILIES[name]
    torch.manual_seed(0)
    model = make_model(vocab).to(device)
    batch = tuple(tensor.to(device) for tensor in make_batch(vocab, torch.Generator().manual_seed(1)))
    return model, batch, losses


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    # Alpha cannot know AdamW's update in the backward pass: it keeps the step's individual gradients
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def stepper(model, batch, losses, tracked, optimizer="sgd"):
    """``step(i)``: one ``optimizer`` step of ``model`` on ``batch``, tracked by a cockpit with
    the ``economy`` configuration if ``tracked``; returns the step and the cockpit (or None)."""
    optimizer = OPTIMIZERS[optimizer](model.parameters())
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy")) if tracked else None

    def step(i):
        training_step(model, optimizer, batch, losses, cockpit=cockpit, step=i)
        next_forward_starts()

    return step, cockpit


def seconds(step, i):
    synchronize = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
    synchronize()
    start = time.perf_counter()
    step(i)
    synchronize()  # the GPU's work counted, not only its launches
    return time.perf_counter() - start


def routes_summary(cockpit):
    """How many tracked parameters take each route, e.g. ``12 Linear rule, 2 whole graph``."""
    counts = Counter(route.removeprefix("module-local: ") for route in cockpit.routes().values())
    return ", ".join(f"{count} {route}" for route, count in counts.most_common())


def time_family(name, vocab, repeats, warmup, device, optimizer):
    """First tracked step (s), plain and tracked seconds of each interleaved pair, routes."""
    model, batch, losses = build(name, vocab, device)
    plain_step, _ = stepper(model, batch, losses, tracked=False, optimizer=optimizer)
    tracked_step, cockpit = stepper(copy.deepcopy(model), batch, losses, tracked=True, optimizer=optimizer)
    plain_step(0)
    first = seconds(tracked_step, 0)
    routes = routes_summary(cockpit)
    for i in range(1, 1 + warmup):
        plain_step(i)
        tracked_step(i)
    plain, tracked = [], []
    for i in range(1 + warmup, 1 + warmup + repeats):
        if i % 2:  # alternate which of the pair goes first
            plain.append(seconds(plain_step, i))
            tracked.append(seconds(tracked_step, i))
        else:
            tracked.append(seconds(tracked_step, i))
            plain.append(seconds(plain_step, i))
    cockpit.get_output()
    return first, plain, tracked, routes


def memory_growth_here(name, variant, vocab, device, optimizer):
    """The peak memory growth (MiB; resident set on the CPU, allocated on the GPU) of building
    family ``name`` and running its first step and ``MEMORY_STEPS`` more, plain or tracked
    (``variant``); on the CPU only exact in a fresh process."""
    warnings.simplefilter("ignore")
    build(name, vocab, device)  # a throwaway build first: the modules it imports lazily are not counted
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 1024
    else:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets the peak (VmHWM) to the current resident size (Linux >= 4.0)
        before = _status_kib("VmRSS")
    model, batch, losses = build(name, vocab, device)
    step, _ = stepper(model, batch, losses, tracked=variant == "tracked", optimizer=optimizer)
    for i in range(1 + MEMORY_STEPS):
        step(i)
    peak = torch.cuda.max_memory_allocated() / 1024 if device == "cuda" else _status_kib("VmHWM")
    return (peak - before) / 1024


def peak_growth_mib(name, variant, vocab, threads, device, optimizer):
    """Peak memory growth (MiB) of ``variant`` of family ``name``: on the CPU measured in a fresh
    process, on the GPU here (the allocator counts live tensors alone)."""
    if device == "cuda":
        return memory_growth_here(name, variant, vocab, device, optimizer)
    child = subprocess.run(
        [sys.executable, __file__, "--memory-of", name, variant, "--vocab", str(vocab), "--optimizer", optimizer],
        capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    )
    if child.returncode:
        lines = child.stderr.strip().splitlines()
        raise RuntimeError(f"{variant} memory run failed: {lines[-1] if lines else child.returncode}")
    return float(child.stdout.strip().splitlines()[-1])


def first_line(error):
    """``Type: the message's first line``."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer warm-up steps and repeats")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads; default 1 and 2")
    parser.add_argument(
        "--only", nargs="+", choices=list(FAMILIES), metavar="NAME", help=f"families: {', '.join(FAMILIES)}"
    )
    parser.add_argument("--vocab", type=int, default=1024, help="language models' vocabulary; default 1024")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved pairs timed; default 15 (quick: 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd")
    parser.add_argument("--memory-of", nargs=2, metavar=("NAME", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the engine's notices of whole-graph routes: the routes column says it
    import transformers

    transformers.logging.set_verbosity_error()  # GPT-2's config names its own vocabulary's end token
    if args.memory_of:
        return print(memory_growth_here(*args.memory_of, args.vocab, "cpu", args.optimizer))
    repeats = args.repeats or (3 if args.quick else 15)
    warmup = 1 if args.quick else 3

    device = args.device
    on = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    peak = "allocated" if device == "cuda" else "RSS"
    print(f"torch {torch.__version__} on {on}, fused ops: {cockpit_fast.has_extension()}, load {os.getloadavg()}")
    print(
        f"N = {N} ({MLP_N} for the MLPs), T = {TOKENS}, vocabulary {args.vocab}; {args.optimizer}, economy configuration; "
        f"{warmup} warm-up steps, median of {repeats} interleaved pairs; mem x: peak {peak} growth, tracked / plain\n"
    )
    header = (
        f"{'family':19} {'thr':>3} {'first ms':>9} {'plain ms':>9} {'tracked ms':>10} {'ratio':>6} {'spread':>11}"
        f" {'mem x':>6}  routes (parameters per route)"
    )
    print(header)
    print("-" * len(header))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.only or FAMILIES:
            try:
                first, plain, tracked, routes = time_family(name, args.vocab, repeats, warmup, device, args.optimizer)
            except Exception as error:  # noqa: BLE001 (a family that fails is reported, the run goes on)
                print(f"{name:19} {threads:3} ERROR {first_line(error)}", flush=True)
                continue
            ratios = [t / p for p, t in zip(plain, tracked)]
            plain_ms, tracked_ms = 1e3 * statistics.median(plain), 1e3 * statistics.median(tracked)
            try:
                growth = [
                    peak_growth_mib(name, variant, args.vocab, threads, device, args.optimizer) for variant in ("tracked", "plain")
                ]
                mem = f"{growth[0] / growth[1]:6.2f}"
            except Exception as error:  # noqa: BLE001
                mem = f"{'err':>6}"
                routes += f"  [memory: {first_line(error)}]"
            print(
                f"{name:19} {threads:3} {1e3 * first:9.1f} {plain_ms:9.2f} {tracked_ms:10.2f} {tracked_ms / plain_ms:6.2f}"
                f" {min(ratios):5.2f}-{max(ratios):5.2f} {mem}  {routes}",
                flush=True,
            )
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
