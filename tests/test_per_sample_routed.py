"""Calls whose rows are not the batch's samples (cockpit_fast/per_sample/routed.py): mixture-of-
experts layers whose experts see the token rows routed to them, and MLPs on flattened token
rows. Their per-sample quantities and gradient metrics against the float64 torch.func oracle
(tests/test_any_model.py's checks), over several steps whose routing changes, with the experts'
layers served module-local; routing the graph does not tell falls back to the whole graph."""

import warnings

import pytest
import torch
from torch import nn

import any_models
import test_any_model
from any_models import CLASSES, VOCAB, WIDTH, class_losses, flat, gradient_tests
from cockpit_fast import Cockpit, quantities

EXPERTS, STEPS = 4, 3


def _expert():
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


class Top1MoE(nn.Module):
    """A router picks one expert per token row; the rows reach it by index and come back by
    ``index_add_``, weighted by the router's probability. Every expert is called, on no rows
    where none is routed to it."""

    def __init__(self, experts=EXPERTS):
        super().__init__()
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList(_expert() for _ in range(experts))

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(rows).softmax(-1).max(-1)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            index = (choice == e).nonzero().squeeze(1)
            out.index_add_(0, index, gate[index, None] * expert(rows[index]))
        return out.reshape(x.shape)


class Top2MoE(Top1MoE):
    """Two experts per token row, their probabilities renormalised; the rows reach an expert by
    a boolean mask and come back by ``index_put_`` with accumulation."""

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        gates, choices = self.router(rows).softmax(-1).topk(2, -1)
        gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            chosen = choices == e
            mask = chosen.any(-1)
            gate = (gates * chosen).sum(-1)[mask]
            out.index_put_((mask.nonzero().squeeze(1),), gate[:, None] * expert(rows[mask]), accumulate=True)
        return out.reshape(x.shape)


class SkippingTop1MoE(Top1MoE):
    """Many experts, each called only where some row is routed to it (as Hugging Face's Mixtral
    calls them): at a step, the backward pass reaches none of the others' parameters."""

    def __init__(self):
        super().__init__(experts=24)

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(rows).softmax(-1).max(-1)
        out = torch.zeros_like(rows)
        for e in choice.unique().tolist():
            index = (choice == e).nonzero().squeeze(1)
            out = out.index_add(0, index, gate[index, None] * self.experts[e](rows[index]))
        return out.reshape(x.shape)


class GatheredMoE(Top1MoE):
    """Rows gathered by ``torch.gather`` and scattered by ``scatter_add``: routing the graph
    does not tell (the whole graph serves the experts)."""

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(rows).softmax(-1).max(-1)
        out = torch.zeros_like(rows)
        for e, expert in enumerate(self.experts):
            index = (choice == e).nonzero().expand(-1, rows.shape[1])
            picked = torch.gather(rows, 0, index)
            out = out.scatter_add(0, index, gate[index[:, 0], None] * expert(picked))
        return out.reshape(x.shape)


class MoEClassifier(nn.Module):
    """Embedding, a residual MoE block, a head on the mean over tokens."""

    def __init__(self, moe):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.moe = moe
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        x = self.embedding(ids)
        return self.head((x + self.moe(x)).mean(1))


class FlatRowsMLP(nn.Module):
    """An MLP on every token row flattened sample-major, ``(N * T, D)``, of token features
    (embedded, or given: ``embedded=False``), or flattened time-major (``time_major``: row
    ``r`` of sample ``r % N``)."""

    def __init__(self, embedded=True, time_major=False):
        super().__init__()
        self.time_major = time_major
        self.embedding = nn.Embedding(VOCAB, WIDTH) if embedded else None
        self.mlp = _expert()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = x if self.embedding is None else self.embedding(x)
        n, t, d = x.shape
        if self.time_major:
            h = self.mlp(x.transpose(0, 1).reshape(-1, d)).reshape(t, n, d).transpose(0, 1)
        else:
            h = self.mlp(x.reshape(-1, d)).reshape(n, t, d)
        return self.head(torch.tanh(h).mean(1))


