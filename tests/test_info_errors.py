"""What a hurried user gets wrong about a step: ``info`` entries of the wrong type or shape, and
curvature quantities on a model that ``backpack.extend`` never prepared. Each is one clear
TypeError or ValueError naming the entry (or the quantity), what was expected and what was given;
wrong ``info`` is refused at the ``with cockpit(...)`` call, before the backward pass."""

import warnings

import numpy as np
import pytest
import torch
from backpack import extend

from cockpit_fast import Cockpit, quantities
from cockpit_fast.utils.configuration import configuration
from cockpit_fast.utils.schedules import linear
from cockpit_fast.utils.training import training_step

N = 6  # samples per batch


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def batch():
    return torch.randn(N, 4), torch.randint(0, 3, (N,))


def cockpit_and_info():
    """A cockpit with the economy configuration on an extended MLP, and the complete ``info`` of a step."""
    torch.manual_seed(0)
    model = extend(mlp())
    inputs, labels = batch()
    losses = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    info = {"batch_size": N, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
    return Cockpit(model.parameters(), quantities=configuration("economy")), info


# (what the user did, info made from the correct one, exception, what the message says)
WRONG_INFO = [
    ("info a list", lambda info: list(info.values()), TypeError, r"^info must be a dict .*, got list$"),
    ("loss a float", lambda info: {**info, "loss": info["loss"].item()}, TypeError, r"^info\['loss'\] .*tensor.*, got float 1\.\d+$"),
    ("loss of every sample", lambda info: {**info, "loss": info["individual_losses"]}, ValueError, r"^info\['loss'\] must be the scalar .*a tensor of one floating-point element, got .* of shape \(6,\)$"),
    ("loss an integer", lambda info: {**info, "loss": info["loss"].round().long()}, ValueError, r"^info\['loss'\] .*a tensor of one floating-point element, got a int64 tensor of shape \(\)$"),
    ("batch_size a string", lambda info: {**info, "batch_size": "6"}, TypeError, r"^info\['batch_size'\] must be an integer .*, got str '6'$"),
    ("batch_size a float", lambda info: {**info, "batch_size": 6.0}, TypeError, r"^info\['batch_size'\] must be an integer .*, got float 6\.0$"),
    ("batch_size a float tensor", lambda info: {**info, "batch_size": torch.tensor(6.0)}, TypeError, r"^info\['batch_size'\] .*, got a float32 tensor of shape \(\)$"),
    ("batch_size negative", lambda info: {**info, "batch_size": -6}, ValueError, r"^info\['batch_size'\] must be at least 0, got -6$"),
    ("individual_losses a list", lambda info: {**info, "individual_losses": info["individual_losses"].tolist()}, TypeError, r"^info\['individual_losses'\] must be every sample's loss .* as a tensor, got list$"),
    ("individual_losses a numpy array", lambda info: {**info, "individual_losses": info["individual_losses"].detach().numpy()}, TypeError, r"^info\['individual_losses'\] must be every sample's loss .* as a tensor, got numpy\.ndarray$"),
    ("individual_losses a list of tensors", lambda info: {**info, "individual_losses": list(info["individual_losses"])}, TypeError, r"^info\['individual_losses'\] must be every sample's loss .* as a tensor, got list$"),
    ("individual_losses (N, 2)", lambda info: {**info, "individual_losses": info["individual_losses"][:, None].expand(N, 2)}, ValueError, r"^info\['individual_losses'\] .*a tensor of floating point, of shape \(N,\) or \(N, 1\), got .* of shape \(6, 2\)$"),
    ("individual_losses integers", lambda info: {**info, "individual_losses": (10 * info["individual_losses"]).long()}, ValueError, r"^info\['individual_losses'\] .*floating point, of shape \(N,\) or \(N, 1\), got a int64 tensor of shape \(6,\)$"),
    ("individual_losses one number", lambda info: {**info, "individual_losses": info["loss"]}, ValueError, r"^info\['individual_losses'\] .*floating point, of shape \(N,\) or \(N, 1\), got .* of shape \(\)$"),
    ("optimizer a name", lambda info: {**info, "optimizer": "sgd"}, TypeError, r"^info\['optimizer'\] must be a torch\.optim\.Optimizer, got str 'sgd'$"),
    ("optimizer its state", lambda info: {**info, "optimizer": info["optimizer"].state_dict()}, TypeError, r"^info\['optimizer'\] must be a torch\.optim\.Optimizer, got dict$"),
]


@pytest.mark.parametrize("change, error, message", [case[1:] for case in WRONG_INFO], ids=[case[0] for case in WRONG_INFO])
def test_wrong_info_is_refused_at_the_cockpit_call(change, error, message):
    cockpit, info = cockpit_and_info()
    with pytest.raises(error, match=message):
        cockpit(0, info=change(info))


ACCEPTED_INFO = [
    ("loss of one element", lambda info: {**info, "loss": info["loss"].reshape(1)}),
    ("batch_size a NumPy integer", lambda info: {**info, "batch_size": np.int64(N)}),
    ("batch_size a 0-d integer tensor", lambda info: {**info, "batch_size": torch.tensor(N)}),
    ("individual_losses (N, 1)", lambda info: {**info, "individual_losses": info["individual_losses"][:, None]}),
    ("no info", lambda info: None),
    ("entries of the user's own", lambda info: {**info, "note": "anything"}),
]


@pytest.mark.filterwarnings("ignore:No 'optimizer' handed in")  # Alpha's, without info
@pytest.mark.parametrize("change", [case[1] for case in ACCEPTED_INFO], ids=[case[0] for case in ACCEPTED_INFO])
def test_every_accepted_form_of_info_passes_the_cockpit_call(change):
    cockpit, info = cockpit_and_info()
    cockpit(0, info=change(info))


def curvature_step(quantity_list, extended):
    """One tracked step of an MLP that ``backpack.extend`` did not prepare (but for the loss
    function where ``extended`` says so)."""
    torch.manual_seed(0)
    model = mlp()
    loss_fn = torch.nn.CrossEntropyLoss()
    if extended == "the loss function":
        loss_fn = extend(loss_fn)
    if extended == "the model":
        model = extend(model)
    cockpit = Cockpit(model.parameters(), quantities=quantity_list)
    individual_loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    training_step(model, None, batch(), individual_loss_fn, loss_fn=loss_fn, cockpit=cockpit, quiet=True)


@pytest.mark.parametrize("extended", ["nothing", "the loss function"])
@pytest.mark.parametrize("name", ["HessTrace", "TICDiag", "TICTrace"])
def test_a_curvature_without_backpack_extend_names_the_quantity_and_the_fix(name, extended):
    with pytest.raises(ValueError, match=rf"^{name} needs BackPACK's DiagHessian \('diag_h'\).*call backpack\.extend\(model\)"):
        curvature_step([getattr(quantities, name)(linear(1))], extended)


def test_the_business_configuration_without_backpack_extend_says_to_extend():
    with pytest.raises(ValueError, match=r"needs BackPACK's DiagHessian.*backpack\.extend\(model\) and backpack\.extend\(loss_fn\)"):
        curvature_step(configuration("business"), "nothing")


def test_a_curvature_from_a_loss_backpack_did_not_extend_says_to_extend_it():
    # BackPACK's own error: "expects a backpropagation quantity but it is None", from inside.
    with pytest.raises(ValueError, match=r"^HessTrace, TICDiag need BackPACK's curvatures.*extend\(nn\.CrossEntropyLoss\(\)\)"):
        curvature_step(configuration("business"), "the model")


def test_a_model_converted_after_the_first_step_is_refused_naming_the_parameter_and_the_fix():
    # What the quantities keep from step 0 is float32: step 1 crashed in a product of two dtypes.
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    model.double()  # before the first step: nothing kept yet
    losses_of = lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels, reduction="none")  # noqa: E731
    x, y = batch()
    training_step(model, optimizer, (x.double(), y), losses_of, cockpit=cockpit, step=0)
    model.float()
    with pytest.raises(ValueError, match=r"^\[Step 1\] tracked parameter 0 is float32 on cpu, and was float64 on cpu at an earlier step .*convert or move the model before the first tracked step"):
        training_step(model, optimizer, (x, y), losses_of, cockpit=cockpit, step=1)


@pytest.mark.parametrize("steps", [[0, 0], [0, 2, 1]])
def test_a_step_number_that_repeats_or_goes_back_is_warned_of(steps):
    # Its output replaced that step's, and Distance restarted from it, with no word.
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Distance(linear(1)), quantities.GradNorm(linear(1))])
    losses_of = lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels, reduction="none")  # noqa: E731
    for step in steps[:-1]:
        training_step(model, optimizer, batch(), losses_of, cockpit=cockpit, step=step)
    with pytest.warns(RuntimeWarning, match=rf"^\[Step {steps[-1]}\] comes after step {steps[-2]} was tracked: step numbers must grow"):
        training_step(model, optimizer, batch(), losses_of, cockpit=cockpit, step=steps[-1])


def test_a_step_retried_after_its_block_failed_is_no_repeat():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(linear(1))])
    x, y = batch()
    with pytest.raises(ZeroDivisionError):
        with cockpit(0, info={"batch_size": N}):
            1 / 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses_of = lambda outputs, labels: torch.nn.functional.cross_entropy(outputs, labels, reduction="none")  # noqa: E731
        training_step(model, optimizer, (x, y), losses_of, cockpit=cockpit, step=0)
    assert "GradNorm" in cockpit.get_output()[0]
