""":mod:`cockpit_fast.integrations.lightning`'s ``CockpitCallback`` for the ``pytorch_lightning``
import name (its ``Callback`` is another class than ``lightning``'s)."""

from pytorch_lightning import Callback

from cockpit_fast.integrations._tracking import lightning_callback

CockpitCallback = lightning_callback(Callback, __name__)
