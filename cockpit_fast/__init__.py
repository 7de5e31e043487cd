"""cockpit_fast: fused per-sample gradient statistics for Cockpit and gradient-metrics users."""

from cockpit_fast import ops, reference, stats
from cockpit_fast.ops import has_cuda_kernels, has_extension

__version__ = "0.1.0"

__all__ = ["ops", "reference", "stats", "has_extension", "has_cuda_kernels", "__version__"]
