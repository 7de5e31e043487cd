"""Per-sample losses of causal language models that average to the loss the model reports."""

import torch
import torch.nn.functional as F


def causal_lm_losses(logits, labels, ignore_index=-100, num_items_in_batch=None):
    """Per-sequence losses of a causal language model whose mean is Hugging Face's loss.

    Follows ``ForCausalLMLoss`` of ``transformers`` (``transformers/loss/loss_utils.py``):
    position ``t`` predicts ``labels[:, t + 1]``, targets equal to ``ignore_index`` are left
    out, and the logits are upcast to float32. With ``D = num_items_in_batch`` if given, else the
    number of target tokens of this micro-batch, and ``N`` sequences, sequence ``n`` gets::

        losses[n] = N * (sum of sequence n's token cross-entropies) / D

    so ``losses.mean()`` equals the model's ``outputs.loss`` for the same arguments, to rounding.
    In a plain loop::

        outputs = model(input_ids)
        losses = causal_lm_losses(outputs.logits, labels)
        loss = losses.mean()  # == model(input_ids, labels=labels).loss
        loss.backward()

    Pass the ``num_items_in_batch`` the model was called with, as it is: the ``Trainer`` counts
    the labels of the whole accumulated batch (for some models, GPT-2 among them, without the
    shift: one more per sequence), and the model divides by that count. Scaling the ``Trainer``
    applies after the model (division by the accumulation steps when ``num_items_in_batch`` is
    None, multiplication by the number of processes with ``average_tokens_across_devices``) is
    not part of these losses.

    A sequence without target tokens (all padding) gets loss 0. When ``D`` is 0, where Hugging
    Face returns NaN (0 / 0: no targets) or inf (targets divided by 0), every loss is 0.

    Args:
        logits: ``(N, T, V)`` float32, bfloat16 or float16 logits.
        labels: ``(N, T)`` integer labels, unshifted (the input ids, with ``ignore_index``
            where a token must not be predicted).
        ignore_index: Label value that marks positions without a target.
        num_items_in_batch: Divisor ``D`` of the summed token losses: an int, a float or a
            one-element tensor; None uses this micro-batch's number of target tokens.

    Returns:
        ``(N,)`` float32 tensor on ``logits``' device, differentiable with respect to ``logits``.

    Raises:
        ValueError: If ``logits`` is not 3-D, ``labels``' shape is not ``logits``' shape without
            the last dimension, or ``num_items_in_batch`` has more than one element.
    """
    shapes = f"got logits {tuple(logits.shape)} and labels {tuple(labels.shape)}"
    if logits.dim() != 3:
        raise ValueError(f"causal_lm_losses: logits must be 3-D (N, T, V), {shapes}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"causal_lm_losses: labels must have logits' shape without the last dimension, {shapes}")
    # Same shift as Hugging Face: the last position has nothing to predict.
    targets = F.pad(labels.to(logits.device), (0, 1), value=ignore_index)[:, 1:]
    token_losses = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="none"
    )
    sums = token_losses.view(targets.shape).sum(dim=1)  # ignored positions contribute exactly 0

    if num_items_in_batch is None:
        count = (targets != ignore_index).sum()
    else:
        count = torch.as_tensor(num_items_in_batch, device=logits.device)
        if count.numel() != 1:
            raise ValueError(
                "causal_lm_losses: num_items_in_batch must be a number or a one-element tensor, "
                f"got shape {tuple(count.shape)}"
            )
        count = count.reshape(())
    count = count.to(torch.float32)
    # Decided on the device (no host sync); dividing by 1 instead of 0 keeps the gradients of the
    # discarded branch finite, since torch.where backpropagates through both branches.
    has_items = count > 0
    scale = logits.shape[0] / torch.where(has_items, count, 1.0)
    return torch.where(has_items, sums * scale, 0.0)
