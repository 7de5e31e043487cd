"""The rule of ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``: per-sample gradients from the recurrence unrolled.

The fused recurrent ops show neither their gates nor the outputs of their inner layers, and
``torch.func.vmap`` batches them by a loop over samples. The rule runs the call's recurrence
again, a step at a time, from its input and initial state (the layer's weights as constants),
keeping its gates, and backpropagates the call's output gradients through it by hand, once for
the whole batch (Opacus's ``DPLSTM`` decomposition; by hand because autograd's graph of a
Python loop costs a node per operation and step, several times the arithmetic at these sizes).
Each sample's gradient is then a sum over its steps of what a Linear applied at every step
would get, from the gradient ``dz_t`` of the step's gate pre-activations:

    weight_ih = sum_t dz_t x_t^T,   weight_hh = sum_t dz_t h_{t-1}^T,   bias_ih = bias_hh = sum_t dz_t

as :class:`~cockpit_fast.per_sample.grads.FactoredGrads` over the steps. A GRU's reset gate
multiplies ``W_hn h + b_hn``, so its hidden gates get their own gradient (``r_t * dn_t`` in the
n part); an LSTM's projection gets ``weight_hr = sum_t dh_t u_t^T`` from the projected state's
gradient and the unprojected state ``u_t``. Packed sequences run padded, each sample's state
held past its last step. Unbatched inputs and dropout between layers in training mode (masks
that cannot be drawn again) are left to the generic route.

Each backward step needs only the elementwise derivatives of its gates, computed for all steps
at once after the forward run (``_coefficients``): a step then takes one matrix product and a
few products by those coefficients.
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from cockpit_fast.per_sample.grads import DenseGrads, FactoredGrads
from cockpit_fast.per_sample.rules import register_rule


@register_rule(nn.RNN, nn.GRU, nn.LSTM, raw=True, reads_outputs=True)
def recurrent(module, args, kwargs, outputs, output_grads, sample_dim):
    """``{name: form}`` of every parameter of the layer, or None for a call it leaves to the
    generic route. The samples' dimension follows ``module.batch_first`` (``h_n`` and ``c_n``
    hold them along dimension 1 either way), so ``sample_dim`` is not needed. ``outputs`` (or
    None) give the last layer's states: its gates then come from batched products."""
    inputs = {**dict(zip(("input", "hx"), args)), **kwargs}
    given, hx = inputs.get("input"), inputs.get("hx")
    packed = isinstance(given, PackedSequence)
    count = 3 if module.mode == "LSTM" else 2  # output, h_n and, for an LSTM, c_n
    if not (packed or (isinstance(given, torch.Tensor) and given.dim() == 3)) or len(output_grads) != count:
        return None  # unbatched, or a call whose outputs do not all require grad
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return None  # dropout between the layers: masks that cannot be drawn again
    if all(grad is None for grad in output_grads):
        return None
    output_grad, h_grad, c_grad = [*output_grads, None][:3]
    output = None if outputs is None else outputs[0]
    if packed:  # padded, time first, the samples in the caller's order
        x, lengths = pad_packed_sequence(PackedSequence(given.data.detach(), *given[1:]))
        mask = (torch.arange(x.shape[0], device=x.device).unsqueeze(1) < lengths.to(x.device)).unsqueeze(2)
        padded = lambda data: pad_packed_sequence(PackedSequence(data, *given[1:]))[0]  # noqa: E731
        output_grad = None if output_grad is None else padded(output_grad)
        output = None if output is None else padded(output)
    else:
        x, mask = given.detach(), None
        if module.batch_first:
            time_first = lambda t: None if t is None else t.transpose(0, 1)  # noqa: E731
            x, output_grad, output = time_first(x), time_first(output_grad), time_first(output)
    # Under autocast the rule computes in one dtype, its input's (the narrowest of the call's
    # inputs and output gradients: the CPU runs a GRU in float32, an LSTM in bfloat16), with
    # autocast off: F.linear would compute in bfloat16 beside a float32 state.
    h0, c0 = (None if state is None else state.to(x.dtype) for state in _initial_states(module, hx, x))
    if output is not None:
        output = output.to(x.dtype)
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        return _backpropagated(module, x, h0, c0, mask, output, output_grad, h_grad, c_grad)


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


