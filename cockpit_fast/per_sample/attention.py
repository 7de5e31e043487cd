"""The rule of ``nn.MultiheadAttention``: per-sample gradients of its projections from one batched
backward pass through the attention.

The layer multiplies by its in-projection as a matrix and reads ``out_proj`` without calling
it, so no Linear rule sees their inputs and output gradients. The rule projects the call's
query, key and value itself and runs ``F.multi_head_attention_forward`` on the projections with
identity projections in and out (the call's masks, causality and attention weights as torch
computes them; a product by the identity is exact), then backpropagates the call's output
gradients, through ``out_proj``, to the projections once for the whole batch. Each projection's
per-sample gradient is then a sum over positions of outer products, as a Linear's:

    in-projection rows of q = sum_t dq_t query_t^T (k and v alike),   out_proj = sum_t dy_t a_t^T

with ``a`` the attention's output before ``out_proj``. Calls it does not cover are left to the
generic route: unbatched inputs, ``add_bias_kv`` and ``add_zero_attn`` (a key shared by every
sample), dropout in training mode (weights that cannot be drawn again).
"""

import inspect

import torch
from torch import nn
from torch.nn import functional as F

from cockpit_fast.per_sample.grads import DenseGrads, FactoredGrads
from cockpit_fast.per_sample.rules import register_rule


@register_rule(nn.MultiheadAttention, raw=True)
def multihead_attention(module, args, kwargs, outputs, output_grads, sample_dim):
    """``{name: form}`` of the layer's projections, or None for a call it leaves to the generic
    route."""
    call = inspect.signature(module.forward).bind(*args, **kwargs)
    call.apply_defaults()
    call = call.arguments
    query, key, value = call["query"], call["key"], call["value"]
    time_first = not module.batch_first
    if query.dim() != 3 or sample_dim != int(time_first) or module.bias_k is not None or module.add_zero_attn:
        return None
    if module.training and module.dropout > 0:
        return None
    output_grad, weights_grad = [*output_grads, None][:2]
    if output_grad is None and weights_grad is None:
        return None
    shared_input = _same(query, key) and _same(key, value)  # self-attention (the call's inputs were detached apart)
    if time_first:  # samples first, as the forms hold them
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        output_grad = None if output_grad is None else output_grad.transpose(0, 1)
    dtype, size = query.dtype, module.embed_dim
    weight = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
    if module._qkv_same_embed_dim:
        in_weights = weight(module.in_proj_weight).chunk(3)
    else:
        in_weights = [weight(getattr(module, f"{x}_proj_weight")) for x in "qkv"]
    in_biases = weight(module.in_proj_bias).chunk(3) if module.in_proj_bias is not None else [None] * 3
    out_weight = weight(module.out_proj.weight)
    projected = [F.linear(x, w, b).requires_grad_() for x, w, b in zip((query, key, value), in_weights, in_biases)]
    identity = torch.eye(size, dtype=dtype, device=query.device)
    with torch.enable_grad():
        attended, weights = F.multi_head_attention_forward(
            *(p.transpose(0, 1) for p in projected), size, module.num_heads, None, None, None, None, False, 0.0,
            identity, None, training=module.training, key_padding_mask=call["key_padding_mask"],
            need_weights=call["need_weights"], attn_mask=call["attn_mask"], use_separate_proj_weight=True,
            q_proj_weight=identity, k_proj_weight=identity, v_proj_weight=identity,
            average_attn_weights=call["average_attn_weights"], is_causal=call["is_causal"],
        )
        attended = attended.transpose(0, 1)  # (N, L, E): the attention's output before out_proj
        ends = [] if output_grad is None else [(attended, output_grad.to(dtype) @ out_weight)]
        if weights_grad is not None and weights is not None:
            ends.append((weights, weights_grad.to(dtype)))
        dq, dk, dv = torch.autograd.grad(
            [end for end, _ in ends], projected, [grad for _, grad in ends], materialize_grads=True
        )
    output_grad = torch.zeros_like(attended) if output_grad is None else output_grad.to(dtype)
    grads = {
        "out_proj.weight": FactoredGrads(output_grad, attended.detach(), module.out_proj.weight.shape),
        "out_proj.bias": DenseGrads(output_grad.sum(1), [output_grad]),
    }
    if module.in_proj_bias is not None:
        grads["in_proj_bias"] = DenseGrads(torch.cat([dq.sum(1), dk.sum(1), dv.sum(1)], 1), [dq, dk, dv])
    if not module._qkv_same_embed_dim:
        for x, d, inputs in zip("qkv", (dq, dk, dv), (query, key, value)):
            grads[f"{x}_proj_weight"] = FactoredGrads(d, inputs, getattr(module, f"{x}_proj_weight").shape)
    elif shared_input:  # one input: its positions carry all three row blocks
        grads["in_proj_weight"] = FactoredGrads(torch.cat([dq, dk, dv], 2), query, module.in_proj_weight.shape)
    else:  # each input's positions carry their own row block, zeros in the others
        blocks = [F.pad(d, (i * size, (2 - i) * size)) for i, d in enumerate((dq, dk, dv))]
        grads["in_proj_weight"] = FactoredGrads(torch.cat(blocks, 1), torch.cat([query, key, value], 1), module.in_proj_weight.shape)
    return grads


def _same(a, b):
    """Whether tensors ``a`` and ``b`` are views of the same values."""
    return a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
