"""Alpha against Cockpit 1.0.2: in-backward projections for SGD, stored parameters otherwise."""

import contextlib
import warnings

import pytest
import torch
from backpack import extend

from cockpit_fast import per_sample
from cockpit_fast import quantities as fast_quantities
from cockpit_fast.cockpit import Cockpit as FastCockpit
from cockpit_fast.quantities import alpha as alpha_module
from cockpit_fast.quantities.alpha import _alpha
from cockpit_fast.utils import schedules as fast_schedules
from cockpit_fast.utils.training import training_step
from test_cockpit_core import (
    MODELS, ROUTES, assert_same_output, build_model, cockpit, one, ref_schedules, side_by_side, train,
)


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


def test_with_adam_alpha_keeps_factors_as_a_copy_where_they_hold_fewer_bytes_than_formed():
    from cockpit_fast.per_sample.grads import DenseGrads, FactoredGrads, held_bytes
    from cockpit_fast.statistics import GRAD_BATCH, compute_statistics

    torch.manual_seed(0)
    # 600 values a sample formed, against factors of 50 values a position: one and two positions
    # are copied (projected in closed form), sixteen (800 values a sample) formed.
    forms = {positions: FactoredGrads(torch.randn(4, positions, 30), torch.randn(4, positions, 20), (30, 20)) for positions in (1, 2, 16)}
    for positions, form in forms.items():
        direction = torch.randn(form.shape)
        expected = torch.einsum("nij,ij->n", form.dense(), direction)
        kept = compute_statistics(0, torch.zeros(form.shape), form, {GRAD_BATCH})[GRAD_BATCH]
        form.left.mul_(2)  # the tensors it was made of change in place (a buffer reused): not what was kept
        torch.testing.assert_close(kept.dot(direction), expected, rtol=1e-5, atol=1e-5)
        if positions < 16:
            [copy] = kept.forms
            assert isinstance(copy, FactoredGrads) and held_bytes(copy) < 4 * 600 * 4
            assert copy.left.data_ptr() != form.left.data_ptr()
        else:
            assert [type(f) for f in kept.forms] == [DenseGrads]


def test_alpha_keeps_embedding_rows_only_where_they_hold_fewer_bytes_than_formed():
    """The rows' int64 sample and row indices count in what they hold; formed, each value takes
    the rows' own dtype."""
    from cockpit_fast.per_sample.grads import Kept, RowGrads

    ids = torch.tensor([[0, 1], [2, 3]])  # 2 samples of a (4, 2) float32 table: 64 bytes formed
    two_lookups = RowGrads.from_lookups(ids, torch.randn(2, 2, 2), 4)  # 4 rows: 32 + 2 * 32 bytes
    one_lookup = RowGrads.from_lookups(ids[:, :1], torch.randn(2, 1, 2), 4)  # 2 rows: 16 + 2 * 16
    assert not Kept.pays(two_lookups) and Kept.pays(one_lookup)


def test_alpha_with_adam_reads_what_the_start_step_saw_when_the_input_buffer_is_reused():
    """The per-sample gradients a step keeps for Alpha do not change with the input batch's buffer
    (a data loader writing each batch into one tensor)."""

    def run(reuse):
        torch.manual_seed(0)
        model, _ = build_model("mlp")  # a Linear layer's factors, the input batch among them, are kept
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        cp = FastCockpit(model.parameters(), quantities=[fast_quantities.Alpha(fast_schedules.linear(1))])
        data, buffer = torch.Generator().manual_seed(1), torch.empty(8, 10)
        for step in range(3):
            inputs, labels = torch.randn(8, 10, generator=data), torch.randint(0, 4, (8,), generator=data)
            batch = (buffer.copy_(inputs) if reuse else inputs), labels
            training_step(model, opt, batch, torch.nn.CrossEntropyLoss(reduction="none"), cockpit=cp, step=step)
        return cp.get_output()

    fresh, reused = run(reuse=False), run(reuse=True)
    assert sorted(fresh) == [0, 1] and all(isinstance(fresh[s]["Alpha"], float) for s in fresh)
    assert_same_output(reused, fresh, rtol=1e-12, atol=0)