def _backpropagated(module, x, h0, c0, mask, output, output_grad, h_grad, c_grad):
    """``{name: form}``: every layer and direction run forward (the last layer's states read
    from the call's ``output`` where given), then backward from the last layer down, each
    layer's input gradient the output gradient of the one below."""
    directions = 2 if module.bidirectional else 1
    cell_cls = {"LSTM": _LSTMCell, "GRU": _GRUCell}.get(module.mode, _RNNCell)
    size = module.proj_size or module.hidden_size
    cells, layer_input = [], x
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            cells.append(cell_cls(module, f"_l{layer}" + ("_reverse" if direction else ""), layer_input, mask))
            known = None if output is None or layer < module.num_layers - 1 else output[..., direction * size : (direction + 1) * size]
            outputs.append(cells[-1].run(h0[k], None if c0 is None else c0[k], known))
        layer_input = torch.cat(outputs, 2)
    grads, above = {}, output_grad
    for layer in reversed(range(module.num_layers)):
        below = None
        for direction in range(directions):
            k = layer * directions + direction
            cell = cells[k]
            own = None if above is None else above[..., direction * size : (direction + 1) * size]
            cell.backward(own, None if h_grad is None else h_grad[k], None if c_grad is None else c_grad[k])
            grads.update(cell.forms())
            if layer:
                below = cell.input_grad() if below is None else below + cell.input_grad()
        above = below
    return grads


class _Cell:
    """One layer and direction of a call (``suffix``, e.g. ``_l1_reverse``): :meth:`run` goes
    forward (every step at once from the outputs where they are known, else a step at a time)
    and keeps what the backward pass needs; :meth:`backward` gives the
    gradients ``gate_grads`` of the gate pre-activations (those of the hidden gates
    ``hidden_grads`` where they differ, a GRU's) from the gradients of its outputs and final
    states."""

    def __init__(self, module, suffix, layer_input, mask):
        weight = lambda name: getattr(module, name + suffix).detach().to(layer_input.dtype)  # noqa: E731
        self.module, self.suffix, self.x = module, suffix, layer_input
        self.w_ih, self.w_hh = weight("weight_ih"), weight("weight_hh")
        self.b_ih, self.b_hh = (weight("bias_ih"), weight("bias_hh")) if module.bias else (None, None)
        steps = layer_input.shape[0]
        self.order = range(steps - 1, -1, -1) if suffix.endswith("_reverse") else range(steps)
        self.mask = mask  # (T, N, 1), True up to each sample's last step; None: every step
        self.goes_on = mask if mask is None else mask.to(layer_input.dtype)  # the same in 0 and 1

    def _held(self, t, new, old):
        """The state after step ``t``: ``new`` where the sample's sequence goes on, else ``old``."""
        return new if self.mask is None else torch.where(self.mask[t], new, old)

    def _split(self, t, grad):
        """``(grad into the step's new state, grad carried past it to the state before)``."""
        if self.mask is None:
            return grad, None
        into = grad * self.goes_on[t]
        return into, grad - into

    def _known(self, outputs, initial):
        """The layer's ``outputs`` as the loop holds them: ``initial`` before a sample's first
        step where it runs backwards in time (a padded output is zero there)."""
        return outputs if self.mask is None else torch.where(self.mask, outputs, initial)

    def _previous(self, outputs, initial):
        """``(T, N, size)``: the state each step starts from, in time order."""
        if self.order[0] == 0:
            return torch.cat([initial.unsqueeze(0), outputs[:-1]])
        return torch.cat([outputs[1:], initial.unsqueeze(0)])

    def input_grad(self):
        """The gradient of the layer's input ``(T, N, I)``."""
        return self.gate_grads @ self.w_ih

    def forms(self):
        def factored(name, left, right):  # sums over the steps; the factors samples first
            return FactoredGrads(left.transpose(0, 1), right.transpose(0, 1), getattr(self.module, name + self.suffix).shape)

        hidden_grads = getattr(self, "hidden_grads", self.gate_grads)
        grads = {
            "weight_ih" + self.suffix: factored("weight_ih", self.gate_grads, self.x),
            "weight_hh" + self.suffix: factored("weight_hh", hidden_grads, self.previous),
        }
        if self.b_ih is not None:
            grads["bias_ih" + self.suffix] = DenseGrads(self.gate_grads.sum(0))
            grads["bias_hh" + self.suffix] = DenseGrads(hidden_grads.sum(0))
        return grads


