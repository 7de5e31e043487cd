"""The rule of nn.RNN, nn.GRU and nn.LSTM (cockpit_fast/per_sample/recurrent.py): each layer's
per-sample gradients against float64 references in every layout (layers, directions, batch
first or not, initial states, packed sequences), and the quantities and gradient metrics of
recurrent models end to end against the torch.func oracle (tests/test_any_model.py's checks)."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import any_models
import test_any_model
from any_models import CLASSES, VOCAB, WIDTH, class_losses, oracle_grads
from cockpit_fast import quantities
from cockpit_fast.per_sample import Capture, DenseGrads, FactoredGrads, rules
from cockpit_fast.per_sample.recurrent import recurrent
from test_engine import _steps_of_norm_test

N, STEPS, INPUT, HIDDEN, PROJECTED = 4, 6, 3, 5, 2
LENGTHS = {"sorted": [6, 4, 2, 1], "unsorted": [2, 6, 1, 4], "twelve_tokens": [2, 5, 1, 4]}  # packed sequences of unequal lengths

LAYERS = {  # name -> (class, keyword arguments)
    "rnn_tanh": (nn.RNN, {}),
    "rnn_relu": (nn.RNN, {"nonlinearity": "relu"}),
    "gru": (nn.GRU, {}),
    "lstm": (nn.LSTM, {}),
    "lstm_projected": (nn.LSTM, {"proj_size": PROJECTED}),
}

LAYOUTS = {  # name -> (layer keyword arguments, packing, initial state given, eval mode)
    "batch_first": ({"batch_first": True}, None, False, False),
    "time_first_two_layers_bidirectional_initial_state": (
        {"num_layers": 2, "bidirectional": True}, None, True, False,
    ),
    "no_bias_dropout_in_eval_mode": ({"num_layers": 2, "bias": False, "dropout": 0.5}, None, True, True),
    "packed_sorted": ({}, "sorted", True, False),
    "packed_unsorted_batch_first_two_layers_bidirectional": (
        {"num_layers": 2, "bidirectional": True, "batch_first": True}, "unsorted", True, False,
    ),
}


class Recurrent(nn.Module):
    """One recurrent layer given ``(N, T, I)`` inputs, packed or not (``packing``), with a fixed
    initial state or none; returns its output ``(N, T, D * H)`` (zeros past each sample's end)
    and final states."""

    def __init__(self, layer, packing=None, initial_state=False):
        super().__init__()
        self.layer, self.packing = layer, packing
        states = layer.num_layers * (2 if layer.bidirectional else 1)
        h0 = torch.randn(states, N, layer.proj_size or layer.hidden_size)
        c0 = torch.randn(states, N, layer.hidden_size) if isinstance(layer, nn.LSTM) else None
        self.register_buffer("h0", h0 if initial_state else None)
        self.register_buffer("c0", c0 if initial_state else None)

    def forward(self, x):
        batch_first = self.layer.batch_first
        sequences = x if batch_first else x.transpose(0, 1)
        if self.packing:
            lengths = torch.tensor(LENGTHS[self.packing])
            sequences = pack_padded_sequence(sequences, lengths, batch_first, enforce_sorted=self.packing == "sorted")
        # The initial state as a keyword argument: the rule reads the call's kwargs too.
        hx = self.h0 if self.c0 is None else (self.h0, self.c0)
        output, states = self.layer(sequences) if self.h0 is None else self.layer(sequences, hx=hx)
        if self.packing:
            output = pad_packed_sequence(output, batch_first, total_length=STEPS)[0]
        states = states if isinstance(states, tuple) else (states,)
        return (output if batch_first else output.transpose(0, 1), *states)


def _losses(outputs, weights):
    """Each sample's loss: its output through tanh and its final states, weighted at random
    (``weights``: ``(T, D * H)`` for the output, ``(layers * D, size)`` for each state)."""
    output, *states = outputs
    losses = (torch.tanh(output) * weights[0]).sum((1, 2))
    for state, weight in zip(states, weights[1:]):
        losses = losses + (state * weight.unsqueeze(1)).sum((0, 2))
    return losses


def _problem(layer_name, layout, dtype):
    """The model in ``dtype``, an input and a per-sample loss ``losses_of(model, x, y)``."""
    torch.manual_seed(0)
    cls, options = LAYERS[layer_name]
    layer_options, packing, initial_state, eval_mode = LAYOUTS[layout]
    model = Recurrent(cls(INPUT, HIDDEN, **options, **layer_options), packing, initial_state).to(dtype)
    model.train(not eval_mode)
    output, *states = model(torch.zeros(N, STEPS, INPUT, dtype=dtype))
    weights = [torch.randn(output.shape[1:], dtype=torch.float64)]
    weights += [torch.randn(state.shape[0], state.shape[2], dtype=torch.float64) for state in states]
    x = torch.randn(N, STEPS, INPUT, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return model, x, lambda m, inputs, _: _losses(m(inputs), [w.to(inputs.dtype) for w in weights])


def _one_sample_at_a_time(params, losses):
    """Per-sample gradients ``(N, *shape)`` of ``params`` by autograd, one sample's loss at a
    time: the reference where torch.func cannot differentiate the layer (packed sequences)."""
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    return [torch.stack(column) for column in zip(*rows)]


def _reference(model, losses_of, x):
    """float64 per-sample gradients ``{name: (N, *shape)}`` of the layer's parameters."""
    twin = copy.deepcopy(model).double()
    params = dict(twin.layer.named_parameters())
    if twin.packing is None:
        grads = oracle_grads(twin, list(params.values()), losses_of, x.double(), None)
    else:
        grads = _one_sample_at_a_time(list(params.values()), losses_of(twin, x.double(), None))
    return dict(zip(params, grads))


def _rule_forms(model, losses_of, x):
    """``{name: form}`` the capture gives the layer's parameters from one backward pass of the
    summed losses (each sample's own output gradients)."""
    params = dict(model.layer.named_parameters())
    capture = Capture(list(params.values()))
    losses = losses_of(model, x, None)
    capture.arm()
    torch.autograd.grad(losses.sum(), list(params.values()))
    forms, _ = capture.disarm()
    return {name: forms[id(p)] for name, p in params.items()}


def _without_outputs(module, args, kwargs, outputs, output_grads, sample_dim):
    """The rule not given the call's outputs: every layer's gates computed a step at a time."""
    return recurrent(module, args, kwargs, None, output_grads, sample_dim)


_without_outputs.raw, _without_outputs.reads_outputs = True, False


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("outputs_given", [True, False], ids=["outputs_given", "stepwise"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_per_sample_gradients_match_the_reference(monkeypatch, layer_name, layout, outputs_given, dtype):
    model, x, losses_of = _problem(layer_name, layout, dtype)
    expected = _reference(model, losses_of, x)
    if not outputs_given:
        monkeypatch.setitem(rules._RULES, type(model.layer), _without_outputs)
    forms = _rule_forms(model, losses_of, x)
    assert set(forms) == set(expected)
    layers = model.layer.num_layers
    for name, form in forms.items():
        assert isinstance(form, DenseGrads if name.startswith("bias") else FactoredGrads), name
        got = form.dense()
        assert got.dtype == dtype and got.shape == expected[name].shape, name
        # Rounding of every step, carried through the later steps and layers, against the
        # scale of the gradients.
        scale = float(expected[name].abs().max())
        tolerance = 4 * STEPS * layers * torch.finfo(dtype).eps * scale
        torch.testing.assert_close(got.double(), expected[name], rtol=0, atol=tolerance, msg=name)


def _skip_where_torch_cannot_run_it_under_bf16_autocast(layer_type):
    """torch's own LSTM forward under the CPU's bfloat16 autocast needs oneDNN's bfloat16 LSTM,
    which CPUs without AVX-512 lack ("could not create a primitive descriptor")."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer_type(2, 2)(torch.zeros(1, 1, 2))
    except RuntimeError as error:
        pytest.skip(f"torch's own {layer_type.__name__} fails under bfloat16 autocast on this CPU: {str(error).splitlines()[0]}")


@pytest.mark.parametrize(
    "layout", ["batch_first", "time_first_two_layers_bidirectional_initial_state", "packed_unsorted_batch_first_two_layers_bidirectional"]
)
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_per_sample_gradients_under_bf16_autocast_match_one_pass_per_sample(layer_name, layout):
    _skip_where_torch_cannot_run_it_under_bf16_autocast(LAYERS[layer_name][0])
    # The CPU's autocast runs a GRU in float32 and an RNN or LSTM in bfloat16, where F.linear
    # computes in bfloat16: the rule raised on mixed dtypes (a float32 initial state, a GRU's
    # lower layers) before it computed in one dtype with autocast off.
    model, x, losses_of = _problem(layer_name, layout, torch.float32)
    params = dict(model.layer.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = dict(zip(params, _one_sample_at_a_time(list(params.values()), losses_of(model, x, None))))
        forms = _rule_forms(model, losses_of, x)
    for name, form in forms.items():
        # bfloat16's rounding of every step, carried through the later steps and layers
        tolerance = 2 * STEPS * model.layer.num_layers * torch.finfo(torch.bfloat16).eps * float(expected[name].abs().max())
        torch.testing.assert_close(form.dense().float(), expected[name].float(), rtol=0, atol=tolerance, msg=name)


@pytest.mark.parametrize("kind", [nn.GRU, nn.RNN, nn.LSTM])
def test_a_tracked_step_under_bf16_autocast_takes_the_rule(kind):
    # (A GRU's weights took the whole graph with one layer, and its step raised with two.)
    _skip_where_torch_cannot_run_it_under_bf16_autocast(kind)
    from cockpit_fast.cockpit import Cockpit
    from cockpit_fast.utils.configuration import configuration

    torch.manual_seed(0)
    rnn, head = kind(INPUT, HIDDEN, num_layers=2, batch_first=True), nn.Linear(HIDDEN, 3)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    x, y = torch.randn(N, STEPS, INPUT), torch.randint(0, 3, (N,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = nn.functional.cross_entropy(head(rnn(x)[0][:, -1]), y, reduction="none")
    loss = losses.mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": N, "individual_losses": losses, "loss": loss}):
            loss.backward()
    routes = list(cockpit.routes().values())
    assert routes.count(f"module-local: {kind.__name__} rule") == 8 and "whole graph" not in " ".join(routes), routes


def test_calls_the_rule_does_not_cover_are_left_to_the_generic_route():
    unbatched = nn.GRU(INPUT, HIDDEN)
    x = torch.randn(STEPS, INPUT)
    output, _ = unbatched(x)
    assert recurrent(unbatched, (x,), {}, None, [torch.ones_like(output), None], 1) is None
    # Dropout between layers in training mode: masks that cannot be drawn again.
    dropping = nn.LSTM(INPUT, HIDDEN, num_layers=2, dropout=0.5).train()
    x = torch.randn(STEPS, N, INPUT)
    output, _ = dropping(x)
    assert recurrent(dropping, (x,), {}, None, [torch.ones_like(output), None, None], 1) is None
    assert recurrent(dropping.eval(), (x,), {}, None, [torch.ones_like(output), None, None], 1) is not None


class GRUClassifier(nn.Module):
    """Embedding, a GRU batch first, a head on its last output."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.gru = nn.GRU(WIDTH, 6, batch_first=True)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, ids):
        return self.head(self.gru(self.embedding(ids))[0][:, -1])


class BidirectionalLSTMClassifier(nn.Module):
    """Embedding, a two-layer bidirectional LSTM time first, a head on its mean output and
    final states (both directions' ``h_n`` of the last layer, ``c_n`` of the first)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, 5, num_layers=2, bidirectional=True)
        self.head = nn.Linear(25, CLASSES)

    def forward(self, ids):
        output, (h_n, c_n) = self.lstm(self.embedding(ids).transpose(0, 1))
        return self.head(torch.cat([output.mean(0), h_n[-2:].transpose(0, 1).flatten(1), c_n[0]], 1))


class FinalStateLSTMClassifier(nn.Module):
    """Embedding, an LSTM batch first, a head on its last layer's final state ``h_n[-1]`` (whose
    samples run along dimension 1 whatever batch_first says)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, 5, num_layers=2, batch_first=True)
        self.head = nn.Linear(5, CLASSES)

    def forward(self, ids):
        return self.head(self.lstm(self.embedding(ids))[1][0][-1])


class PackedGRUClassifier(GRUClassifier):
    """The GRU classifier over sequences of unequal lengths (id 0 pads), packed unsorted, its
    head on each sample's mean output."""

    def forward(self, ids):
        lengths = (ids != 0).sum(1)
        packed = pack_padded_sequence(self.embedding(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        output = pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=ids.shape[1])[0]
        return self.head(output.sum(1) / lengths.unsqueeze(1).to(output.dtype))


def _padded_tokens(n, gen):
    """Token ids of random lengths from 1 to TOKENS, padded with id 0."""
    ids = any_models._tokens(n, gen)
    lengths = torch.randint(1, ids.shape[1] + 1, (n,), generator=gen)
    return ids * (torch.arange(ids.shape[1]) < lengths.unsqueeze(1))


def _classifier(make, tokens):
    """An entry of any_models.MODELS: a classifier of token sequences made by ``tokens(n, gen)``."""
    labelled = lambda n, gen, dtype: (tokens(n, gen), torch.randint(0, CLASSES, (n,), generator=gen))  # noqa: E731
    return make, labelled, lambda out, x, y: class_losses(out, y)


RECURRENT_MODELS = {  # the rule serves the recurrent layers of these in every route
    "gru": _classifier(GRUClassifier, any_models._tokens),
    "bidirectional_lstm": _classifier(BidirectionalLSTMClassifier, any_models._tokens),
    "final_state_lstm": _classifier(FinalStateLSTMClassifier, any_models._tokens),
}
PACKED = ("packed_gru", _classifier(PackedGRUClassifier, _padded_tokens))


def _oracle_one_sample_at_a_time(model, params, losses_of, x, y, masks):
    """test_any_model's ``_oracle`` for models torch.func cannot differentiate (no masks)."""
    twin = copy.deepcopy(model).double()
    twin_params = dict(twin.named_parameters())
    by_name = {id(p): name for name, p in model.named_parameters()}
    return _one_sample_at_a_time([twin_params[by_name[id(p)]] for p in params], losses_of(twin, x, y))


@pytest.fixture
def recorded(monkeypatch):
    """The recurrent models filed with test_any_model's, and the cockpits and collectors its
    checks make, kept to read their routes."""
    for name, entry in [*RECURRENT_MODELS.items(), PACKED]:
        monkeypatch.setitem(any_models.MODELS, name, entry)
    made = {"Cockpit": [], "GradientMetricCollector": []}
    for name, kept in made.items():
        base = getattr(test_any_model, name)

        def keeping(self, *args, base=base, kept=kept, **kwargs):
            kept.append(self)
            base.__init__(self, *args, **kwargs)

        monkeypatch.setattr(test_any_model, name, type(name, (base,), {"__init__": keeping}))
    return made


def _assert_the_rule_served(routes, name):
    """Every parameter of the recurrent layer of model ``name`` took the layer's rule."""
    layer = next(m for m in any_models.build(name)[0].modules() if isinstance(m, nn.RNNBase))
    served = list(routes.values()).count(f"module-local: {type(layer).__name__} rule")
    assert served == len(list(layer.parameters())), routes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(RECURRENT_MODELS))
def test_quantities_match_the_oracle_through_the_rule(recorded, name, dtype):
    test_any_model._check_quantities(name, dtype, "plain")
    (cockpit,) = recorded["Cockpit"]
    _assert_the_rule_served(cockpit.routes(), name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(RECURRENT_MODELS))
def test_gradient_metrics_match_the_oracle_through_the_rule(recorded, name, dtype):
    test_any_model.test_gradient_metrics_match_the_oracle(name, dtype)
    (collector,) = recorded["GradientMetricCollector"]
    _assert_the_rule_served(collector._engine.routes(), name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_sequences_end_to_end_match_the_oracle(recorded, monkeypatch, dtype):
    # The engine's proof reads the samples from the final states (a packed output's data has
    # none), so the rule serves packed sequences with every sample's loss at hand too.
    monkeypatch.setattr(test_any_model, "_oracle", _oracle_one_sample_at_a_time)
    test_any_model._check_quantities(PACKED[0], dtype, "plain")
    _assert_the_rule_served(recorded["Cockpit"][0].routes(), PACKED[0])
    test_any_model.test_gradient_metrics_match_the_oracle(PACKED[0], dtype)
    _assert_the_rule_served(recorded["GradientMetricCollector"][0]._engine.routes(), PACKED[0])


def test_packed_sequences_without_individual_losses_take_the_rule(recorded):
    model, batch, _ = any_models.build(PACKED[0], torch.float64)
    x, y = batch(test_any_model.N, torch.Generator().manual_seed(1))
    kinds = [quantities.GradNorm, quantities.NormTest, quantities.InnerTest, quantities.OrthoTest]
    tracked = lambda: [kind(test_any_model.EVERY) for kind in kinds]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the whole-graph route's notice
        whole_graph = test_any_model._tracked_step(model, x, y, tracked())
        by_rule = test_any_model._tracked_step(model, x, y, tracked(), info_losses=False)
    _assert_the_rule_served(recorded["Cockpit"][1].routes(), PACKED[0])
    for key, value in whole_graph.items():
        assert by_rule[key] == pytest.approx(value, rel=1e-10), key


class DroppingLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(INPUT, HIDDEN, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def test_dropout_between_layers_in_training_mode_takes_the_whole_graph(recorded):
    x, y = torch.randn(N, STEPS, INPUT), torch.randint(0, CLASSES, (N,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the whole-graph route's notice
        test_any_model._tracked_step(DroppingLSTM(), x, y, [quantities.NormTest(test_any_model.EVERY)])
    assert set(recorded["Cockpit"][0].routes().values()) == {"whole graph", "module-local: Linear rule"}


class CarriedState(nn.Module):
    """A recurrent layer whose final states start its next call, not detached: every backward
    pass goes back through the earlier calls' graphs too (the user keeps them, ``retain_graph``)."""

    def __init__(self, kind):
        super().__init__()
        self.layer, self.head, self.state = kind(INPUT, HIDDEN, batch_first=True), nn.Linear(HIDDEN, CLASSES), None

    def forward(self, x):
        out, self.state = self.layer(x) if self.state is None else self.layer(x, self.state)
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_a_state_carried_across_tracked_steps_without_detach_gets_every_calls_share(kind):
    """A later step's per-sample gradients include the earlier calls' shares, which its backward
    pass reaches through the kept graph. A call with several outputs (the layer's output and
    states) missed them once its step was done (its hook was removed): a GRU's per-sample
    gradients up to a fifth of their scale off, with no warning."""
    torch.manual_seed(0)
    model = CarriedState(kind).double()
    gen = torch.Generator().manual_seed(1)

    def losses_of(step):
        x, y = torch.randn(N, STEPS, INPUT, generator=gen, dtype=torch.float64), torch.randint(0, CLASSES, (N,), generator=gen)
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    cockpit = _steps_of_norm_test(list(model.parameters()), losses_of, steps=3)
    routes = cockpit.routes()
    assert [routes[f"layer.{name}"] for name, _ in model.layer.named_parameters()] == [f"module-local: {kind.__name__} rule"] * 4, routes


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_packed_tokens_as_many_as_a_multiple_of_the_samples_are_not_taken_for_routed_rows(kind):
    """12 tokens packed from 4 sequences: the packed data's rows are tokens whose samples the
    batch sizes tell, not 3 rows of each sample in turn (a crash in the checks' step before)."""
    torch.manual_seed(0)
    model = Recurrent(kind(INPUT, HIDDEN, batch_first=True), packing="twelve_tokens").double()
    weights = [torch.randn(STEPS, HIDDEN, dtype=torch.float64)] + [torch.randn(1, HIDDEN, dtype=torch.float64)] * (2 if kind is nn.LSTM else 1)
    gen = torch.Generator().manual_seed(1)
    cockpit = _steps_of_norm_test(
        list(model.parameters()), lambda step: _losses(model(torch.randn(N, STEPS, INPUT, generator=gen, dtype=torch.float64)), weights)
    )
    assert set(cockpit.routes().values()) == {f"module-local: {kind.__name__} rule"}


@pytest.mark.parametrize("layout", ["batch_first", "time_first_two_layers_bidirectional_initial_state"])
@pytest.mark.parametrize("layer_name", ["gru", "lstm"])
def test_an_output_the_caller_changes_in_place_after_the_checks_step(layer_name, layout):
    """The rule reads the layer's outputs, kept as the call returned them (the same memory): a
    caller's ``output.mul_(1.5)`` after the checks' step changed them too, and the per-sample
    gradients came out 0.1% to 14x off, silently (or the step raised where the change had cut
    the output's hook off). Outputs changed since the call are computed again."""
    model, x, _ = _problem(layer_name, layout, torch.float64)
    gen = torch.Generator().manual_seed(2)

    def losses_of(step):
        output, *states = model(torch.randn(x.shape, generator=gen, dtype=torch.float64))
        if step > 0:
            output.mul_(1.5)
        return output.tanh().sum((1, 2)) + sum(state.square().sum((0, 2)) for state in states)

    cockpit = _steps_of_norm_test(list(model.parameters()), losses_of, steps=3)
    assert set(cockpit.routes().values()) == {f"module-local: {LAYERS[layer_name][0].__name__} rule"}
