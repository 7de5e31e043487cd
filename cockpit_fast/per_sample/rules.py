"""Per-layer rules: the per-sample gradients of a module's own parameters from one call of it.

A rule is one small function ``rule(module, inputs, output_grad) -> {name: form}``, filed under
the module type with :func:`register_rule` (Opacus's ``register_grad_sampler`` is the model).
``inputs`` are the call's positional arguments, ``output_grad`` the gradient of its output,
both with the samples along dimension 0; the forms are those of
:mod:`cockpit_fast.per_sample.grads`. A rule may return None for a call it does not cover (an
embedding that renormalises its rows, say); that call then takes the exact generic route
(:mod:`cockpit_fast.per_sample.generic`), as does every module without a rule.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from cockpit_fast.per_sample.grads import ConvGrads, DenseGrads, FactoredGrads, RowGrads, factors_pay

_RULES = {}
_RULES_BY_NAME = {}  # "module.QualName" -> rule, for classes of packages we do not import


def register_rule(*module_types, raw=False, reads_outputs=False, channel_first=False):
    """File the decorated function as the rule of ``module_types`` (types, or qualified names
    such as ``"transformers.pytorch_utils.Conv1D"`` for classes of optional packages).

    ``raw``: the rule takes the call as it was, ``rule(module, args, kwargs, outputs,
    output_grads, sample_dim)``: its tensor outputs that require grad (None unless
    ``reads_outputs``: then kept, detached, until the backward pass, and None where the call was
    made once for every sample), their gradients (None where one got none) and where the call
    holds its samples (modules of several outputs or inputs, such as recurrent layers).

    ``channel_first``: the module takes ``(rows, channels, *spatial)`` (convolutions, batch and
    group norms): where a call's rows are not the samples (a sample's channels folded into the
    rows), the rule runs on the rows and each sample's rows' gradients are summed. Else the rule
    takes such a call's rows regrouped as ``(N, P, ...)``, P more positions of each sample."""

    def register(rule):
        rule.raw, rule.reads_outputs, rule.channel_first = raw, raw and reads_outputs, channel_first
        for module_type in module_types:
            if isinstance(module_type, str):
                _RULES_BY_NAME[module_type] = rule
            else:
                _RULES[module_type] = rule
        return rule

    return register


def rule_for(module):
    """The rule of ``module``'s type (the nearest registered base class whose ``forward`` it
    keeps: a subclass computing something else, a masked Linear say, has none), or None."""
    for cls in type(module).__mro__:
        rule = _RULES.get(cls) or _RULES_BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:
            return rule if type(module).forward is cls.forward else None
    return None


def _sequence(t):
    """``(N, *, features)`` as ``(N, T, features)`` (T given: N may be 0)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _batched(x, features):
    """Whether ``x`` holds a dimension of samples before its ``features`` last ones (a layer
    called on one sample's unbatched input, in a loop over the batch, holds none: the rule
    leaves such a call to the generic route, whose proof finds where its samples are)."""
    return x.dim() > features


def _bias(output_grad, channel_dim=-1):
    """Per-sample bias gradients: the output gradient summed over everything but N and channels."""
    terms = _sequence(output_grad.movedim(channel_dim, -1))
    return DenseGrads(terms.sum(1), [terms])


@register_rule(nn.Linear)
def linear(module, inputs, output_grad):
    if not _batched(inputs[0], 1):
        return None
    grads = {"weight": FactoredGrads(_sequence(output_grad), _sequence(inputs[0]), module.weight.shape)}
    if module.bias is not None:
        grads["bias"] = _bias(output_grad)
    return grads


@register_rule("transformers.pytorch_utils.Conv1D")
def hf_conv1d(module, inputs, output_grad):
    if not _batched(inputs[0], 1):
        return None
    # x @ weight + bias with weight (in, out): the transposed Linear.
    grads = {"weight": FactoredGrads(_sequence(inputs[0]), _sequence(output_grad), module.weight.shape)}
    if module.bias is not None:
        grads["bias"] = _bias(output_grad)
    return grads


def _padded_input(module, x):
    """The convolution's input padded as the layer pads it (any ``padding_mode``, 'same')."""
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, module._reversed_padding_repeated_twice, mode=mode)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, channel_first=True)
def convolution(module, inputs, output_grad):
    if not _batched(inputs[0], len(module.kernel_size) + 1):
        return None
    x = _padded_input(module, inputs[0])
    kernel_size = module.in_channels // module.groups * math.prod(module.kernel_size)
    positions = math.prod(output_grad.shape[2:])
    # Factors only where they are smaller than the gradients: over many positions the unfolded
    # input of every sample would take prod(kernel) times the input's memory.
    if module.groups == 1 and factors_pay(positions, module.out_channels, kernel_size):
        columns = _unfolded(x, module.kernel_size, module.dilation, module.stride)
        grad = FactoredGrads(output_grad.flatten(2).transpose(1, 2), columns.transpose(1, 2), module.weight.shape)
    else:
        grad = ConvGrads(x, output_grad, module.weight.shape, module.stride, module.dilation, module.groups)
    grads = {"weight": grad}
    if module.bias is not None:
        grads["bias"] = _bias(output_grad, channel_dim=1)
    return grads