class _RNNCell(_Cell):
    """``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, act tanh or relu."""

    def run(self, h, c, known=None):
        """The layer's outputs ``(T, N, H)``: ``known``, or computed a step at a time."""
        initial = h
        if known is None:
            bias = None if self.b_ih is None else self.b_ih + self.b_hh
            inputs = F.linear(self.x.contiguous(), self.w_ih, bias)
            outputs = torch.empty_like(inputs)
            activation = torch.tanh if self.module.mode == "RNN_TANH" else torch.relu
            for t in self.order:
                h = outputs[t] = self._held(t, activation(torch.addmm(inputs[t], h, self.w_hh.T)), h)
        else:
            outputs = self._known(known, initial)
        self.outputs, self.previous = outputs, self._previous(outputs, initial)
        return outputs

    def backward(self, output_grad, h_grad, c_grad):
        # The activation's derivative from its output (where a sample has ended the held
        # state stands in: its gradient is zero there).
        slope = 1 - self.outputs**2 if self.module.mode == "RNN_TANH" else (self.outputs > 0).to(self.outputs.dtype)
        self.gate_grads = grads = torch.empty_like(slope)
        dh = torch.zeros_like(slope[0]) if h_grad is None else h_grad
        for t in reversed(self.order):
            dh = dh if output_grad is None else dh + output_grad[t]
            into, carried = self._split(t, dh)
            torch.mul(into, slope[t], out=grads[t])
            dh = grads[t] @ self.w_hh if carried is None else torch.addmm(carried, grads[t], self.w_hh)


