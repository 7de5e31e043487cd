"""cockpit_fast: fused per-sample gradient statistics for Cockpit and gradient-metrics users.

``Cockpit``, ``CockpitPlotter`` and ``quantities`` are imported on first use, so that the ops
need neither BackPACK nor matplotlib.
"""

import importlib

from cockpit_fast import ops, reference, stats
from cockpit_fast._optional import require
from cockpit_fast.ops import has_cuda_kernels, has_extension

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

# BackPACK requires torchvision, and PyPI's torchvision wheel brings a CUDA build of torch along.
BACKPACK_ON_CPU = (
    " (on a machine without CUDA, first `pip install torch torchvision --index-url "
    "https://download.pytorch.org/whl/cpu`)"
)

_LAZY = {
    "Cockpit": ("cockpit_fast.cockpit", "Cockpit"),
    "CockpitPlotter": ("cockpit_fast.plotter", "CockpitPlotter"),
    "quantities": ("cockpit_fast.quantities", None),
}

__all__ = ["ops", "reference", "stats", "has_extension", "has_cuda_kernels", "__version__", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'cockpit_fast' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    if name != "CockpitPlotter":  # the Cockpit layer gets per-sample gradients from BackPACK
        require("backpack", "backpack-for-pytorch", f"cockpit_fast.{name}", note=BACKPACK_ON_CPU)
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
