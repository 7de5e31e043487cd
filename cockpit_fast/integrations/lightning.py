"""``CockpitCallback`` for the Lightning ``Trainer``, added in one line::

    trainer = lightning.Trainer(callbacks=[CockpitCallback("economy", logpath="logs/run")], accumulate_grad_batches=4)

Each optimizer step is one cockpit step over its ``accumulate_grad_batches`` micro-batches, the
statistics those of the gradient before Lightning clips it (``gradient_clip_val``). Quantities
that need each sample's loss read it from the LightningModule: set ``self.individual_losses``
(one loss per sample, with its graph, whose mean is the loss ``training_step`` returns) in
``training_step``, or name another attribute with ``losses_attribute``. Each tracked step's
numbers are logged with ``pl_module.log`` (every logger of the trainer, at its
``log_every_n_steps``) under ``cockpit/<Quantity>`` names (every parameter's too with
``per_parameter=True``; Alpha and UpdateSize, known one step later, with the next step's);
Lightning divides the loss of an epoch's last, shorter accumulation cycle by
``accumulate_grad_batches`` too, and so the statistics take it. The cockpit's state is saved in the trainer's checkpoints and
restored with them; at the end of training the cockpit's log and dashboard are written to
``logpath``. The cockpit is ``callback.cockpit``.

Works with the ``lightning`` package; :mod:`cockpit_fast.integrations.pytorch_lightning` is the
same callback for the ``pytorch_lightning`` import name.
"""

from lightning.pytorch import Callback

from cockpit_fast.integrations._tracking import lightning_callback

CockpitCallback = lightning_callback(Callback, __name__)