class _GRUCell(_Cell):
    """``r, z = sigmoid(...)``, ``n = tanh(W_in x + b_in + r (W_hn h + b_hn))``,
    ``h_t = n + z (h_{t-1} - n)``."""

    def run(self, h, c, known=None):
        """The layer's outputs ``(T, N, H)``: from ``known`` ones every step's gates at once,
        else a step at a time."""
        inputs = F.linear(self.x.contiguous(), self.w_ih, self.b_ih)
        size = inputs.shape[2] // 3
        self.reset_update = torch.empty_like(inputs[..., : 2 * size])
        self.candidate = torch.empty_like(inputs[..., :size])
        initial = h
        if known is not None:
            outputs = self._known(known, initial)
            self.previous = self._previous(outputs, initial)
            hidden = F.linear(self.previous, self.w_hh, self.b_hh)  # W_hh h + b_hh of each step
            self._gates(inputs, hidden, self.reset_update, self.candidate)
        else:
            hidden = torch.empty_like(inputs)
            outputs = torch.empty_like(self.candidate)
            for t in self.order:
                if self.b_hh is None:
                    torch.mm(h, self.w_hh.T, out=hidden[t])
                else:
                    torch.addmm(self.b_hh, h, self.w_hh.T, out=hidden[t])
                r_z, n = self._gates(inputs[t], hidden[t], self.reset_update[t], self.candidate[t])
                h = outputs[t] = self._held(t, torch.addcmul(n, r_z[:, size:], h - n), h)
            self.previous = self._previous(outputs, initial)
        self.hidden_n = hidden[..., 2 * size :].clone()  # all the backward pass reads of W_hh h + b_hh
        return outputs

    @staticmethod
    def _gates(inputs, hidden, reset_update, candidate):
        """r and z into ``reset_update``, n into ``candidate`` (any leading dimensions)."""
        size = candidate.shape[-1]
        r_z = torch.add(inputs[..., : 2 * size], hidden[..., : 2 * size], out=reset_update).sigmoid_()
        n = torch.addcmul(inputs[..., 2 * size :], r_z[..., :size], hidden[..., 2 * size :], out=candidate).tanh_()
        return r_z, n

    def backward(self, output_grad, h_grad, c_grad):
        r, z = self.reset_update.chunk(2, 2)
        n = self.candidate
        steps, samples, size = n.shape
        # The gates' gradients: first d(pre-activations of r, z, n) / d h_t (s (1 - s) as
        # s - s s, in place: no temporaries), then each step's times the gradient into h_t.
        self.gate_grads = n.new_empty(steps, samples, 3 * size)
        gates = self.gate_grads.view(steps, samples, 3, size)
        d_r, d_z, d_n = gates.unbind(2)
        torch.mul(n, n, out=d_n).neg_().add_(1).addcmul_(d_n, z, value=-1)  # (1 - n n) (1 - z)
        torch.addcmul(r, r, r, value=-1, out=d_r).mul_(self.hidden_n).mul_(d_n)
        torch.sub(self.previous, n, out=d_z).mul_(z).addcmul_(d_z, z, value=-1)  # (h - n) (z - z z)
        dh = torch.zeros_like(n[0]) if h_grad is None else h_grad
        del n, self.candidate, self.hidden_n  # read no more: not held through the loop's allocations
        self.hidden_grads = torch.empty_like(self.gate_grads)
        hidden = self.hidden_grads.view(steps, samples, 3, size)
        for t in reversed(self.order):
            dh = dh if output_grad is None else dh + output_grad[t]
            into, carried = self._split(t, dh)
            gates[t].mul_(into.unsqueeze(1))
            # The hidden gates' are the gates' but n's, which r scales.
            hidden[t, :, :2].copy_(gates[t, :, :2])
            torch.mul(gates[t, :, 2], r[t], out=hidden[t, :, 2])
            direct = into * z[t] if carried is None else torch.addcmul(carried, into, z[t])
            dh = torch.addmm(direct, self.hidden_grads[t], self.w_hh)


