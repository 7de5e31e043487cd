"""The rule of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``: per-sample gradients from the recurrence unrolled.

The fused recurrent ops show neither their gates nor the outputs of their inner layers, and
``torch.func.vmap`` batches them by a loop over samples. The rule runs the call's recurrence
again, a step at a time, from its input and initial state (the layer's weights as constants),
and backpropagates the call's output gradients through it once for the whole batch (Opacus's
``DPLSTM`` decomposition). Each sample's gradient is then a sum over its steps of what a Linear
applied at every step would get, from the gradient ``dz_t`` of the step's gate pre-activations:

    weight_ih = sum_t dz_t x_t^T,   weight_hh = sum_t dz_t h_{t-1}^T,   bias_ih = bias_hh = sum_t dz_t

as :class:`~cockpit_fast.per_sample.grads.FactoredGrads` over the steps. A GRU's reset gate
multiplies ``W_hn h + b_hn``, so its hidden gates get their own gradient (``r_t * dn_t`` in the
n part); an LSTM's projection gets ``weight_hr = sum_t dh_t u_t^T`` from the projected state's
gradient and the unprojected state ``u_t``. Packed sequences run padded, each sample's state
held past its last step. Unbatched inputs and dropout between layers in training mode (masks
that cannot be drawn again) are left to the generic route.
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from cockpit_fast.per_sample.grads import DenseGrads, FactoredGrads
from cockpit_fast.per_sample.rules import register_rule


@register_rule(nn.RNN, nn.GRU, nn.LSTM, raw=True)
def recurrent(module, args, kwargs, output_grads, sample_dim):
    """``{name: form}`` of every parameter of the layer, or None for a call it leaves to the
    generic route. The samples' dimension follows ``module.batch_first`` (``h_n`` and ``c_n``
    hold them along dimension 1 either way), so ``sample_dim`` is not needed."""
    inputs = {**dict(zip(("input", "hx"), args)), **kwargs}
    given, hx = inputs.get("input"), inputs.get("hx")
    packed = isinstance(given, PackedSequence)
    outputs = 3 if module.mode == "LSTM" else 2  # output, h_n and, for an LSTM, c_n
    if not (packed or (isinstance(given, torch.Tensor) and given.dim() == 3)) or len(output_grads) != outputs:
        return None  # unbatched, or a call whose outputs do not all require grad
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return None  # dropout between the layers: masks that cannot be drawn again
    output_grad, *state_grads = output_grads
    if packed:  # padded, time first, the samples in the caller's order
        x, lengths = pad_packed_sequence(PackedSequence(given.data.detach(), *given[1:]))
        mask = (torch.arange(x.shape[0], device=x.device).unsqueeze(1) < lengths.to(x.device)).unsqueeze(2)
        if output_grad is not None:
            output_grad = pad_packed_sequence(PackedSequence(output_grad, *given[1:]))[0]
    else:
        x, mask = given.detach(), None
        if module.batch_first:
            x = x.transpose(0, 1)
            output_grad = None if output_grad is None else output_grad.transpose(0, 1)
    h0, c0 = _initial_states(module, hx, x)
    with torch.enable_grad():
        unrolled = _Unrolled(module, x.requires_grad_(), h0, c0, mask)
        ends = [(end, grad) for end, grad in zip(unrolled.ends, [output_grad, *state_grads]) if grad is not None]
        if not ends:
            return None
        found = torch.autograd.grad(
            [end for end, _ in ends], unrolled.probes, [grad for _, grad in ends], materialize_grads=True
        )
    return unrolled.forms(found)


def _initial_states(module, hx, x):
    """``h0`` and ``c0`` (None but for an LSTM), ``(layers * directions, N, size)``, detached."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    hidden = module.proj_size or module.hidden_size
    if hx is None:
        h0 = x.new_zeros(layers, x.shape[1], hidden)
        return h0, x.new_zeros(layers, x.shape[1], module.hidden_size) if module.mode == "LSTM" else None
    if module.mode == "LSTM":
        return hx[0].detach(), hx[1].detach()
    return hx.detach(), None


