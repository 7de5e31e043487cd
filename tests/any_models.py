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


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer (batch first, one encoder and one decoder layer): the decoder's
    cross-attention reads the encoder's memory as key and value, its self-attention is causal."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(
            WIDTH, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=12, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        target = x.flip(1)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.head(self.transformer(x, target, tgt_mask=mask, tgt_is_causal=True).mean(1))


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


def hf_bert():
    """A Hugging Face BERT classifier: its key projections' bias gradients are zero in exact
    arithmetic (softmax ignores a shift every key shares), rounding noise in practice."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=TOKENS, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _LogitsOnly(transformers.BertForSequenceClassification(config))


def hf_vit():
    """A Hugging Face ViT classifier: patches by a strided convolution, a class token and
    position embeddings as raw parameters of the embeddings module."""
    import transformers

    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=2, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _LogitsOnly(transformers.ViTForImageClassification(config), "pixel_values")


def hf_llama():
    """A Hugging Face Llama: RMSNorm, rotary positions, grouped-query attention, a gated MLP."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, max_position_embeddings=TOKENS,
    )
    return _LogitsOnly(transformers.LlamaForCausalLM(config))


def hf_mamba(use_cache=False):
    """A Hugging Face Mamba (selective state space, torch's slow path on the CPU): its mixer reads
    its own parameters (A_log, D) and its convolution's weight directly, so it is replayed."""
    import transformers

    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=3,
        time_step_rank=4, use_cache=use_cache,
    )
    return _LogitsOnly(transformers.MambaForCausalLM(config))


def hf_t5():
    """A Hugging Face T5 encoder-decoder: its relative-attention-bias table is looked up once
    per forward pass and shared by every sample."""
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=4, relative_attention_max_distance=8, dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return _Seq2SeqLogits(transformers.T5ForConditionalGeneration(config))


class _LogitsOnly(nn.Module):
    def __init__(self, model, input_name="input_ids"):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs):
        return self.model(**{self.input_name: inputs}).logits


class _Seq2SeqLogits(nn.Module):
    """The decoder's logits for the ids shifted right, the ids themselves the encoder's input."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, decoder_input_ids=ids.roll(1, 1)).logits


def token_losses(logits, ids):
    """Next-token cross-entropy, the mean over each sample's positions: (N,)."""
    n, t = ids.shape
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return losses.reshape(n, t - 1).mean(1)


def class_losses(logits, labels):
    return F.cross_entropy(logits, labels, reduction="none")


def _tokens(n, gen):
    return torch.randint(1, VOCAB, (n, TOKENS), generator=gen)


class RawUse(nn.Module):
    """A tracked weight used once by its module and once functionally by its parent (DeBERTa's
    encoder reads its rel_embeddings' weight so): the sum check sends it to the whole graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, CLASSES)
        self.head = nn.Linear(CLASSES, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x) + F.linear(x.flip(1), self.lin.weight)))


class Scale(nn.Module):
    """A custom module with a parameter of its own (no rule: its call is replayed)."""

    def __init__(self, channels):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(channels, 1))

    def forward(self, x):
        return x * self.scale


class InPlaceOutputs(nn.Module):
    """Linear outputs on sequences changed in place (a query scaled with ``/=``; Longformer's
    global query, from a time-first tensor): views of the matrix product, whose own hooks stop
    firing once changed."""

    def __init__(self):
        super().__init__()
        self.inp, self.query, self.global_query = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):  # (N, T, WIDTH)
        h = torch.tanh(self.inp(x))
        query = self.query(h)
        query /= 2.0
        first = h.new_zeros(1, h.shape[0], h.shape[2])
        first[0] = h[:, 0]
        global_query = self.global_query(first)  # (1, N, WIDTH): the samples along dimension 1
        global_query *= 0.5
        return self.head(torch.tanh(query.mean(1) + global_query[0]))


def extended_unknown_layers():
    """A model ``backpack.extend``ed, as every Cockpit user does, with layers the engine has no
    rule for (a transposed convolution, a custom module): their replay must not run BackPACK's
    module hooks."""
    import backpack

    return backpack.extend(
        nn.Sequential(
            nn.Conv1d(3, 4, 3), nn.Tanh(), nn.ConvTranspose1d(4, 2, 3, stride=2), Scale(2), nn.Flatten(),
            nn.Linear(2 * 15, CLASSES),
        )
    )


# name -> (model factory, batch(n, generator, dtype) -> (inputs, targets), per-sample loss)
MODELS = {
    "gpt_like": (GPTLike, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "hf_gpt2": (hf_gpt2, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "encoder_layer": (
        EncoderClassifier,
        lambda n, g, d: (torch.randn(n, TOKENS, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "seq2seq_transformer": (
        Seq2SeqTransformer,
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
    "hf_bert": (hf_bert, lambda n, g, d: (_tokens(n, g), torch.randint(0, CLASSES, (n,), generator=g)), lambda out, x, y: class_losses(out, y)),
    "hf_vit": (
        hf_vit,
        lambda n, g, d: (torch.randn(n, 2, 8, 8, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "hf_llama": (hf_llama, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "hf_mamba": (hf_mamba, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "hf_t5": (hf_t5, lambda n, g, d: (_tokens(n, g), None), lambda out, x, y: token_losses(out, x)),
    "extended_unknown_layers": (
        extended_unknown_layers,
        lambda n, g, d: (torch.randn(n, 3, 9, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "raw_use": (
        RawUse,
        lambda n, g, d: (torch.randn(n, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
    ),
    "in_place_outputs": (
        InPlaceOutputs,
        lambda n, g, d: (torch.randn(n, TOKENS, WIDTH, generator=g, dtype=d), torch.randint(0, CLASSES, (n,), generator=g)),
        lambda out, x, y: class_losses(out, y),
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
    # The model's math alone: module hooks (backpack.extend's) do not run under torch.func.
    hooks = [(m, m._forward_hooks.copy(), m._backward_hooks.copy()) for m in model.modules()]
    for m, _, _ in hooks:
        m._forward_hooks.clear()
        m._backward_hooks.clear()
    try:
        jacobian = torch.func.jacrev(losses)({name: values[name] for name in wanted})
    finally:
        for m in checkpointed:
            m.checkpointing = True
        for m, forward, backward in hooks:
            m._forward_hooks.update(forward)
            m._backward_hooks.update(backward)
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


def one_pass_per_sample(losses, params, **grad_options):
    """``(N, D)`` every sample's gradient of ``params``, flattened, from a backward pass of its own."""
    return torch.stack(
        [torch.cat([part.flatten() for part in torch.autograd.grad(loss, params, retain_graph=True, **grad_options)]) for loss in losses]
    )


def gradient_tests(g):
    """Cockpit's NormTest, InnerTest and OrthoTest from individual gradients ``g`` (N, D), from
    their definitions; they do not change when every gradient is scaled alike."""
    n, mean = g.shape[0], g.mean(0)
    mean_sq = (mean**2).sum()
    norm = (((g**2).sum() - n * mean_sq) / (n - 1) / (n * mean_sq)).sqrt()
    dots = g @ mean
    inner = ((dots**2).sum() / (n - 1) - n / (n - 1) * mean_sq**2).sqrt() / mean_sq / n**0.5
    ortho = (((g - dots[:, None] / mean_sq * mean) ** 2).sum() / (n - 1) / mean_sq / n).sqrt()
    return {"NormTest": float(norm), "InnerTest": float(inner), "OrthoTest": float(ortho)}