def _unfolded(x, kernel, dilation, stride):
    """``(N, in * prod(kernel), positions)``: the input under the kernel at each output position
    (``F.unfold`` for any number of spatial dimensions), one copy of a strided view of ``x``."""
    n, channels, *size = x.shape
    out = [(length - d * (k - 1) - 1) // s + 1 for length, k, d, s in zip(size, kernel, dilation, stride)]
    spatial = x.stride()[2:]
    view = x.as_strided(
        (n, channels, *kernel, *out),
        (*x.stride()[:2], *(st * d for st, d in zip(spatial, dilation)), *(st * s for st, s in zip(spatial, stride))),
        x.storage_offset(),
    )
    return view.reshape(n, channels * math.prod(kernel), math.prod(out))


@register_rule(nn.Embedding)
def embedding(module, inputs, output_grad):
    if module.scale_grad_by_freq or module.max_norm is not None:
        return None  # the batch's frequencies, or renormalised rows: the generic route's
    return {"weight": RowGrads.from_lookups(inputs[0], output_grad, module.num_embeddings, module.padding_idx)}


def _affine(module, normalized, output_grad, channel_dim):
    """Per-sample gradients of an elementwise affine map ``weight * normalized + bias`` whose
    parameters run along ``channel_dim`` (1) or the last dimensions (-1)."""
    grads = {}
    if module.weight is not None:
        grads["weight"] = _summed_to(output_grad * normalized, module.weight.shape, channel_dim)
    if getattr(module, "bias", None) is not None:
        grads["bias"] = _summed_to(output_grad, module.bias.shape, channel_dim, terms_kept=True)
    return grads


def _summed_to(t, shape, channel_dim, terms_kept=False):
    """``t`` summed over every dimension but the samples' and the parameter's: (N, *shape);
    ``terms_kept``: ``t`` is kept for the magnitude (alive anyway: a bias's output gradient)."""
    if channel_dim != -1:
        t = t.movedim(channel_dim, -1)
    middle = math.prod(t.shape[1 : t.dim() - len(shape)])
    terms = t.reshape(t.shape[0], middle, *shape)
    return DenseGrads(terms.sum(1), [terms] if terms_kept else None)


@register_rule(nn.LayerNorm)
def layer_norm(module, inputs, output_grad):
    if not _batched(inputs[0], len(module.normalized_shape)):
        return None
    normalized = F.layer_norm(inputs[0], module.normalized_shape, eps=module.eps)
    return _affine(module, normalized, output_grad, channel_dim=-1)


@register_rule(nn.RMSNorm)
def rms_norm(module, inputs, output_grad):
    if not _batched(inputs[0], len(module.normalized_shape)):
        return None
    normalized = F.rms_norm(inputs[0], module.normalized_shape, eps=module.eps)
    return _affine(module, normalized, output_grad, channel_dim=-1)


@register_rule(nn.GroupNorm, channel_first=True)
def group_norm(module, inputs, output_grad):
    normalized = F.group_norm(inputs[0], module.num_groups, eps=module.eps)
    return _affine(module, normalized, output_grad, channel_dim=1)


def mixes_samples(module):
    """Whether the module's output for one sample depends on the other samples (a batch norm
    normalising by the batch's statistics): no module-local route is exact then."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or module.running_mean is None)


@register_rule(nn.modules.batchnorm._BatchNorm, channel_first=True)
def batch_norm(module, inputs, output_grad):
    # In training mode the batch's statistics normalise: exact where the engine proved this
    # call's output gradient each sample's own (nothing downstream mixes samples).
    x = inputs[0]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if mixes_samples(module):
        dims = [0, *range(2, x.dim())]
        mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    else:
        mean, var = module.running_mean.reshape(shape), module.running_var.reshape(shape)
    normalized = (x - mean) * torch.rsqrt(var + module.eps)
    return _affine(module, normalized, output_grad, channel_dim=1)