class _Unrolled:
    """The call's recurrence, one differentiable step at a time, time first.

    ``probes`` are the tensors whose gradients give the forms: for each layer and direction
    its input gates ``(T, N, G)``, then a GRU's hidden gates and an LSTM's projected states, a
    step at a time; ``ends`` are the call's outputs.
    """

    def __init__(self, module, x, h0, c0, mask):
        self.module, self.probes, self._parts = module, [], []
        directions = 2 if module.bidirectional else 1
        finals_h, finals_c = [], []
        layer_input = x
        for layer in range(module.num_layers):
            outputs = []
            for direction in range(directions):
                k = layer * directions + direction
                # States that require grad: every step's gates are then in the graph.
                h, c = h0[k].requires_grad_(), None if c0 is None else c0[k].requires_grad_()
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                out, h, c = self._direction(suffix, layer_input, h, c, mask)
                outputs.append(out)
                finals_h.append(h)
                finals_c.append(c)
            layer_input = torch.cat(outputs, 2)
        # The call's outputs: output, h_n and, for an LSTM, c_n.
        self.ends = [layer_input, torch.stack(finals_h)] + ([] if c0 is None else [torch.stack(finals_c)])

    def _direction(self, suffix, layer_input, h, c, mask):
        """One layer and direction (``suffix``): its outputs ``(T, N, H)`` and final states."""
        module, gru = self.module, self.module.mode == "GRU"
        weight = lambda name: getattr(module, name + suffix).detach()  # noqa: E731
        b_ih, b_hh = (weight("bias_ih"), weight("bias_hh")) if module.bias else (None, None)
        w_hh, w_hr = weight("weight_hh"), weight("weight_hr") if module.proj_size else None
        if b_hh is not None and not gru:  # the gates add both biases: once, for every step
            b_ih = b_ih + b_hh
        input_gates = F.linear(layer_input, weight("weight_ih"), b_ih)
        steps = input_gates.shape[0]
        step_inputs = input_gates.unbind(0)  # one backward node for all steps (indexing would make one each)
        # Each step's tensors at its time index, whichever way the direction runs.
        previous, outputs, hidden_gates, projected, unprojected = ([None] * steps for _ in range(5))
        for t in reversed(range(steps)) if suffix.endswith("_reverse") else range(steps):
            previous[t] = h
            if gru:
                hidden_gates[t] = F.linear(h, w_hh, b_hh)
                in_r, in_z, in_n = step_inputs[t].chunk(3, 1)
                h_r, h_z, h_n = hidden_gates[t].chunk(3, 1)
                r, z = torch.sigmoid(in_r + h_r), torch.sigmoid(in_z + h_z)
                n = torch.tanh(in_n + r * h_n)
                new_h = n + z * (h - n)
            elif module.mode == "LSTM":
                i, f, g, o = torch.addmm(step_inputs[t], h, w_hh.T).chunk(4, 1)
                new_c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                new_h = torch.sigmoid(o) * torch.tanh(new_c)
                if w_hr is not None:
                    unprojected[t] = new_h
                    new_h = projected[t] = F.linear(new_h, w_hr)
                c = new_c if mask is None else torch.where(mask[t], new_c, c)
            else:
                activation = torch.tanh if module.mode == "RNN_TANH" else torch.relu
                new_h = activation(torch.addmm(step_inputs[t], h, w_hh.T))
            h = new_h if mask is None else torch.where(mask[t], new_h, h)  # held past the sample's end
            outputs[t] = h
        projecting = w_hr is not None
        self.probes += [input_gates, *(hidden_gates if gru else []), *(projected if projecting else [])]
        unprojected = torch.stack(unprojected) if projecting else None
        self._parts.append((suffix, layer_input, torch.stack(previous), unprojected))
        return torch.stack(outputs), h, c

    def forms(self, found):
        """``{name: form}`` from the probes' gradients ``found``, in the order of ``probes``."""
        module, grads, found = self.module, {}, iter(found)
        for suffix, layer_input, previous, unprojected in self._parts:

            def factored(name, left, right):  # sums over the steps; the factors samples first
                return FactoredGrads(left.transpose(0, 1), right.transpose(0, 1), getattr(module, name + suffix).shape)

            input_gates = next(found)
            steps = input_gates.shape[0]
            # A GRU's hidden n gate is scaled by the reset gate; the others' gates are the sums.
            hidden_gates = torch.stack([next(found) for _ in range(steps)]) if module.mode == "GRU" else input_gates
            grads["weight_ih" + suffix] = factored("weight_ih", input_gates, layer_input)
            grads["weight_hh" + suffix] = factored("weight_hh", hidden_gates, previous)
            if module.bias:
                grads["bias_ih" + suffix] = DenseGrads(input_gates.sum(0))
                grads["bias_hh" + suffix] = DenseGrads(hidden_gates.sum(0))
            if unprojected is not None:
                projected = torch.stack([next(found) for _ in range(steps)])
                grads["weight_hr" + suffix] = factored("weight_hr", projected, unprojected)
        return grads
