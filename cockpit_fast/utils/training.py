"""One training step under a cockpit: the loop the demo, the tests and the benchmarks share."""

import contextlib
import warnings


def training_step(
    model,
    optimizer,
    batch,
    individual_loss_fn,
    *,
    loss_fn=None,
    cockpit=None,
    step=0,
    exts=(),
    drop_info=(),
    after_backward=None,
    quiet=False,
    backward_context=None,
):
    """One optimizer step of ``model`` on ``batch = (inputs, labels)``, tracked by ``cockpit`` as
    global step ``step`` (``cockpit`` None: a plain step; ``optimizer`` None: the model's gradients
    are zeroed and computed, no step is taken). Returns outputs, loss and individual losses.

    ``individual_loss_fn(outputs, labels)`` gives each sample's loss. The mini-batch loss is
    ``loss_fn(outputs, labels)`` (BackPACK's extended loss, which Cockpit 1.0.2's curvatures need)
    or, without ``loss_fn``, the mean of the individual losses; a plain step with ``loss_fn``
    does not compute individual losses. The cockpit gets the user's BackPACK extensions ``exts``
    and ``info`` with the batch size, the individual losses, the loss and the optimizer (if any),
    less the keys in ``drop_info``.
    ``after_backward()`` runs between the backward pass and the optimizer step (e.g. to
    all-reduce gradients by hand); ``quiet`` ignores warnings during the tracked backward pass
    (torch's notices about backward hooks and create_graph); ``backward_context``, a context
    manager, is entered around the tracked backward pass too (e.g. a CUDA sync debug mode).
    Works with cockpit_fast's Cockpit and Cockpit 1.0.2's alike.
    """
    inputs, labels = batch
    if optimizer is None:
        model.zero_grad()
    else:
        optimizer.zero_grad()
    outputs = model(inputs)
    if loss_fn is None:
        losses = individual_loss_fn(outputs, labels)
        loss = losses.mean()
    else:
        loss = loss_fn(outputs, labels)
        losses = None if cockpit is None else individual_loss_fn(outputs, labels)
    if cockpit is None:
        loss.backward()
    else:
        info = {"batch_size": len(inputs), "individual_losses": losses, "loss": loss}
        if optimizer is not None:
            info["optimizer"] = optimizer
        for name in drop_info:
            info.pop(name)
        with contextlib.ExitStack() as around:
            if quiet:
                around.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore")
            if backward_context is not None:
                around.enter_context(backward_context)
            with cockpit(step, *exts, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
    if after_backward is not None:
        after_backward()
    if optimizer is not None:
        optimizer.step()
    return outputs, loss, losses
