"""Quantities written for Cockpit 1.0.2 run on cockpit_fast's Cockpit once their imports name
cockpit_fast: Cockpit's own quantity modules, ported by rewriting their imports, a custom
quantity that reads ``param.grad_batch``, and users' quantities deriving from Cockpit's bare
``Quantity``, side by side with Cockpit."""

import warnings
from pathlib import Path

import pytest
import torch
from backpack.extensions import BatchGrad

import cockpit_fast.quantities.quantity as fast_base
from cockpit_fast import quantities as fast_quantities
from cockpit_fast.cockpit import Cockpit as FastCockpit
from cockpit_fast.utils import schedules as fast_schedules
from test_cockpit_core import assert_same_output, cockpit, ref_schedules, train

cockpit_base = pytest.importorskip("cockpit.quantities.quantity")

IMPORTS = {"cockpit.quantities.quantity": "cockpit_fast.quantities.quantity", "cockpit.context": "cockpit_fast.context"}


def run_source(source, label, ours):
    """The namespace of ``source``, a module written for Cockpit 1.0.2, run as it is or (``ours``)
    with its imports of the base classes and of ``cockpit.context`` changed to cockpit_fast's."""
    if ours:
        for theirs, fast in IMPORTS.items():
            source = source.replace(f"from {theirs} import", f"from {fast} import")
    namespace = {"__name__": label}
    exec(compile(source, f"<{label}>", "exec"), namespace)
    return namespace


def ported(module, name):
    """Class ``name`` of Cockpit 1.0.2's ``cockpit.quantities.<module>``, its imports of the base
    classes and of ``cockpit.context`` changed to cockpit_fast's, nothing else."""
    source = (Path(cockpit.__file__).parent / "quantities" / f"{module}.py").read_text()
    cls = run_source(source, f"ported_{module}", ours=True)[name]
    assert issubclass(cls, fast_base.Quantity)
    return cls


def written_for_cockpit(source, name):
    """Class ``name`` of ``source`` (a user's module written for Cockpit 1.0.2): as written, and
    with its imports changed to cockpit_fast's."""
    theirs = run_source(source, "users_quantity", ours=False)[name]
    ours = run_source(source, "users_quantity_ported", ours=True)[name]
    assert issubclass(ours, fast_base.Quantity) and not issubclass(theirs, fast_base.FastQuantity)
    return theirs, ours


PORTED = [
    ("grad_norm", "GradNorm"),
    ("loss", "Loss"),
    ("parameters", "Parameters"),
    ("distance", "Distance"),
    ("update_size", "UpdateSize"),
    ("norm_test", "NormTest"),
    ("inner_test", "InnerTest"),
    ("ortho_test", "OrthoTest"),
    ("mean_gsnr", "MeanGSNR"),
    ("tic", "TICDiag"),
    ("tic", "TICTrace"),
    ("cabs", "CABS"),
    ("early_stopping", "EarlyStopping"),
    ("hess_trace", "HessTrace"),
    ("alpha", "Alpha"),
]


def side_by_side(theirs, ours, optimizer="sgd", route="auto"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, their_cp = train(cockpit.Cockpit, theirs, "mlp", steps=4, optimizer=optimizer)
        actual, cp = train(FastCockpit, ours, "mlp", steps=4, optimizer=optimizer, per_sample_route=route)
    assert buffers_left(cp) == buffers_left(their_cp)  # none, or what a quantity protects
    return expected, actual


def buffers_left(cp):
    return [(i, attr) for i, p in enumerate(cp.params) for attr in vars(p) if attr != "grad"]


@pytest.mark.parametrize("module, name", PORTED, ids=[name for _, name in PORTED])
def test_cockpits_own_quantities_run_ported(module, name):
    cls = ported(module, name)
    schedule = [0, 1, 3].__contains__  # UpdateSize and Distance pair steps 0, 1 and end a pair at 3
    optimizer = "adam" if name == "Alpha" else "sgd"  # Adam: Alpha keeps grad_batch for the next step
    expected, actual = side_by_side(
        lambda: [getattr(cockpit.quantities, name)(schedule)], lambda: [cls(schedule)], optimizer
    )
    assert_same_output(actual, expected, rtol=1e-4)


def test_cockpits_own_quantities_run_ported_together():
    """Their BatchGradTransformsHooks are merged, as Cockpit merges them (each would replace the
    others' ``grad_batch_transforms``)."""
    names = [("norm_test", "NormTest"), ("inner_test", "InnerTest"), ("ortho_test", "OrthoTest"), ("tic", "TICDiag")]
    classes = [ported(module, name) for module, name in names]
    expected, actual = side_by_side(
        lambda: [getattr(cockpit.quantities, name)(ref_schedules.linear(1)) for _, name in names],
        lambda: [cls(fast_schedules.linear(1)) for cls in classes],
    )
    assert_same_output(actual, expected, rtol=1e-4)


def test_two_transforms_of_one_name_are_an_error():
    from cockpit.quantities.utils_transforms import BatchGradTransformsHook

    from cockpit_fast.quantities.quantity import merged_hooks

    def same(t):
        return t

    merged = merged_hooks([BatchGradTransformsHook({"x": same}), BatchGradTransformsHook({"x": same, "y": same})])
    assert len(merged) == 1 and merged[0]._transforms == {"x": same, "y": same}
    with pytest.raises(ValueError, match="Two different grad_batch transforms are named 'x'"):
        merged_hooks([BatchGradTransformsHook({"x": same}), BatchGradTransformsHook({"x": lambda t: t})])


def grad_batch_max(base, protect=False):
    """A custom quantity written against ``base`` (Cockpit's quantity module, or cockpit_fast's):
    asks for BackPACK's BatchGrad and reads ``param.grad_batch``; ``protect``: keeps it."""

    class GradBatchMax(base.SingleStepQuantity):
        def extensions(self, global_step):
            return [BatchGrad()] if self.should_compute(global_step) else []

        def protected_savefields(self, global_step):
            return {"grad_batch"} if protect else set()

        def _compute(self, global_step, params, batch_loss):
            return [p.grad_batch.abs().amax() for p in params] + [batch_loss]

    return GradBatchMax


@pytest.mark.parametrize("route", ["auto", "grad_batch"])
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "with_builtins"])
def test_a_custom_quantity_reading_grad_batch(alone, route):
    """Alone, its grad_batch is freed after tracking. Next to built-in quantities (whose hook
    frees grad_batch in Cockpit, and whose statistics may come from factors here) it protects
    grad_batch, as Cockpit needs, and it stays on the parameters in both."""

    def make(q, s, base):
        if alone:
            return [grad_batch_max(base)(s.linear(1))]
        return [grad_batch_max(base, protect=True)(s.linear(1)), q.GradHist1d(s.linear(2)), q.NormTest(s.linear(1))]

    expected, actual = side_by_side(
        lambda: make(cockpit.quantities, ref_schedules, cockpit_base),
        lambda: make(fast_quantities, fast_schedules, fast_base),
        route=route,
    )
    assert_same_output(actual, expected, max_count_diff=3)
    assert len(actual[0]["GradBatchMax"]) == 5  # four parameters, the loss


