"""Per-sample gradients of every sample's own loss, for the collector.

The collector's :class:`~cockpit_fast.per_sample.Capture` has watched the forward pass, so the
per-sample engine serves every target that a module call used (:func:`per_sample_forms`): one
backward pass of ``loss.sum()`` gives each call its output gradient, which for independent
samples holds each sample's own ``d loss[n] / d output[n]``, and the calls' forms follow
(factors of Linear and ``Conv1D`` weights, embedding rows, replayed calls). A second backward
pass with random positive weights per sample proves the samples independent: its output
gradients must be the first's, weighted sample by sample. What the engine cannot serve exactly
(samples that interact, targets no call captured, calls that cannot be replayed) gets one
``torch.autograd.grad(..., is_grads_batched=True)`` pass over the N rows of the identity: row n
is the gradient of ``loss[n]`` alone, for any graph.
"""

import warnings

import torch

from cockpit_fast.per_sample import DenseGrads
from cockpit_fast.per_sample.capture import mixed_calls
from cockpit_fast.per_sample.generic import refuse_reentrant_checkpoints

_warned = set()


def warn_once(message):
    """Warns about a slow fallback the first time each distinct message comes up."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def per_sample_forms(capture, loss, targets, retain_graph):
    """Per-sample gradients of each ``loss[n]`` with respect to every target.

    Args:
        capture: The :class:`~cockpit_fast.per_sample.Capture` that watched the forward pass.
        loss: Per-sample losses, shape (N,).
        targets: Parameters or other tensors in the graph of ``loss``.
        retain_graph: Whether the graph survives the call.

    Returns:
        dict: ``id(target)`` to its per-sample gradient form, in units of ``∇ loss[n]``.
    """
    forms = _from_calls(capture, loss, targets)
    rest = [t for t in targets if id(t) not in forms]
    if rest:
        rows = torch.eye(loss.shape[0], dtype=loss.dtype, device=loss.device)
        grads = torch.autograd.grad(loss, rest, grad_outputs=rows, is_grads_batched=True, retain_graph=True)
        forms.update({id(t): DenseGrads(g) for t, g in zip(rest, grads)})
    if not retain_graph:  # free the graph as the original's last backward pass would
        torch.autograd.grad(loss, targets, grad_outputs=torch.zeros_like(loss), allow_unused=True)
    return forms


def _from_calls(capture, loss, targets):
    """Forms of the targets the captured module calls give exactly; {} where samples interact."""
    refuse_reentrant_checkpoints(loss)
    if capture.mixing:
        return {}
    n = loss.shape[0]
    capture.arm()
    grads = torch.autograd.grad(loss, targets, torch.ones_like(loss), retain_graph=True, allow_unused=True)
    forms, fired = capture.disarm()
    if not forms:
        return {}
    if mixed_calls(capture, loss, targets, torch.ones_like(loss), reference=fired):
        return {}
    inexact = set()
    for call, _ in fired:
        if call.batch_size != n or (call.needs_replay() and call.replays_randomness()):
            inexact |= {id(p) for p in call.params.values()}
    exact = {}
    for target, grad in zip(targets, grads):
        form = forms.get(id(target))
        if form is None or id(target) in inexact or grad is None:
            continue
        # A target also used outside the calls that captured it: its forms do not add up.
        if id(target) in capture.hooked or _adds_up(form.grad, grad):
            exact[id(target)] = form
    return exact


def _adds_up(summed, grad):
    atol = (1e-5 if grad.dtype != torch.float64 else 1e-12) * float(grad.abs().max()) + 1e-30
    return torch.allclose(summed.to(grad.dtype), grad, rtol=1e-3 if grad.dtype != torch.float64 else 1e-7, atol=atol)
