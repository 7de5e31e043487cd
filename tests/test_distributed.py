"""Cockpit under torch.distributed: spawned gloo groups on loopback equal one process on the
concatenated batch, whatever each rank's batch size; mismatched ranks fail fast."""

import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from cockpit_fast.distributed import resolve_group
from distributed_training import collect_rows, comparable, run_group, train
from test_cockpit_core import assert_same_output, build_model
from test_cockpit_gradients import EDGE_COUNTS

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

STEPS = 3


def _one_process(config, global_n):
    """The reference: one process training on the concatenated global batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train({**config, "batch_size": global_n})["output"]


@pytest.mark.parametrize(
    "model, rank_sizes, route",
    [
        ("mlp", [4, 4], "auto"),
        ("mlp", [5, 3], "grad_batch"),
        ("cnn", [3, 2, 4], "auto"),
        ("sequence", [2, 5], "auto"),
    ],
    ids=["mlp-equal-factors", "mlp-unequal-grad_batch", "cnn-3-ranks", "sequence-unequal"],
)
def test_every_quantity_equals_one_process_on_the_global_batch(model, rank_sizes, route, tmp_path):
    config = {"model": model, "quantities": "every", "steps": STEPS, "route": route}
    expected = _one_process(config, sum(rank_sizes))
    ranks = run_group(rank_sizes, config, tmp_path)
    for rank, result in enumerate(ranks):
        assert sorted(result["output"]) == list(range(STEPS)) == sorted(expected)
        assert_same_output(
            comparable(result["output"]),
            comparable(expected),
            rtol=1e-4,
            atol=1e-6,
            max_count_diff=EDGE_COUNTS,
            path=f"rank {rank}",
        )
    # The histograms count every sample of the global batch once.
    hist = ranks[0]["output"][0]["GradHist1d"]["hist"]
    n_params = sum(p.numel() for p in build_model(model)[0].parameters())
    assert hist.sum() == sum(rank_sizes) * n_params


def test_accumulation_under_ddp_no_sync_equals_one_process_on_the_global_batch(tmp_path):
    # Each rank accumulates its slice over micro-batches (5 -> 2 + 2 + 1, 3 -> 1 + 1 + 1): a
    # micro-batch is to its rank what a rank is to the global batch.
    config = {"model": "mlp", "quantities": "first_order", "steps": STEPS, "micro_batches": 3}
    expected = _one_process({**config, "micro_batches": None}, 8)
    for rank, result in enumerate(run_group([5, 3], config, tmp_path)):
        assert sorted(result["output"]) == list(range(STEPS)) == sorted(expected)
        assert_same_output(
            comparable(result["output"]), comparable(expected), rtol=1e-4, atol=1e-6,
            max_count_diff=EDGE_COUNTS, path=f"rank {rank}",
        )


def test_alpha_on_sgd_is_not_given_for_a_step_ddp_averaged_otherwise_than_the_global_batch(tmp_path):
    # Unequal batches, DDP's plain average of the ranks' mean gradients (no weighting hook):
    # SGD's update is not -lr times the global batch's mean gradient the statistics read. Step 0
    # says so on every rank; from step 1 on Alpha reads the update from the parameters.
    config = {"model": "mlp", "quantities": "first_order", "steps": STEPS, "plain_average": True}
    ranks = run_group([5, 3], config, tmp_path)
    for result in ranks:
        assert "Alpha" not in result["output"][0] and result["output"][1]["Alpha"] is not None
        assert sum("reduced to another mean than the global batch's" in w for w in result["warnings"]) == 1
    assert_same_output(comparable(ranks[1]["output"]), comparable(ranks[0]["output"]), rtol=0, atol=0, path="rank 1")


def test_a_rank_past_max_kept_bytes_skips_the_quantities_that_wait_on_every_rank(tmp_path):
    # Rank 0's 5 samples outgrow the limit, rank 1's 3 do not: every rank skips what waited for the
    # step's gradient (the ranks used to exchange buffers of other sizes: gloo aborted).
    config = {"model": "mlp", "quantities": "first_order", "steps": STEPS, "micro_batches": 3, "max_kept_bytes": 900}
    expected = _one_process({**config, "micro_batches": None, "max_kept_bytes": None}, 8)
    for rank, result in enumerate(run_group([5, 3], config, tmp_path)):
        for step, values in result["output"].items():
            assert not {"InnerTest", "OrthoTest"} & set(values), f"rank {rank}, step {step}"
            assert {"NormTest", "GradHist1d", "GradNorm"} <= set(values), f"rank {rank}, step {step}"
            kept = {k: v for k, v in expected[step].items() if k in values}
            assert_same_output(
                comparable({step: values}), comparable({step: kept}), rtol=1e-4, atol=1e-6,
                max_count_diff=EDGE_COUNTS, path=f"rank {rank}",
            )


@pytest.mark.parametrize("taken", [3, 0])
@pytest.mark.parametrize("quantities, optimizer", [("first_order", "sgd"), ("alpha_adam", "adam")])
def test_a_parameter_one_rank_does_not_reach_counts_its_samples_as_zeros(quantities, optimizer, taken, tmp_path):
    # A branch only rank 0's samples take (taken = 3), or none (0): rank 1's backward pass never
    # reaches it (DDP with find_unused_parameters), or no rank's does; one backward pass over the
    # global batch counts their zeros. (Before, with 0: "not computed for parameters".)
    config = {"model": "branch", "quantities": quantities, "optimizer": optimizer, "steps": STEPS, "branch_samples": taken}
    expected = _one_process(config, 8)
    for rank, result in enumerate(run_group([3, 5], config, tmp_path)):
        assert sorted(result["output"]) == sorted(expected)
        assert_same_output(
            comparable(result["output"]), comparable(expected), rtol=1e-4, atol=1e-6,
            max_count_diff=EDGE_COUNTS, path=f"rank {rank}",
        )


def test_bin_adaptation_off_the_histogram_schedule_uses_the_global_batch(tmp_path):
    config = {"model": "mlp", "quantities": "adapt_off_schedule", "steps": 5, "route": "auto"}
    expected = _one_process(config, 5)
    for rank, result in enumerate(run_group([2, 3], config, tmp_path)):
        assert sorted(result["output"]) == [0, 3] == sorted(expected)
        assert_same_output(result["output"], expected, max_count_diff=EDGE_COUNTS, path=f"rank {rank}")


def test_histogram_counts_stay_exact_across_processes(tmp_path):
    # Each rank counts fewer than 2^24 values in the one bin, together 2^24 + 8189: a float32 sum
    # would round them.
    config = {"model": "wide", "quantities": "one_bin", "steps": 1, "route": "auto"}
    for result in run_group([2050, 2049], config, tmp_path):
        output = result["output"][0]
        assert output["GradHist1d"]["hist"].tolist() == [4099 * 4095]
        assert output["GradHist2d"]["hist"].tolist() == output["GradHist2d"]["param_0"]["hist"].tolist() == [[4099 * 4095]]


def test_per_sample_values_cover_the_global_batch(tmp_path):
    """NormTest reads every sample's norm: a rank's own samples alone would give another value."""
    config = {"model": "mlp", "quantities": "every", "steps": 1}
    ranks = run_group([6, 2], config, tmp_path)
    shard_alone = _one_process(config, 6)[0]["NormTest"]
    assert not np.isclose(ranks[0]["output"][0]["NormTest"], shard_alone, rtol=1e-3)


def test_hessian_max_eigenvalue_from_combined_hessian_vector_products(tmp_path):
    # DDP's reducer fails under create_graph=True (an in-place op on a leaf's graph-carrying
    # gradient), so the ranks average their gradients themselves here.
    config = {"model": "mlp", "quantities": "hessian_max_ev", "steps": 2, "sync": "manual"}
    expected = _one_process(config, 7)
    for result in run_group([4, 3], config, tmp_path):
        for step in expected:
            assert np.isclose(result["output"][step]["HessMaxEV"], expected[step]["HessMaxEV"], rtol=1e-2)


def test_only_rank_zero_writes_the_log_and_the_dashboard(tmp_path):
    config = {"model": "mlp", "quantities": "every", "steps": 2, "plot": True}
    written = [r["written"] for r in run_group([2, 2], config, tmp_path)]
    assert written == [["cockpit__primary.png", "log.json"], []]


def test_every_rank_writes_its_own_log_and_dashboard_when_asked(tmp_path):
    config = {"model": "mlp", "quantities": "every", "steps": 2, "log_all_ranks": True, "plot": True}
    written = [r["written"] for r in run_group([2, 2], config, tmp_path)]
    assert written == [
        ["cockpit_rank0__primary.png", "log_rank0.json"],
        ["cockpit_rank1__primary.png", "log_rank1.json"],
    ]


def test_a_streamed_log_s_rows_are_the_same_on_every_rank(tmp_path):
    # Rank 0 writes the log and reads its rows back from it, with info['optimizer']'s learning rate.
    config = {"model": "mlp", "quantities": "every", "steps": 2, "stream": True}
    ranks = run_group([2, 2], config, tmp_path)
    assert ranks[1]["written"] == [] and "streamed.json" in ranks[0]["written"]
    for step, row in ranks[0]["output"].items():
        assert sorted(ranks[1]["output"][step]) == sorted(row) and "learning_rate" in row
    as_logged = lambda v: {k: as_logged(x) for k, x in v.items()} if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v  # noqa: E731
    assert_same_output(as_logged(comparable(ranks[1]["output"])), as_logged(comparable(ranks[0]["output"])), rtol=0, atol=0, path="rank 1")


def test_steps_that_read_no_batch_exchange_nothing(tmp_path):
    config = {"model": "mlp", "quantities": "time_only", "steps": 2}
    for result in run_group([2, 3], config, tmp_path):
        assert sorted(result["output"]) == [0, 1]


def test_a_rank_that_raises_fails_the_group_fast(tmp_path):
    config = {"model": "mlp", "quantities": "every", "steps": 3, "fail_on_rank": 1}
    started = time.monotonic()
    with pytest.raises(ProcessException):  # rank 1's error, or rank 0's on losing its peer
        run_group([2, 2], config, tmp_path)
    assert time.monotonic() - started < 50  # not the 60 s collective timeout
    assert "rank 1 fails on purpose" in (tmp_path / "error1.txt").read_text()


@pytest.mark.parametrize("sync", ["ddp", "manual"])
def test_a_cockpit_on_rank_0_alone_is_told_which_processes_did_not_come(sync, tmp_path):
    # The others train on, untracked: before, rank 0's first exchange met their next step's
    # collectives and both waited out the group's timeout with gloo's "Timed out waiting ... for recv".
    config = {"model": "mlp", "quantities": "every", "steps": 3, "sync": sync, "cockpit_on_rank0_only": True,
              "first_meeting_seconds": 2, "collective_timeout_on_rank0": 8}
    started = time.monotonic()
    with pytest.raises(ProcessException):
        run_group([2, 2], config, tmp_path)
    assert time.monotonic() - started < 40  # rank 0's 8 s, not rank 1's 60 s
    told = (tmp_path / "error0.txt").read_text()
    assert "has waited 8 s before its first exchange for the cockpits of processes [1] (global ranks)" in told
    assert "every process of the group makes the cockpit" in told


def test_a_process_late_to_the_first_exchange_is_waited_for_with_a_warning(tmp_path):
    # Without DDP nothing holds rank 0 back before its first exchange: rank 1 comes 4 s after it.
    config = {"model": "mlp", "quantities": "every", "steps": 2, "sync": "manual", "late_rank1_seconds": 4,
              "first_meeting_seconds": 1}
    ranks = run_group([2, 2], config, tmp_path)
    assert sorted(ranks[0]["output"]) == [0, 1]
    said = [w for w in ranks[0]["warnings"] if "before its first exchange" in w]
    assert len(said) == 1 and "has waited 1 s" in said[0] and "processes [1]" in said[0] and "waiting on" in said[0]
    assert not any("before its first exchange" in w for w in ranks[1]["warnings"])


def test_ranks_tracking_different_quantities_are_told(tmp_path):
    config = {"model": "mlp", "quantities": "every", "steps": 1, "quantities_on_rank1": "alpha_adam"}
    with pytest.raises(Exception, match="every rank must track the same"):
        run_group([2, 2], config, tmp_path)


def test_ranks_tracking_different_parameters_are_told(tmp_path):
    # Without DDP (which compares the models itself): the first exchange would mismatch in size.
    config = {"model": "mlp", "model_on_rank1": "branch", "quantities": "first_order", "steps": 1, "sync": "none"}
    with pytest.raises(Exception, match="track different quantities or parameters"):
        run_group([2, 2], config, tmp_path)


def test_ranks_on_different_steps_are_told(tmp_path):
    # Without DDP nothing else would pair the ranks' steps: step 0 would meet step 1.
    config = {"model": "mlp", "quantities": "every", "steps": 1, "sync": "none", "step_offset_on_rank1": 1}
    with pytest.raises(Exception, match="or different steps: every rank must track the same"):
        run_group([2, 2], config, tmp_path)


@pytest.mark.parametrize("route, micro_batches", [("auto", None), ("grad_batch", None), ("auto", 2)])
def test_alpha_with_adam_keeps_each_rank_s_gradients_and_equals_one_process(route, micro_batches, tmp_path):
    # Not plain SGD: each rank keeps its own individual gradients until the update is known (of
    # each of its micro-batches, projected once at the end).
    config = {"model": "mlp", "quantities": "alpha_adam", "steps": 4, "optimizer": "adam", "route": route, "micro_batches": micro_batches}
    expected = _one_process({**config, "micro_batches": None}, 8)
    for result in run_group([3, 5], config, tmp_path):
        assert sorted(result["output"]) == sorted(expected) == [0, 1, 2]
        assert_same_output(result["output"], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimizer, rank0_state", [("adam", False), ("sgd", True)], ids=["adam-own-state", "sgd-rank0-state"])
def test_a_run_restored_from_its_checkpoint_goes_on_as_the_uninterrupted_one(optimizer, rank0_state, tmp_path):
    # With Adam, Alpha keeps each rank's individual gradients: each rank restores its own state.
    # With plain SGD the state is the same in every process: rank 0's serves every rank.
    config = {"model": "mlp", "quantities": "any_optimizer", "steps": 4, "optimizer": optimizer}
    whole = run_group([3, 5], config, tmp_path / "whole")
    resumed = run_group([3, 5], {**config, "restored_after": 2, "rank0_state": rank0_state}, tmp_path / "resumed")
    assert resumed[0]["output"][2]["Alpha"] is not None
    for rank, (expected, got) in enumerate(zip(whole, resumed)):
        assert_same_output(comparable(got["output"]), comparable(expected["output"]), rtol=1e-12, atol=1e-14, path=f"rank {rank}")


def test_rank_0_s_state_holding_its_own_gradients_is_refused_by_rank_1(tmp_path):
    config = {"model": "mlp", "quantities": "alpha_adam", "steps": 3, "optimizer": "adam", "restored_after": 2, "rank0_state": True}
    with pytest.raises(ProcessException):
        run_group([3, 5], config, tmp_path)
    said = (tmp_path / "error1.txt").read_text()
    assert "state was saved by process 0 of 2 and holds that process's own values (of Alpha:" in said
    assert "this is process 1 of 2" in said


def test_gradient_metrics_rows_stay_local_and_the_collector_says_so(tmp_path):
    rank_sizes = [2, 3]
    ranks = run_group(rank_sizes, {"job": "collect"}, tmp_path)
    everything = collect_rows(0, [sum(rank_sizes)])["rows"]  # one process, the whole batch
    torch.testing.assert_close(torch.cat([r["rows"] for r in ranks]), everything)
    for rank, result in enumerate(ranks):
        assert result["rows"].shape[0] == rank_sizes[rank]
        assert any("its own samples only" in message for message in result["warnings"])


def test_single_process_needs_no_group():
    assert resolve_group(None) is None