class ChunkedRowsMLP(FlatRowsMLP):
    """The MLP on the token rows of the batch's samples in two chunks: the first third of the
    samples (a slice), the rest (``torch.split``); each row's sample read through them."""

    def forward(self, ids):
        x = self.embedding(ids)
        n, t, d = x.shape
        k = n // 3
        chunks = (x[:k], torch.split(x, [k, n - k])[1])
        h = torch.cat([self.mlp(chunk.reshape(-1, d)).reshape(-1, t, d) for chunk in chunks])
        return self.head(torch.tanh(h).mean(1))


def _labelled(tokens):
    def batch(n, gen, dtype):
        features = lambda: torch.randn(n, any_models.TOKENS, WIDTH, generator=gen, dtype=dtype)  # noqa: E731
        x = any_models._tokens(n, gen) if tokens else features()
        return x, torch.randint(0, CLASSES, (n,), generator=gen)

    return batch


def _entry(make, tokens=True):
    return make, _labelled(tokens), lambda out, x, y: class_losses(out, y)


MODULE_LOCAL = {  # every parameter served module-local, the experts' and MLP's rows regrouped
    "moe_top1": _entry(lambda: MoEClassifier(Top1MoE())),
    "moe_top2": _entry(lambda: MoEClassifier(Top2MoE())),
    "flat_rows_mlp": _entry(FlatRowsMLP),
    "flat_rows_mlp_of_features": _entry(lambda: FlatRowsMLP(embedded=False), tokens=False),  # sample-major guessed
    "chunked_rows_mlp": _entry(ChunkedRowsMLP),
}
SKIPPING = {"moe_skipping_experts": _entry(lambda: MoEClassifier(SkippingTop1MoE()))}
WHOLE_GRAPH = {  # the experts' or MLP's rows cannot be told apart: the whole graph
    "moe_gathered": _entry(lambda: MoEClassifier(GatheredMoE())),
    "flat_rows_mlp_time_major": _entry(lambda: FlatRowsMLP(embedded=False, time_major=True), tokens=False),
}


@pytest.fixture(autouse=True)
def filed(monkeypatch):
    for name, entry in {**MODULE_LOCAL, **SKIPPING, **WHOLE_GRAPH}.items():
        monkeypatch.setitem(any_models.MODELS, name, entry)


def _regrouped(model):
    """Names of the parameters of the modules called on rows that are not samples."""
    inner = model.moe.experts if isinstance(model, MoEClassifier) else model.mlp
    prefix = "moe.experts." if isinstance(model, MoEClassifier) else "mlp."
    return {prefix + name for name, _ in inner.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", [*MODULE_LOCAL, *WHOLE_GRAPH])
def test_quantities_and_gradient_metrics_match_the_oracle(name, dtype):
    test_any_model._check_quantities(name, dtype, "plain")
    test_any_model.test_gradient_metrics_match_the_oracle(name, dtype)


def _expected(g, hist_range, bins):
    """NormTest, InnerTest, OrthoTest, GradHist1d counts of per-sample gradients ``g`` (N, D)."""
    return gradient_tests(g) | {"GradHist1d": test_any_model._hist1d_expected(g.flatten(), *hist_range, bins)}


def _steps(name, dtype, n=6):
    """``STEPS`` SGD steps of model ``name`` tracked by one cockpit on fresh batches of ``n``
    samples (the routing changes); checks each step's quantities against the oracle. Returns
    the cockpit, the model and the whole-graph warnings."""
    model, batch, losses_of = any_models.build(name, dtype)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    bins = 11
    cockpit = None
    gen = torch.Generator().manual_seed(2)
    rtol = test_any_model.RTOL[dtype]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = batch(n, gen)
            expected_grads = test_any_model._oracle(model, params, losses_of, x, y, {})
            g = flat(expected_grads)
            if cockpit is None:  # the histogram's range from the first step's gradients (later ones clamp)
                largest = float(g.abs().max())
                hist_range = (-0.6 * largest, 0.5 * largest)
                tracked = [
                    quantities.NormTest(test_any_model.EVERY), quantities.InnerTest(test_any_model.EVERY),
                    quantities.GradNorm(test_any_model.EVERY),
                    quantities.GradHist1d(test_any_model.EVERY, bins=bins, range=hist_range),
                ]
                cockpit = Cockpit(params, quantities=tracked)
            test_any_model._step(model, losses_of, x, y, cockpit, step, opt)
            output = cockpit.get_output()[step]
            expected = _expected(g, hist_range, bins)
            for key in ("NormTest", "InnerTest"):
                assert output[key] == pytest.approx(expected[key], rel=rtol), (step, key)
            norms = [float(e.mean(0).norm()) for e in expected_grads]
            assert output["GradNorm"] == pytest.approx(norms, rel=rtol, abs=1e-6 * max(norms)), step
            any_models.assert_counts_close(
                output["GradHist1d"]["hist"], expected["GradHist1d"], [g.flatten()], [output["GradHist1d"]["edges"]],
                slack=0 if dtype == torch.float64 else 1,
            )
    unreached = [str(w.message) for w in caught if "got no gradient" in str(w.message)]
    return cockpit, model, [str(w.message) for w in caught if "whole-graph route" in str(w.message)], unreached


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MODULE_LOCAL))
def test_rows_regrouped_by_sample_over_steps_whose_routing_changes(name, dtype):
    cockpit, model, whole_graph, _ = _steps(name, dtype)
    assert not whole_graph
    routes = cockpit.routes()
    assert "whole graph" not in routes.values(), routes
    regrouped = {key for key, route in routes.items() if route.endswith("rows regrouped by sample")}
    assert regrouped == _regrouped(model) | ({"moe.router.weight", "moe.router.bias"} if "moe" in name else set())


