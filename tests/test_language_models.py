"""causal_lm_losses against the loss Hugging Face causal language models return themselves."""

import pytest
import torch
import torch.nn.functional as F

from cockpit_fast.integrations.language_models import causal_lm_losses

transformers = pytest.importorskip("transformers")

VOCAB = 97
N, T = 5, 12
# float32 sums of a few dozen token losses of about log(97): rounding well below this.
RTOL, ATOL = 1e-5, 1e-6


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module", params=[tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def model(request):
    torch.manual_seed(0)
    return request.param().eval()  # eval: no dropout, so both losses see the same logits


def batch(seed, whole_padding=False):
    """Random input ids; labels are the ids with -100 padding at the ends of some sequences."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(VOCAB, (N, T), generator=gen)
    labels = input_ids.clone()
    lengths = torch.randint(2, T + 1, (N,), generator=gen)
    lengths[0] = T  # one sequence without padding
    if whole_padding:
        lengths[1] = 0
    for n, length in enumerate(lengths.tolist()):
        labels[n, length:] = -100
    return input_ids, labels


def expected_losses(logits, labels, num_items_in_batch=None):
    """Each sequence alone: its own token mean, times its share of the micro-batch's divisor."""
    targets = labels[:, 1:]
    counts = (targets != -100).sum(dim=1)
    divisor = counts.sum() if num_items_in_batch is None else num_items_in_batch
    out = torch.zeros(len(labels))
    for n in range(len(labels)):
        if counts[n] > 0:
            own_mean = F.cross_entropy(logits[n, :-1].float(), targets[n], ignore_index=-100)
            out[n] = own_mean * counts[n] * len(labels) / divisor
    return out


@pytest.mark.parametrize("whole_padding", [False, True])
def test_mean_is_the_models_loss(model, whole_padding):
    input_ids, labels = batch(1, whole_padding)
    out = model(input_ids, labels=labels)
    losses = causal_lm_losses(out.logits, labels)
    assert losses.shape == (N,) and losses.dtype == torch.float32
    torch.testing.assert_close(losses.mean(), out.loss, rtol=RTOL, atol=ATOL)
    if whole_padding:
        assert losses[1] == 0


@pytest.mark.parametrize("as_tensor", [False, True])
def test_mean_is_the_models_loss_with_num_items_in_batch(model, as_tensor):
    """Gradient accumulation: the divisor counts the targets of both micro-batches."""
    micro_batches = [batch(2), batch(3, whole_padding=True)]
    total = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)
    num_items = torch.tensor(total) if as_tensor else total
    accumulated = 0.0
    for input_ids, labels in micro_batches:
        out = model(input_ids, labels=labels, num_items_in_batch=num_items)
        losses = causal_lm_losses(out.logits, labels, num_items_in_batch=num_items)
        torch.testing.assert_close(losses.mean(), out.loss, rtol=RTOL, atol=ATOL)
        accumulated = accumulated + losses.mean()
    # Both micro-batches together are one batch of 2N sequences with HF's plain token mean.
    input_ids = torch.cat([ids for ids, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    torch.testing.assert_close(accumulated, model(input_ids, labels=labels).loss, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_items_in_batch", [None, 150])
def test_each_loss_is_its_sequence_alone(model, num_items_in_batch):
    input_ids, labels = batch(4, whole_padding=True)
    logits = model(input_ids).logits
    losses = causal_lm_losses(logits, labels, num_items_in_batch=num_items_in_batch)
    torch.testing.assert_close(losses, expected_losses(logits, labels, num_items_in_batch), rtol=RTOL, atol=ATOL)


def test_gradient_is_the_models(model):
    input_ids, labels = batch(5, whole_padding=True)
    out = model(input_ids, labels=labels)
    (expected,) = torch.autograd.grad(out.loss, out.logits, retain_graph=True)
    (actual,) = torch.autograd.grad(causal_lm_losses(out.logits, labels).mean(), out.logits)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_computed_in_float32(dtype):
    _, labels = batch(6, whole_padding=True)
    logits = torch.randn(N, T, VOCAB, generator=torch.Generator().manual_seed(6)).to(dtype).requires_grad_()
    losses = causal_lm_losses(logits, labels)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, expected_losses(logits.detach(), labels), rtol=RTOL, atol=ATOL)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    assert grad.dtype == dtype and torch.isfinite(grad).all()


@pytest.mark.parametrize("num_items_in_batch", [None, 0, torch.tensor(0)])
def test_no_targets_gives_zeros(num_items_in_batch):
    """HF's mean over no tokens is NaN (and a sum over 0 divides by zero); the losses are 0."""
    logits = torch.randn(N, T, VOCAB, requires_grad=True)
    labels = torch.full((N, T), -100)
    if num_items_in_batch is not None:
        labels[:, 3] = 7  # targets whose divisor is still 0: dropped, not inf
    losses = causal_lm_losses(logits, labels, num_items_in_batch=num_items_in_batch)
    assert torch.equal(losses, torch.zeros(N))
    (grad,) = torch.autograd.grad(losses.mean(), logits)
    assert torch.equal(grad, torch.zeros_like(logits))


@pytest.mark.parametrize("labels_shape", [(N, T + 1), (N,), (N, T, 1)])
def test_mismatched_shapes_raise(labels_shape):
    logits = torch.randn(N, T, VOCAB)
    labels = torch.zeros(labels_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels.*logits \(5, 12, 97\) and labels") as info:
        causal_lm_losses(logits, labels)
    assert str(tuple(labels_shape)) in str(info.value) and "\n" not in str(info.value)


def test_logits_must_be_3d():
    with pytest.raises(ValueError, match=r"logits must be 3-D.*logits \(12, 97\) and labels \(12,\)"):
        causal_lm_losses(torch.randn(T, VOCAB), torch.zeros(T, dtype=torch.long))


def test_num_items_in_batch_must_be_one_number():
    with pytest.raises(ValueError, match=r"num_items_in_batch.*\(2,\)"):
        causal_lm_losses(
            torch.randn(N, T, VOCAB), torch.zeros(N, T, dtype=torch.long), num_items_in_batch=torch.tensor([3, 4])
        )
