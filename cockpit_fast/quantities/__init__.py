"""Quantities tracked by :class:`cockpit_fast.cockpit.Cockpit`, named as in Cockpit 1.0.2."""

from cockpit_fast.quantities.alpha import Alpha
from cockpit_fast.quantities.bin_adaptation import GradAbsMax, NoAdaptation, ParamAbsMax
from cockpit_fast.quantities.cabs import CABS
from cockpit_fast.quantities.distance import Distance
from cockpit_fast.quantities.early_stopping import EarlyStopping
from cockpit_fast.quantities.grad_hist_1d import GradHist1d
from cockpit_fast.quantities.grad_hist_2d import GradHist2d
from cockpit_fast.quantities.grad_noise_scale import GradNoiseScale
from cockpit_fast.quantities.grad_norm import GradNorm
from cockpit_fast.quantities.hess_max_ev import HessMaxEV
from cockpit_fast.quantities.hess_trace import HessTrace
from cockpit_fast.quantities.inner_test import InnerTest
from cockpit_fast.quantities.loss import Loss
from cockpit_fast.quantities.mean_gsnr import MeanGSNR
from cockpit_fast.quantities.norm_test import NormTest
from cockpit_fast.quantities.ortho_test import OrthoTest
from cockpit_fast.quantities.parameters import Parameters
from cockpit_fast.quantities.quantity import FastQuantity, Quantity
from cockpit_fast.quantities.tic_diag import TICDiag
from cockpit_fast.quantities.tic_trace import TICTrace
from cockpit_fast.quantities.time import Time
from cockpit_fast.quantities.update_size import UpdateSize

# Cockpit's 19 quantities in its order, then ours; the base classes and the bin adaptations stay importable here.
__all__ = [
    "Loss",
    "Parameters",
    "Distance",
    "UpdateSize",
    "GradNorm",
    "Time",
    "Alpha",
    "CABS",
    "EarlyStopping",
    "GradHist1d",
    "GradHist2d",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "HessMaxEV",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "MeanGSNR",
    "GradNoiseScale",
]