def test_context_outside_tracking_is_a_clear_error():
    from cockpit_fast.context import get_batch_size

    with pytest.raises(KeyError, match="Please hand in 'batch_size' via cockpit"):
        get_batch_size(0)


# Quantities a user derives from Cockpit's bare ``Quantity``, each written once for Cockpit 1.0.2.
BARE_COMPUTE = """
from backpack.extensions import BatchGrad

from cockpit.quantities.quantity import Quantity


class GradBatchL1(Quantity):
    def extensions(self, global_step):
        return [BatchGrad()] if self.should_compute(global_step) else []

    def should_compute(self, global_step):
        return self._track_schedule(global_step)

    def compute(self, global_step, params, batch_loss):
        per_sample = sum(p.grad_batch.flatten(start_dim=1).abs().sum(1) for p in params)
        return global_step, per_sample * batch_loss
"""

# Overrides track itself and has no should_compute, which only Cockpit's own track calls.
BARE_TRACK = """
from backpack.extensions import BatchL2Grad

from cockpit.quantities.quantity import Quantity


class EvenStepNorms(Quantity):
    def extensions(self, global_step):
        return [BatchL2Grad()] if global_step % 2 == 0 else []

    def track(self, global_step, params, batch_loss):
        if global_step % 2 == 0:
            self.output[global_step] = {"loss": batch_loss.item(), "batch_l2": [p.batch_l2.tolist() for p in params]}
"""

BARE_HOOK = """
from backpack.extensions import BatchGrad

from cockpit.quantities.quantity import Quantity
from cockpit.quantities.utils_transforms import BatchGradTransformsHook


def abs_max(grad_batch):
    return grad_batch.flatten(start_dim=1).abs().amax(1)


class GradBatchAbsMax(Quantity):
    def extensions(self, global_step):
        return [BatchGrad()] if self.should_compute(global_step) else []

    def extension_hooks(self, global_step):
        return [BatchGradTransformsHook({"abs_max": abs_max})] if self.should_compute(global_step) else []

    def should_compute(self, global_step):
        return self._track_schedule(global_step)

    def compute(self, global_step, params, batch_loss):
        return global_step, [p.grad_batch_transforms["abs_max"] for p in params]
"""


BARE = [
    (BARE_COMPUTE, "GradBatchL1", [0, 2, 3]),
    (BARE_TRACK, "EvenStepNorms", [0, 2]),
    (BARE_HOOK, "GradBatchAbsMax", [1, 2]),
]


@pytest.mark.parametrize("source, name, steps", BARE, ids=["compute", "track", "extension_hooks"])
def test_a_quantity_deriving_from_cockpits_bare_quantity_runs_unchanged(source, name, steps):
    """``should_compute`` and ``compute``, or its own ``track(global_step, params, batch_loss)``,
    or an extension hook: the same output as under Cockpit."""
    theirs, ours = written_for_cockpit(source, name)
    expected, actual = side_by_side(lambda: [theirs(steps.__contains__)], lambda: [ours(steps.__contains__)])
    assert_same_output(actual, expected)
    assert sorted(actual) == steps
