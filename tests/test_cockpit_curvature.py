"""TIC, CABS, early stopping, Hessian max eigenvalue and the preset configurations vs Cockpit 1.0.2."""

import pytest
import torch
from backpack import extend

from cockpit_fast import quantities as fast_quantities
from cockpit_fast.cockpit import Cockpit as FastCockpit
from cockpit_fast.utils import configuration as fast_configuration
from cockpit_fast.utils import schedules as fast_schedules
from cockpit_fast.utils.training import training_step
from test_cockpit_core import MODELS, assert_same_output, one, side_by_side, train

ref_configuration = pytest.importorskip("cockpit.utils.configuration")


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", ["TICDiag", "TICTrace"])
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_mc"])
def test_tic_matches_cockpit(name, curvature, model_name):
    expected, actual = side_by_side(one(name, curvature=curvature), model_name, steps=2)
    assert_same_output(actual, expected, rtol=1e-4)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", ["CABS", "EarlyStopping"])
def test_sgd_criteria_match_cockpit(name, model_name):
    expected, actual = side_by_side(one(name), model_name)
    assert_same_output(actual, expected, rtol=1e-4)


@pytest.mark.parametrize("name", ["CABS", "EarlyStopping"])
def test_sgd_criteria_reject_other_optimizers(name):
    make = lambda: [getattr(fast_quantities, name)(fast_schedules.linear(1))]  # noqa: E731
    with pytest.raises(ValueError, match="only supports SGD without momentum"):
        train(FastCockpit, make, "mlp", steps=1, optimizer="momentum")


@pytest.mark.parametrize("model_name", MODELS)
def test_hess_max_ev_matches_cockpit(model_name):
    expected, actual = side_by_side(one("HessMaxEV"), model_name, steps=2)
    assert_same_output(actual, expected, rtol=1e-3)


def test_hess_max_ev_lanczos_agrees_with_power_iteration():
    output, _ = train(FastCockpit, lambda: [fast_quantities.HessMaxEV(fast_schedules.linear(1))], "mlp", steps=1)
    lanczos, _ = train(
        FastCockpit, lambda: [fast_quantities.HessMaxEV(fast_schedules.linear(1), use_power=False)], "mlp", steps=1
    )
    assert lanczos[0]["HessMaxEV"] == pytest.approx(output[0]["HessMaxEV"], rel=1e-2)


@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_configuration_classes_match_cockpit(label):
    ours = [cls.__name__ for cls in fast_configuration.quantities_cls_for_configuration(label)]
    theirs = [cls.__name__ for cls in ref_configuration.quantities_cls_for_configuration(label)]
    assert ours == theirs


def test_unknown_configuration_lists_the_options():
    with pytest.raises(KeyError, match="economy.*business.*full"):
        fast_configuration.configuration("first")


@pytest.mark.parametrize("model_name,label", [("mlp", "full"), ("cnn", "business"), ("sequence", "economy")])
def test_configuration_matches_cockpit(model_name, label):
    def make(q, s):
        module = ref_configuration if q.__name__.startswith("cockpit.") else fast_configuration
        return module.configuration(label, track_schedule=s.linear(1))

    expected, actual = side_by_side(make, model_name, steps=3)
    assert_same_output(actual, expected, rtol=1e-3, atol=1e-5, max_count_diff=3)


def test_hess_max_ev_of_a_float64_model_is_the_hessians_largest_eigenvalue():
    torch.manual_seed(0)
    model, loss_fn = extend(torch.nn.Linear(3, 2).double()), extend(torch.nn.CrossEntropyLoss())
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    cp = FastCockpit(model.parameters(), quantities=[fast_quantities.HessMaxEV(fast_schedules.linear(1))])
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    training_step(model, None, (x, y), individual, loss_fn=loss_fn, cockpit=cp, drop_info=("individual_losses",))
    weight, bias = model.weight.detach(), model.bias.detach()

    def loss_of(flat):
        w, b = flat[:6].reshape(2, 3), flat[6:]
        return torch.nn.functional.cross_entropy(x @ w.T + b, y)

    hessian = torch.autograd.functional.hessian(loss_of, torch.cat([weight.flatten(), bias]))
    largest = torch.linalg.eigvalsh(hessian).max().item()
    assert cp.get_output()[0]["HessMaxEV"] == pytest.approx(largest, rel=1e-3)


@pytest.mark.parametrize("name", ["HessTrace", "TICDiag", "TICTrace", "HessMaxEV"])
def test_curvature_of_a_parameter_no_backward_pass_reached_is_a_clear_error(name):
    # Before: "call backpack.extend(model) and backpack.extend(loss_fn)" (both were) or
    # "needs loss.backward(create_graph=...)" (it was).
    torch.manual_seed(0)
    model, unused = extend(torch.nn.Linear(5, 3)), torch.nn.Linear(5, 3)
    loss_fn, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    params = [*model.parameters(), *unused.parameters()]
    cockpit = FastCockpit(params, quantities=[getattr(fast_quantities, name)(fast_schedules.linear(1))])
    batch = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=r"no backward pass of step 0 reached (tracked )?parameters \[2, 3\]"):
        training_step(model, torch.optim.SGD(params, lr=0.1), batch, individual, loss_fn=loss_fn, cockpit=cockpit)
