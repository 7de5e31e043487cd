"""Models BackPACK does not know, for the per-sample engine's tests: each with a batch and the
per-sample loss that defines its individual gradients."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, TOKENS, CLASSES = 13, 8, 6, 3


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, t, c))


class GPTLike(nn.Module):
    """Token embedding, a learned positional nn.Parameter, LayerNorm, causal attention, GELU MLP,
    an output head tied to the embedding; its blocks used in sequence."""

    def __init__(self, vocab=VOCAB, width=WIDTH, tokens=TOKENS, heads=2, layers=2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.1 * torch.randn(tokens, width))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(width),
                    "attn": CausalSelfAttention(width, heads),
                    "ln2": nn.LayerNorm(width),
                    "mlp": nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, ids):
        x = self.embedding(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = x + block["attn"](block["ln1"](x))
            x = x + block["mlp"](block["ln2"](x))
        return self.head(self.ln_f(x))


class ResidualCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        h = F.relu(self.norm(self.stem(x)))
        h = F.relu(h + self.norm2(self.conv(h)))
        return self.head(h.mean((2, 3)))


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, 6, batch_first=True)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, ids):
        out, _ = self.lstm(self.embedding(ids))
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoderLayer, time first (batch_first=False): samples along dimension 1."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, dim_feedforward=12, dropout=0.0)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.layer(x.transpose(0, 1)).mean(0))


class AttentionClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        y, _ = self.attention(x, x, x, need_weights=False)
        return self.head(y.mean(1))


class Conv1dModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(5, 4, 2, groups=1, padding="same", padding_mode="circular")
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.conv2(F.relu(self.conv(x)))).mean(2))


class TwiceApplied(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class Checkpointed(nn.Module):
    """Residual blocks under activation checkpointing (``use_reentrant``: the older kind, whose
    backward pass runs a backward pass of its own)."""

    def __init__(self, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.checkpointing = True  # off for the oracle: torch.func cannot differentiate through it
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
            else:
                x = x + block(x)
        return self.head(x)


class TiedEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.out.weight = self.embedding.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.embedding(ids)))


class BatchNormNet(nn.Module):
    """Batch norm in training mode: the samples interact."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH, track_running_stats=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.lin(x))))


def hf_gpt2(layers=2, width=16, heads=2, vocab=VOCAB, positions=TOKENS, dropout=0.0):
    """A Hugging Face GPT-2 from a small config that returns its logits: random weights, nothing
    downloaded (also the benchmarks' GPT-2)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return _LogitsOnly(transformers.GPT2LMHeadModel(config))


class _LogitsOnly(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def token_losses(logits, ids):
    """Next-token cross-entropy, the mean over each sample's positions: (N,)."""
    n, t = ids.shape
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return losses.reshape(n, t - 1).mean(1)


def class_losses(logits, labels):
    return F.cross_entropy(logits, labels, reduction="none")


def _tokens(n, gen):
    return torch.randint(1, VOCAB, (n, TOKENS), generator=gen)


# name -> (model factory, batch(n, generator, dtype) -> (inputs, targets), per-sample loss)
MODELS = {
    "gpt_like": (GPTLike, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "hf_gpt2": (hf_gpt2, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "encoder_layer": (
        EncoderClassifier,
        lambda n, g, d: (torch.randn(n, TOKENS, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "multihead_attention": (
        AttentionClassifier,
        lambda n, g, d: (torch.randn(n, TOKENS, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "residual_cnn": (
        ResidualCNN,
        lambda n, g, d: (torch.randn(n, 2, 5, 5, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "lstm": (
        LSTMClassifier,
        lambda n, g, d: (_tokens(n, g), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "conv1d": (
        Conv1dModel,
        lambda n, g, d: (torch.randn(n, 3, 9, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "twice_applied": (
        TwiceApplied,
        lambda n, g, d: (torch.randn(n, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "checkpointed": (
        Checkpointed,
        lambda n, g, d: (torch.randn(n, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "tied_embeddings": (
        TiedEmbeddings,
        lambda n, g, d: (torch.randint(0, VOCAB, (n, TOKENS), generator=g), None),
        lambda out, x, y: F.cross_entropy(out.reshape(-1, VOCAB), x.roll(1, 1).reshape(-1), reduction="none").reshape(x.shape).mean(1),
    ),
    "batch_norm_training": (
        BatchNormNet,
        lambda n, g, d: (torch.randn(n, 6, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
}


def build(name, dtype=torch.float64, seed=0):
    """The model ``name`` in ``dtype`` and its per-sample loss ``losses(model, x, y) -> (N,)``."""
    torch.manual_seed(seed)
    make, batch, loss = MODELS[name]
    model = make().to(dtype)
    return model, (lambda n, gen: batch(n, gen, dtype)), (lambda m, x, y: loss(m(x), x, y))


def oracle_grads(model, params, losses_of, x, y):
    """float64 per-sample gradients ``∇ loss[n]`` of ``params`` from torch.func: the Jacobian of the
    batch's per-sample losses (exact for any model, samples interacting or not), tied weights
    summed. Returns one ``(N, *shape)`` tensor per parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    wanted = [names[id(p)] for p in params]
    values = {name: p.detach() for name, p in model.named_parameters()}

    def losses(chosen):
        return losses_of(lambda inputs: torch.func.functional_call(model, {**values, **chosen}, (inputs,), tie_weights=True), x, y)

    checkpointed = [m for m in model.modules() if getattr(m, "checkpointing", False)]
    for m in checkpointed:
        m.checkpointing = False
    try:
        jacobian = torch.func.jacrev(losses)({name: values[name] for name in wanted})
    finally:
        for m in checkpointed:
            m.checkpointing = True
    return [jacobian[name] for name in wanted]


def flat(tensors):
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], 1)


def assert_counts_close(actual, expected, values, edges, slack=0):
    """Histogram counts equal, up to values within rounding of a bin edge (float32 models)."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert actual.sum() == expected.sum()
    near = 0
    for axis_values, axis_edges in zip(values, edges):
        width = float(axis_edges[1] - axis_edges[0])
        position = (axis_values.double() - float(axis_edges[0])) / width
        near += int(((position - position.round()).abs() < 1e-4).sum())
    assert (actual - expected).abs().sum() <= 2 * (near + slack), (actual - expected).abs().sum()

