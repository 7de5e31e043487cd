"""Diagonal curvature extensions that HessTrace and the TIC quantities can use."""

from backpack import extensions

CURVATURE_EXTENSIONS = {
    "diag_h": extensions.DiagHessian,
    "diag_ggn_exact": extensions.DiagGGNExact,
    "diag_ggn_mc": extensions.DiagGGNMC,
}


def check_curvature(name):
    """Return ``name`` if it is a known curvature; else raise a KeyError listing the options."""
    if name not in CURVATURE_EXTENSIONS:
        raise KeyError(f"Unknown curvature '{name}'. Available: {list(CURVATURE_EXTENSIONS)}")
    return name


def curvature_extension(name):
    """A fresh BackPACK extension computing the diagonal curvature ``name``."""
    return CURVATURE_EXTENSIONS[name]()