@pytest.mark.parametrize("chunks", ["one chunk", "several chunks"])
@pytest.mark.parametrize("route", ROUTES)
def test_alpha_with_adam_beside_a_histogram_matches_cockpit(route, chunks, monkeypatch):
    """At a step that ends one α and starts the next, the start's kept individual gradients are
    projected, not the step's own, also where the histogram forms the step's in one fused pass,
    and once, not once per chunk of formed gradients."""
    if chunks == "several chunks":
        monkeypatch.setattr(per_sample.grads, "CHUNK_VALUES", 40)
    make = lambda q, s: [q.Alpha(s.linear(1)), q.GradHist1d(s.linear(1))]  # noqa: E731
    expected, actual = side_by_side(make, "sequence", steps=4, optimizer="adam", route=route)
    assert sorted(step for step in actual if "Alpha" in actual[step]) == [0, 1, 2]
    assert_same_output(actual, expected, rtol=1e-3, atol=1e-5)



class _Optimizers:
    """Adam on the model's parameters, as one optimizer or two (each owning some of them, the
    same updates: Adam updates each parameter alone), stepped ``steps_each`` times a step."""

    def __init__(self, params, split, steps_each=1, make=torch.optim.Adam):
        params = list(params)
        groups = [params[:1], params[1:]] if split else [params]
        self.parts = [make(group, lr=0.01) for group in groups]
        self.steps_each = steps_each

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()

    def step(self):
        for _ in range(self.steps_each):
            for part in self.parts:
                part.step()


