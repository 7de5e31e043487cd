"""Preset collections of quantities, the same as Cockpit 1.0.2's."""

from cockpit_fast import quantities
from cockpit_fast.utils import schedules

_ECONOMY = [
    quantities.Alpha,
    quantities.Distance,
    quantities.GradHist1d,
    quantities.GradNorm,
    quantities.InnerTest,
    quantities.Loss,
    quantities.NormTest,
    quantities.OrthoTest,
    quantities.UpdateSize,
]
_BUSINESS = _ECONOMY + [quantities.TICDiag, quantities.HessTrace]
_FULL = _BUSINESS + [quantities.HessMaxEV, quantities.GradHist2d]
_CONFIGURATIONS = {"economy": _ECONOMY, "business": _BUSINESS, "full": _FULL}


def quantities_cls_for_configuration(label):
    """Quantity classes of the configuration ``label``: ``"economy"``, ``"business"`` or ``"full"``.

    Raises:
        KeyError: For an unknown label, listing the options.
    """
    try:
        return list(_CONFIGURATIONS[label])
    except KeyError:
        raise KeyError(f"Unknown configuration '{label}'. Available: {list(_CONFIGURATIONS)}") from None


def configuration(label, track_schedule=None, verbose=False):
    """Instantiated quantities of a preset configuration, cheapest to most expensive.

    ``"economy"``: Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest, OrthoTest
    and UpdateSize; ``"business"`` adds TICDiag and HessTrace; ``"full"`` adds HessMaxEV and
    GradHist2d.

    Args:
        label (str): ``"economy"``, ``"business"`` or ``"full"``.
        track_schedule (callable, optional): Schedule of every quantity. Defaults to every step.
        verbose (bool, optional): Verbose quantities. Defaults to ``False``.

    Returns:
        list: The quantities.
    """
    if track_schedule is None:
        track_schedule = schedules.linear(interval=1)
    return [cls(track_schedule=track_schedule, verbose=verbose) for cls in quantities_cls_for_configuration(label)]
