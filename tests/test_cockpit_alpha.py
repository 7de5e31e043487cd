"""Alpha against Cockpit 1.0.2: in-backward projections for SGD, stored parameters otherwise."""

import warnings

import pytest
import torch
from backpack import extend

from cockpit_fast import quantities as fast_quantities
from cockpit_fast.cockpit import Cockpit as FastCockpit
from cockpit_fast.quantities.alpha import _alpha
from cockpit_fast.utils import schedules as fast_schedules
from cockpit_fast.utils.training import training_step
from test_cockpit_core import MODELS, ROUTES, assert_same_output, cockpit, one, ref_schedules, side_by_side, train


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("route", ROUTES)
def test_alpha_matches_cockpit(route, optimizer, model_name):
    expected, actual = side_by_side(one("Alpha"), model_name, steps=4, optimizer=optimizer, route=route)
    assert sorted(actual) == [0, 1, 2]
    assert_same_output(actual, expected, rtol=1e-3, atol=1e-5)


def test_alpha_on_a_sparse_schedule_matches_cockpit():
    make = lambda q, s: [q.Alpha(s.linear(3, offset=1))]  # noqa: E731
    expected, actual = side_by_side(make, "cnn", steps=6)
    assert sorted(actual) == [1, 4]
    assert_same_output(actual, expected, rtol=1e-3, atol=1e-5)


def test_alpha_without_optimizer_warns_and_keeps_parameters():
    make = lambda: [fast_quantities.Alpha(fast_schedules.linear(1))]  # noqa: E731
    with pytest.warns(UserWarning, match="No 'optimizer' handed in via info"):
        output, _ = train(FastCockpit, make, "mlp", steps=2, drop_info=("optimizer",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, _ = train(FastCockpit, make, "mlp", steps=2)
    assert_same_output(output, reference, rtol=1e-3, atol=1e-5)


def test_alpha_needs_individual_losses():
    make = lambda: [fast_quantities.Alpha(fast_schedules.linear(1))]  # noqa: E731
    with pytest.raises(KeyError, match="Alpha needs 'individual_losses'"):
        train(FastCockpit, make, "mlp", steps=2, drop_info=("individual_losses",))


def test_alpha_conventions():
    # A zero step cannot be fitted: -1, with Cockpit's warnings.
    with pytest.warns(UserWarning, match="same point"):
        assert _alpha(0.0, [1.0, 1.0], [0.5, 0.5], [0.1, 0.1], [0.1, 0.1]) == -1
    # Concave along the step: -1.
    assert _alpha(1.0, [1.0, 0.0], [-0.5, -1.5], [0.1, 0.1], [0.1, 0.1]) == -1
    # Exact quadratic x² - 2x + 1 from 0 to 1 reaches the minimum: α = 0; to 2 it overshoots: α = 1.
    assert _alpha(1.0, [1.0, 0.0], [-2.0, 0.0], [1.0, 1.0], [1.0, 1.0]) == pytest.approx(0.0, abs=1e-9)
    assert _alpha(2.0, [1.0, 1.0], [-2.0, 2.0], [1.0, 1.0], [1.0, 1.0]) == pytest.approx(1.0, abs=1e-9)
    with pytest.warns(UserWarning, match="variance of f is 0"):
        _alpha(1.0, [1.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [1.0, 1.0])


def _alpha_with_unfittable_losses(cockpit_cls, q, s):
    """Alpha over 3 steps whose individual losses have an infinite variance (no fit possible)."""
    torch.manual_seed(0)
    model, loss_fn = extend(torch.nn.Linear(5, 3)), extend(torch.nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = cockpit_cls(model.parameters(), quantities=[q.Alpha(s.linear(1))])
    unfittable = lambda outputs, labels: torch.tensor([1e200, -1e200, 1e200, -1e200], dtype=torch.float64)  # noqa: E731
    data = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = torch.randn(4, 5, generator=data), torch.randint(0, 3, (4,), generator=data)
        training_step(model, opt, batch, unfittable, loss_fn=loss_fn, cockpit=cp, step=step)
    return dict(cp.get_output())


def test_a_failed_fit_leaves_the_step_out_as_in_cockpit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _alpha_with_unfittable_losses(cockpit.Cockpit, cockpit.quantities, ref_schedules)
        actual = _alpha_with_unfittable_losses(FastCockpit, fast_quantities, fast_schedules)
    assert expected == {} and actual == expected