class _Lookahead(torch.optim.Optimizer):
    """A wrapper (as timm's and torch_optimizer's Lookahead) that steps Adam, then, every second
    step, moves the parameters to its slow weights: the update is that of both."""

    def __init__(self, params, lr):
        self.base = torch.optim.Adam(params, lr=lr)
        self.param_groups, self.defaults, self.state, self.steps = self.base.param_groups, {}, {}, 0
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._patch_step_function()
        self.slow = [p.detach().clone() for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        self.base.step()
        self.steps += 1
        if self.steps % 2 == 0:
            for slow, p in zip(self.slow, (p for group in self.param_groups for p in group["params"])):
                slow.add_(p - slow, alpha=0.5)
                p.copy_(slow)


class _AdamStepsThroughItsBase(torch.optim.Adam):
    """torch runs the step hooks around each patched class's step: calling Adam's step runs
    them twice for one update."""

    def step(self, closure=None):
        return super().step(closure)


def _alpha_with_adam(split=False, steps_each=1, make=torch.optim.Adam, under=contextlib.nullcontext, before_forward=None):
    """Alpha over 4 steps of the sequence model with ``make``'s optimizer, each step in the
    context ``under()``; ``before_forward(alpha)`` as the model is called."""
    torch.manual_seed(0)
    model, input_shape = build_model("sequence")
    opt = _Optimizers(model.parameters(), split, steps_each, make)
    alpha = fast_quantities.Alpha(fast_schedules.linear(1))
    cp = FastCockpit(model.parameters(), quantities=[alpha])
    if before_forward is not None:
        model[0].register_forward_pre_hook(lambda *_: before_forward(alpha))
    data = torch.Generator().manual_seed(1)
    losses = torch.nn.CrossEntropyLoss(reduction="none")
    for step in range(4):
        inputs, labels = torch.randn(8, *input_shape, generator=data), torch.randint(0, 4, (8,), generator=data)
        with under():
            opt.zero_grad()
            individual = losses(model(inputs), labels)
            with cp(step, info={"batch_size": 8, "individual_losses": individual, "loss": individual.mean()}):
                individual.mean().backward()
            opt.step()
    return cp.get_output()


def _at_the_end(monkeypatch):
    """The kept individual gradients projected at the end of the next tracked step, as before
    the optimizer's step was watched."""
    monkeypatch.setattr(alpha_module._StartPoint, "_watch_optimizer", lambda self, params: None)


@pytest.mark.filterwarnings("ignore:No 'optimizer' handed in")
def test_with_adam_the_kept_individual_gradients_are_let_go_before_the_next_forward_pass(monkeypatch):
    """An optimizer owning every tracked parameter steps: the start's individual gradients are
    projected at the next module call and let go, not held through that forward pass and its
    backward pass; α is the same as projecting them at the end of the next step (Cockpit
    1.0.2's values: test_alpha_matches_cockpit). Two optimizers, each owning part of the
    parameters: nothing watched steps them all, they are projected at the end."""
    held = []
    watch = lambda alpha: held.append([s.grad_batch is not None for s in alpha._starts._entries.values()])  # noqa: E731
    projected = _alpha_with_adam(before_forward=watch)
    assert held == [[]] + [[False]] * 3
    held.clear()
    split = _alpha_with_adam(split=True, before_forward=watch)
    assert held == [[]] + [[True]] * 3
    _at_the_end(monkeypatch)
    at_the_end = _alpha_with_adam()
    assert sorted(projected) == [0, 1, 2] and all(isinstance(projected[s]["Alpha"], float) for s in projected)
    assert_same_output(projected, at_the_end, rtol=1e-12, atol=0)
    assert_same_output(split, at_the_end, rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore:No 'optimizer' handed in")
@pytest.mark.parametrize(
    "loop",
    ["two optimizer steps a step", "Lookahead", "a subclass stepping through Adam", "each step under bf16 autocast"],
)
def test_alpha_with_the_update_known_before_the_next_forward_pass_is_alpha_at_the_end(loop, monkeypatch):
    """Whatever happens between the tracked step and the next forward pass is the update, as
    when the end projects: more optimizer steps, a wrapper's changes after the optimizer it
    wraps has stepped, the hooks run twice for one step, the caller's autocast (the projection
    computes in the kept gradients' dtype)."""
    kwargs = {
        "two optimizer steps a step": {"steps_each": 2},
        "Lookahead": {"make": _Lookahead},
        "a subclass stepping through Adam": {"make": _AdamStepsThroughItsBase},
        "each step under bf16 autocast": {"under": lambda: torch.autocast("cpu", dtype=torch.bfloat16)},
    }[loop]
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # Adam's own step patched, for the subclass
    projected = _alpha_with_adam(**kwargs)
    _at_the_end(monkeypatch)
    at_the_end = _alpha_with_adam(**kwargs)
    assert sorted(projected) == [0, 1, 2] and all(isinstance(projected[s]["Alpha"], float) for s in projected)
    assert_same_output(projected, at_the_end, rtol=1e-12, atol=0)


def test_alpha_with_sgd_takes_a_tensor_learning_rate_beside_a_float_one():
    # (torch's optimizers take tensor learning rates; foreach's scalar lists take numbers only)
    def alpha(first_rate):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": first_rate}, {"params": model[2].parameters(), "lr": 0.05}])
        cp = FastCockpit(list(model.parameters()), quantities=[fast_quantities.Alpha(fast_schedules.linear(1))])
        data = torch.Generator().manual_seed(1)
        for step in range(3):
            inputs, labels = torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data)
            opt.zero_grad()
            individual = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
            with cp(step, info={"batch_size": 8, "individual_losses": individual, "loss": individual.mean(), "optimizer": opt}):
                individual.mean().backward()
            opt.step()
        return cp.get_output()

    expected = alpha(0.1)
    assert sorted(expected) == [0, 1]
    assert_same_output(alpha(torch.tensor(0.1)), expected, rtol=1e-6, atol=0)


def _alpha_of(make_optimizers, told=0, after_block=None, steps=(0, 1), every=1, inside=False):
    """Alpha over ``2 * every + 1`` steps of a small MLP, tracked every ``every`` steps, whose
    ``make_optimizers(model)`` all step (after ``after_block(model)``; ``inside``: inside the
    ``with`` block, after the backward pass), the cockpit told of optimizer ``told`` (None: of
    none, so it keeps the parameters: exact for any update); ``steps``: those with a value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    optimizers = make_optimizers(model)
    cp = FastCockpit(list(model.parameters()), quantities=[fast_quantities.Alpha(fast_schedules.linear(every))])
    data = torch.Generator().manual_seed(1)
    for step in range(2 * every + 1):
        inputs, labels = torch.randn(8, 6, generator=data, dtype=torch.float64), torch.randint(0, 3, (8,), generator=data)
        individual = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
        info = {"batch_size": 8, "individual_losses": individual, "loss": individual.mean()}
        if told is not None:
            info["optimizer"] = optimizers[told]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "No 'optimizer' handed in")
            with cp(step, info=info):
                individual.mean().backward()
                if inside:
                    _step(model, optimizers, after_block)
        if not inside:
            _step(model, optimizers, after_block)
        for opt in optimizers:
            opt.zero_grad()
    output = cp.get_output()
    assert sorted(step for step, values in output.items() if "Alpha" in values) == list(steps)
    return output


def _step(model, optimizers, before=None):
    if before is not None:
        before(model)
    for opt in optimizers:
        opt.step()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_an_optimizer_stepping_inside_the_block_gets_the_alpha_of_one_stepping_after_it(optimizer):
    # The start was observed after the update: Adam's kept parameters were those after it (NaN:
    # "the two observations were at the same point"); SGD's check waited for the next step's
    # gradients ("SGD stepped with another gradient", no value on any step).
    make = lambda model: [optimizer(model.parameters(), lr=0.05)]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_output(_alpha_of(make, inside=True), _alpha_of(make), rtol=1e-9, atol=0)


def test_alpha_with_sgd_that_maximizes_matches_the_kept_parameters():
    # Before: taken as plain SGD, the update -lr g where it is +lr g (-0.27 where -1.0 is right).
    make = lambda model: [torch.optim.SGD(model.parameters(), lr=0.3, maximize=True)]  # noqa: E731
    assert_same_output(_alpha_of(make), _alpha_of(make, told=None), rtol=1e-9, atol=0)


def test_alpha_with_sgd_of_some_parameters_matches_the_kept_parameters():
    # Two optimizers, as a GAN's; the cockpit told of one. Before: a bare KeyError.
    def make(model):
        return [torch.optim.SGD(model[0].parameters(), lr=0.5), torch.optim.SGD(model[2].parameters(), lr=0.1)]

    assert_same_output(_alpha_of(make), _alpha_of(make, told=None), rtol=1e-9, atol=0)


def _sgd(model):
    return [torch.optim.SGD(model.parameters(), lr=0.3)]


def test_alpha_with_sgd_whose_gradient_is_clipped_after_the_block_says_so_then_keeps_parameters():
    # SGD steps with the clipped gradient, not -lr times the step's. Before: a value from that
    # (-0.18 where -0.21 is right).
    clip = lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # noqa: E731
    with pytest.warns(UserWarning, match=r"\[Step 0\] Alpha: SGD stepped with another gradient"):
        clipped = _alpha_of(_sgd, after_block=clip, steps=[1])
    expected = _alpha_of(_sgd, told=None, after_block=clip)
    assert clipped[1]["Alpha"] == pytest.approx(expected[1]["Alpha"], rel=1e-9)


def test_alpha_tracked_every_other_step_keeps_parameters_after_a_clipped_step():
    # Before: the switch to kept parameters read the start one step back, gone on this
    # schedule: every tracked step warned and got no value.
    clip = lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # noqa: E731
    with pytest.warns(UserWarning, match=r"\[Step 0\] Alpha: SGD stepped with another gradient"):
        clipped = _alpha_of(_sgd, after_block=clip, steps=[2], every=2)
    expected = _alpha_of(_sgd, told=None, after_block=clip, steps=[0, 2], every=2)
    assert clipped[2]["Alpha"] == pytest.approx(expected[2]["Alpha"], rel=1e-9)


def test_alpha_takes_a_gradient_changed_by_rounding_alone_for_the_known_update():
    # (DistributedDataParallel's average of the processes' gradients rounds otherwise than the
    # cockpit's global mean: a clip by 1 on it was taken for a clip, step 0 lost.)
    nudge = lambda model: [p.grad.mul_(1 + 1e-9) for p in model.parameters()]  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_output(_alpha_of(_sgd, after_block=nudge), _alpha_of(_sgd, told=None, after_block=nudge), rtol=1e-7, atol=0)


def test_alpha_with_sgd_whose_gradient_a_clip_leaves_as_it_was_keeps_the_known_update():
    # (A trainer's clip multiplies by 1 where the norm is below the bound: in place, the same values.)
    clip = lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_output(_alpha_of(_sgd, after_block=clip), _alpha_of(_sgd), rtol=0, atol=0)
