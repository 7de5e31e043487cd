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
    drop_info=(),
    after_backward=None,
    quiet=False,
):
    """One optimizer step of ``model`` on ``batch = (inputs, labels)``, tracked by ``cockpit`` as
    global step ``step`` (``cockpit`` None: a plain step). Returns outputs, loss and individual losses.

    ``individual_loss_fn(outputs, labels)`` gives each sample's loss. The mini-batch loss is
    ``loss_fn(outputs, labels)`` (BackPACK's extended loss, which Cockpit 1.0.2's curvatures need)
    or, without ``loss_fn``, the mean of the individual losses; a plain step with ``loss_fn``
    does not compute individual losses. The cockpit gets ``info`` with the batch size, the
    individual losses, the loss and the optimizer, less the keys in ``drop_info``.
    ``after_backward()`` runs between the backward pass and the optimizer step (e.g. to
    all-reduce gradients by hand); ``quiet`` ignores warnings during the tracked backward pass
    (torch's notices about backward hooks and create_graph).
    Works with cockpit_fast's Cockpit and Cockpit 1.0.2's alike.
    """
    inputs, labels = batch
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
        info = {"batch_size": len(inputs), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        for name in drop_info:
            info.pop(name)
        with warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:
                warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
    if after_backward is not None:
        after_backward()
    optimizer.step()
    return outputs, loss, losses