class _LSTMCell(_Cell):
    """``i, f, o = sigmoid(...)``, ``g = tanh(...)``, ``c_t = f c_{t-1} + i g``,
    ``h_t = o tanh(c_t)`` (then ``W_hr h_t`` with a projection)."""

    def run(self, h, c, known=None):
        """The layer's outputs ``(T, N, H)``: from ``known`` ones every step's gates at once
        (then only the cells' sums a step at a time), else everything a step at a time."""
        bias = None if self.b_ih is None else self.b_ih + self.b_hh  # added once for every step
        inputs = F.linear(self.x.contiguous(), self.w_ih, bias)
        steps, samples, size = inputs.shape[0], inputs.shape[1], inputs.shape[2] // 4
        self.w_hr = getattr(self.module, "weight_hr" + self.suffix).detach().to(self.x.dtype) if self.module.proj_size else None
        self.activations = torch.empty_like(inputs)  # sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)
        self.new_cells, self.tanh_cells = (torch.empty_like(inputs[..., :size]) for _ in range(2))
        i, f, g, o = self.activations.chunk(4, 2)
        held_cells, initial_h, initial_c = [None] * steps, h, c
        if known is not None:
            outputs = self._known(known, initial_h)
            self.previous = self._previous(outputs, initial_h)
            pre = torch.addmm(inputs.flatten(0, 1), self.previous.flatten(0, 1), self.w_hh.T)
            self._activate(pre, self.activations.view_as(pre))
            products = i * g
            for t in self.order:
                new_c = torch.addcmul(products[t], f[t], c, out=self.new_cells[t])
                c = held_cells[t] = self._held(t, new_c, c)
            torch.tanh(self.new_cells, out=self.tanh_cells)
            self.unprojected = o * self.tanh_cells if self.w_hr is not None else None
        else:
            outputs = inputs.new_empty(steps, samples, self.w_hh.shape[1])
            self.unprojected = torch.empty_like(self.new_cells) if self.w_hr is not None else None
            for t in self.order:
                self._activate(torch.addmm(inputs[t], h, self.w_hh.T), self.activations[t])
                new_c = torch.addcmul(i[t] * g[t], f[t], c, out=self.new_cells[t])
                new_h = torch.mul(o[t], torch.tanh(new_c, out=self.tanh_cells[t]))
                if self.w_hr is not None:
                    self.unprojected[t] = new_h
                    new_h = new_h @ self.w_hr.T
                c = held_cells[t] = self._held(t, new_c, c)
                h = outputs[t] = self._held(t, new_h, h)
            self.previous = self._previous(outputs, initial_h)
        self.previous_cells = self._previous(torch.stack(held_cells), initial_c)
        return outputs

    @staticmethod
    def _activate(pre, out):
        """The gates' activations of pre-activations ``pre`` (any leading dimensions) into ``out``."""
        size = pre.shape[-1] // 4
        torch.sigmoid(pre, out=out)
        torch.tanh(pre[..., 2 * size : 3 * size], out=out[..., 2 * size : 3 * size])

    def backward(self, output_grad, h_grad, c_grad):
        i, f, g, o = self.activations.chunk(4, 2)
        tanh_c = self.tanh_cells
        steps, samples, size = tanh_c.shape
        # dz = [dc, dc, dc, du] * these, dc the new cell's gradient and du the unprojected state's;
        # s (1 - s) as s - s s, in place: one pass each
        coefficients = torch.empty_like(self.activations).view(steps, samples, 4, size)
        torch.addcmul(i, i, i, value=-1, out=coefficients[:, :, 0]).mul_(g)
        torch.addcmul(f, f, f, value=-1, out=coefficients[:, :, 1]).mul_(self.previous_cells)
        torch.addcmul(i, i * g, g, value=-1, out=coefficients[:, :, 2])
        torch.addcmul(o, o, o, value=-1, out=coefficients[:, :, 3]).mul_(tanh_c)
        through_h = torch.addcmul(o, o * tanh_c, tanh_c, value=-1)  # d c_t from d u_t
        self.gate_grads = torch.empty_like(self.activations)
        gates = self.gate_grads.view(steps, samples, 4, size)
        self.projected_grads = torch.empty_like(self.previous) if self.w_hr is not None else None
        dh = torch.zeros_like(self.previous[0]) if h_grad is None else h_grad
        dc = torch.zeros_like(tanh_c[0]) if c_grad is None else c_grad
        for t in reversed(self.order):
            dh = dh if output_grad is None else dh + output_grad[t]
            into_h, carried_h = self._split(t, dh)
            into_c, carried_c = self._split(t, dc)
            du = into_h
            if self.w_hr is not None:
                self.projected_grads[t] = into_h
                du = into_h @ self.w_hr
            new_c = torch.addcmul(into_c, du, through_h[t])
            torch.mul(new_c.unsqueeze(1), coefficients[t, :, :3], out=gates[t, :, :3])
            torch.mul(du, coefficients[t, :, 3], out=gates[t, :, 3])
            dc = new_c * f[t] if carried_c is None else torch.addcmul(carried_c, new_c, f[t])
            dh = self.gate_grads[t] @ self.w_hh if carried_h is None else torch.addmm(carried_h, self.gate_grads[t], self.w_hh)

    def forms(self):
        grads = super().forms()
        if self.w_hr is not None:
            grads["weight_hr" + self.suffix] = FactoredGrads(
                self.projected_grads.transpose(0, 1), self.unprojected.transpose(0, 1), self.w_hr.shape
            )
        return grads
