"""Imports of dependencies that not every use needs: a missing one is one line naming what to install."""

import importlib


class MissingDependency(ImportError):
    """A package that this use of cockpit_fast needs is not installed (the message says which)."""


def require(module, package, purpose, extra=None, note=""):
    """Import and return ``module``; if it is not installed, raise :class:`MissingDependency`.

    Args:
        module (str): Module to import, e.g. ``"matplotlib.figure"``.
        package (str): Distribution that provides it, e.g. ``"scikit-learn"`` for ``sklearn``.
        purpose (str): What needs it, e.g. ``"the dashboard"``.
        extra (str, optional): cockpit-fast's extra that installs it, e.g. ``"demo"``.
        note (str, optional): Appended to the message, e.g. how to install on some machines.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        # The module or a package above it is missing; what an installed package fails to import is its own error.
        if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
            raise
        install = f"pip install {package}" + (f" (or pip install 'cockpit-fast[{extra}]')" if extra else "")
        raise MissingDependency(f"{purpose} needs {package}, which is not installed: {install}{note}") from None
