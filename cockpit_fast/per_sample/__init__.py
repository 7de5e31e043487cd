"""The per-sample engine both layers read from: per-sample gradients of any model's parameters.

:mod:`.capture` records the module calls that use tracked parameters; :mod:`.rules` turns a call
of a known layer into closed forms (:mod:`.grads`); :mod:`.generic` replays any other call sample
by sample, or backpropagates every sample's loss through the whole graph where samples interact.
:class:`Engine` (:mod:`.engine`) is the front door: which of these routes serves each parameter.
"""

from cockpit_fast.per_sample import attention, recurrent  # noqa: F401 (file the attention and recurrent layers' rules)
from cockpit_fast.per_sample.capture import Call, Capture, outside_autocast
from cockpit_fast.per_sample.engine import Engine
from cockpit_fast.per_sample.generic import whole_graph_grads
from cockpit_fast.per_sample.grads import (
    CHUNK_VALUES,
    ConvGrads,
    DenseGrads,
    FactoredGrads,
    PerSampleGrads,
    RowGrads,
    combine,
    stats_rows,
)
from cockpit_fast.per_sample.rules import mixes_samples, register_rule, rule_for

__all__ = [
    "CHUNK_VALUES",
    "Call",
    "Capture",
    "ConvGrads",
    "DenseGrads",
    "Engine",
    "FactoredGrads",
    "PerSampleGrads",
    "RowGrads",
    "combine",
    "mixes_samples",
    "outside_autocast",
    "register_rule",
    "rule_for",
    "stats_rows",
    "whole_graph_grads",
]