@pytest.mark.parametrize("name", list(MODULE_LOCAL))
def test_rows_with_as_many_features_as_samples_are_not_taken_time_first(name):
    # (rows, WIDTH) with N == WIDTH: taken as time first by their sizes, the experts' calls took
    # the whole graph, and Top1MoE's raised where an expert got no row.
    cockpit, model, whole_graph, _ = _steps(name, torch.float64, n=WIDTH)
    assert not whole_graph and "whole graph" not in cockpit.routes().values(), cockpit.routes()


@pytest.mark.parametrize("name", list(WHOLE_GRAPH))
def test_rows_the_graph_does_not_tell_apart_take_the_whole_graph(name):
    cockpit, model, whole_graph, _ = _steps(name, torch.float64)
    assert whole_graph
    routes = cockpit.routes()
    # (An expert routed no rows at the last step is exact module-local: no sample, zero gradients.)
    whole = {key for key, route in routes.items() if route == "whole graph"}
    assert whole and whole <= _regrouped(model), routes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_experts_no_row_chose_have_zero_gradients_said_once(dtype):
    # Before: every per-sample quantity raised "was not computed for parameters [...]", GradNorm
    # and Alpha "the mini-batch gradient was not computed".
    test_any_model._check_quantities("moe_skipping_experts", dtype, "plain")  # (the collector raises, as the original)
    cockpit, model, whole_graph, unreached = _steps("moe_skipping_experts", dtype)
    assert not whole_graph
    routes = cockpit.routes()
    skipped = {key for key, route in routes.items() if route == "not reached"}
    assert skipped and skipped < _regrouped(model), routes
    assert len(unreached) == 1 and "got no gradient" in unreached[0] and "moe.experts." in unreached[0]


def test_alpha_with_experts_no_row_chose_matches_the_oracle():
    test_any_model.test_alpha_and_two_step_quantities_match_the_oracle("moe_skipping_experts")


def test_a_layout_guessed_without_losses_is_said_of_the_parameters_the_step_reached():
    # T == N without individual losses: the MoE block's call (N, T, WIDTH) is taken batch first,
    # said once. Before: the warning listed the 68 experts' parameters no token chose too, again
    # at the next step.
    torch.manual_seed(0)
    model = MoEClassifier(SkippingTop1MoE()).double()
    cockpit = Cockpit(list(model.parameters()), quantities=[quantities.NormTest(test_any_model.EVERY)])
    gen = torch.Generator().manual_seed(2)
    n = any_models.TOKENS
    said = []
    for step in range(2):
        x, y = any_models._tokens(n, gen), torch.randint(0, CLASSES, (n,), generator=gen)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cockpit(step, info={"batch_size": n, "loss": loss}):
                loss.backward()
        said += [str(w.message) for w in caught if "as many positions as samples" in str(w.message)]
    assert len(said) == 1 and "1 tracked parameter (embedding.weight)" in said[0], said
