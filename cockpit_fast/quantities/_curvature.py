"""Diagonal curvature extensions that HessTrace and the TIC quantities can use, and their results."""

from backpack import extensions

from cockpit_fast.statistics import unreached

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


def diagonal_curvature(ctx, name, quantity):
    """The diagonal curvature ``name`` of every tracked parameter that BackPACK computed for
    ``quantity`` in this step's backward pass.

    Raises:
        ValueError: If BackPACK did not compute it: its extensions run only through the modules
            and the loss function that ``backpack.extend`` prepared.
    """
    try:
        return ctx.curvature(name)
    except AttributeError:  # BackPACK writes its results as attributes of the parameters
        missing = unreached(ctx.params)
        if missing:
            raise ValueError(
                f"{type(quantity).__name__} needs BackPACK's {CURVATURE_EXTENSIONS[name].__name__} of every tracked "
                f"parameter; no backward pass of step {ctx.global_step} reached parameters {missing} (an expert no "
                "token chose, a layer the forward pass skipped): track it over parameters every step uses"
            ) from None
        raise ValueError(
            f"{type(quantity).__name__} needs BackPACK's {CURVATURE_EXTENSIONS[name].__name__} ('{name}'), "
            "which BackPACK did not compute for the tracked parameters: call backpack.extend(model) and "
            "backpack.extend(loss_fn) (the loss function the mini-batch loss comes from) before training"
        ) from None
