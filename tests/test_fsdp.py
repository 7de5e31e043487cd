"""Sharded training under FSDP2 (``fully_shard`` per block and at the root), gloo on loopback:
every statistic equals one process on the global batch (float64), whatever each rank's batch
size; FSDP1, DTensors handed to an op and BackPACK's extensions are refused with one clear line."""

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from distributed_training import comparable, run_group
from fsdp_training import collect_rows, train, train_routed
from test_cockpit_core import assert_same_output

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

STEPS = 3


def _one_process(config, rank_sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(config, rank_sizes=rank_sizes)["output"]


@pytest.mark.parametrize(
    "model, rank_sizes, extra",
    [
        ("gpt2", [4, 4], {}),
        ("gpt2", [5, 3], {"optimizer": "adam"}),
        ("llama", [3, 2, 3], {}),
        ("gpt2", [3, 4], {"frozen": True}),
        ("gpt2", [4, 4], {"compile": True}),
        ("gpt2", [4, 4], {"micro_batches": 2}),
        ("gpt2", [5, 3], {"optimizer": "adam", "restored_after": 2}),
        ("gpt2", [4, 4], {"clip": 0.05}),
    ],
    ids=[
        "gpt2-equal", "gpt2-unequal-adam", "llama-3-ranks", "gpt2-frozen-unequal", "gpt2-compiled-blocks",
        "gpt2-accumulated", "gpt2-adam-restored", "gpt2-clipped",
    ],
)
def test_every_statistic_equals_one_process_on_the_global_batch(model, rank_sizes, extra, tmp_path):
    # Loss, GradNorm, MeanGSNR, NormTest, InnerTest, OrthoTest, CABS, EarlyStopping, Alpha,
    # Distance, UpdateSize, Parameters, GradHist1d (adapted), GradHist2d, GradNoiseScale.
    # (restored_after: each rank's cockpit restored from its own state, shards and kept gradients)
    config = {"job": "fsdp", "model": model, "steps": STEPS, **extra}
    expected = _one_process({**config, "compile": False, "micro_batches": None, "restored_after": None}, rank_sizes)
    ranks = run_group(rank_sizes, config, tmp_path)
    assert {"Alpha", "Distance", "UpdateSize", "GradHist2d", "GradNoiseScale", "Parameters"} <= set(expected[1])
    # Float64 models, but Llama's RMSNorm computes in float32: with other batch sizes its numbers
    # differ at float32's rounding (eps 1.2e-7; of parameters of scale 0.02 after a few steps).
    rtol, atol = (1e-5, 1e-8) if model == "llama" else (1e-7, 1e-10)
    if extra.get("optimizer", "sgd") == "sgd" and (len(set(rank_sizes)) > 1 or extra.get("clip")):
        # SGD stepped with another gradient than the global batch's mean (clipped; or FSDP2's
        # average of the ranks' mean gradients): step 0 has no Alpha, later ones read the update.
        assert "Alpha" not in expected[0] and "Alpha" in expected[1]
    for rank, result in enumerate(ranks):
        assert sorted(result["output"]) == list(range(STEPS)) == sorted(expected)
        assert_same_output(
            comparable(result["output"]), comparable(expected), rtol=rtol, atol=atol, path=f"rank {rank}"
        )


def test_a_state_one_process_saved_is_restored_as_each_rank_s_shards(tmp_path):
    # Distance's start and UpdateSize's carried step, saved unsharded, restored sharded.
    config = {"job": "fsdp", "model": "gpt2", "steps": STEPS, "restored_after": 2}
    expected = _one_process({**config, "save_state_to": str(tmp_path / "one.pt")}, [4, 4])
    for rank, result in enumerate(run_group([4, 4], {**config, "state_from": str(tmp_path / "one.pt")}, tmp_path / "ranks")):
        assert "Distance" in result["output"][2] and "UpdateSize" in result["output"][1]  # (of step 1, at step 2)
        assert_same_output(comparable(result["output"]), comparable(expected), rtol=1e-7, atol=1e-10, path=f"rank {rank}")


def test_rank_0_s_shards_are_refused_by_rank_1(tmp_path):
    config = {"job": "fsdp", "model": "gpt2", "steps": 2, "restored_after": 1, "rank0_state": True}
    with pytest.raises(ProcessException):
        run_group([2, 2], config, tmp_path)
    said = (tmp_path / "error1.txt").read_text()
    assert "state was saved by process 0 of 2 and holds that process's own values (of Distance, UpdateSize:" in said


@pytest.mark.parametrize("experts_apart", [False, True], ids=["experts-in-the-root", "experts-sharded-apart"])
def test_a_branch_and_an_expert_some_ranks_samples_skip_give_every_statistic_of_one_process(experts_apart, tmp_path):
    # The engine's own backward passes reach on each rank what its samples took, on the steps
    # its engine decides: the checks of step 0, and at step 1 those of the second expert's first
    # call on the second rank alone. FSDP2's collectives must match all the same (they did not:
    # gloo aborted), also where the experts are a module of FSDP2's own.
    config = {"job": "fsdp_routed", "steps": STEPS, "experts_apart": experts_apart}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = train_routed(config, rank_sizes=[6, 6])["output"]
    ranks = run_group([6, 6], config, tmp_path)
    assert {"Alpha", "Distance", "GradHist1d", "InnerTest", "NormTest", "OrthoTest"} <= set(expected[1])
    for rank, result in enumerate(ranks):
        assert sorted(result["output"]) == list(range(STEPS)) == sorted(expected)
        assert_same_output(comparable(result["output"]), comparable(expected), rtol=1e-7, atol=1e-10, path=f"rank {rank}")


def test_bf16_parameters_and_fp32_reduction_agree_with_float32_within_bf16_rounding(tmp_path):
    config = {"job": "fsdp", "model": "gpt2", "steps": 1, "float32": True}
    expected = _one_process(config, [4, 4])[0]
    got = run_group([4, 4], {**config, "mixed": True}, tmp_path)[0]["output"][0]
    # bf16 rounds to 2^-8 relative: well-conditioned statistics agree to a few of its steps. Left
    # out: the noise scale's per-parameter grad_sq and b_simple, differences of terms up to 30x
    # larger (their error is the terms', not theirs).
    rtol = 4 * 2**-8
    noise = {k: got["GradNoiseScale"][k] for k in ("trace_sigma", "grad_sq", "b_simple", "trace_sigma_per_param")}
    for name in ("Loss", "GradNorm", "MeanGSNR", "NormTest", "InnerTest", "OrthoTest"):
        assert_same_output(got[name], expected[name], rtol=rtol, atol=0, path=name)
    assert_same_output(noise, {k: expected["GradNoiseScale"][k] for k in noise}, rtol=rtol, atol=0, path="GradNoiseScale")


def test_a_bf16_reduction_is_no_other_gradient_to_alpha_s_check_on_sgd(tmp_path):
    # FSDP2's gradient, reduced in bfloat16, is 1e-3 of its norm off the cockpit's global mean:
    # Alpha took it for a gradient changed after the block and gave step 0 no value.
    config = {"job": "fsdp", "model": "gpt2", "steps": 3, "float32": True, "mixed": True, "reduce_bf16": True}
    for result in run_group([4, 4], config, tmp_path):
        assert "Alpha" in result["output"][0] and "Alpha" in result["output"][1]


@pytest.mark.parametrize("model, rank_sizes", [("gpt2", [3, 2]), ("llama", [2, 3])])
def test_collector_rows_are_those_of_each_rank_s_samples(model, rank_sizes, tmp_path):
    expected = collect_rows({"model": model}, rank_sizes=rank_sizes)["rows"]
    ranks = run_group(rank_sizes, {"job": "fsdp_collect", "model": model}, tmp_path)
    torch.testing.assert_close(torch.cat([r["rows"] for r in ranks]), expected, rtol=1e-10, atol=1e-12)
    assert any("rows of its own samples only" in w for w in ranks[0]["warnings"])


@pytest.mark.parametrize("quantities", ["first_order", "parameters"])
def test_a_cockpit_on_rank_0_alone_is_told_before_fsdp2_s_collectives(quantities, tmp_path):
    # Its first collectives come before the step's exchange (the engine's passes agree at entry;
    # UpdateSize and Distance, which read no batch, sum over the shards): the processes meet first.
    config = {"job": "fsdp_rank0", "quantities": quantities, "steps": 2, "first_meeting_seconds": 2,
              "collective_timeout_on_rank0": 8}
    started = time.monotonic()
    with pytest.raises(ProcessException):
        run_group([2, 2], config, tmp_path)
    assert time.monotonic() - started < 40  # rank 0's 8 s, not rank 1's 60 s
    assert "has waited 8 s before its first exchange for the cockpits of processes [1]" in (tmp_path / "error0.txt").read_text()


def test_fsdp1_dtensors_in_ops_and_backpack_extensions_are_refused_clearly(tmp_path):
    said = run_group([1, 1], {"job": "fsdp_refusals"}, tmp_path)[0]
    for way in ("use_orig_params=False", "use_orig_params=True", "wrapped later, use_orig_params=True"):
        assert said[f"fsdp1, {way}"].startswith("the parameters are FullyShardedDataParallel's (FSDP1)"), way
        assert "fully_shard" in said[f"fsdp1, {way}"]
    # (FSDP1's flat parameter leaves the tracked ones unused, and marks none of them)
    unused = said["fsdp1, wrapped later, use_orig_params=False"]
    assert unused.startswith("no backward pass reached the tracked parameters") and "wrapped after the cockpit" in unused
    assert said["op"].startswith("cockpit_fast.batch_l2: g is a DTensor") and "to_local()" in said["op"]
    assert said["curvature"].startswith("TICDiag needs BackPACK's extensions") and "FSDP2" in said["curvature"]


def test_one_foreach_call_or_one_per_tensor_where_shards_stand_beside_plain_tensors(tmp_path):
    # DTensor's foreach ops refuse such a mix: fsdp.each then goes a tensor at a time; the norms
    # of the shards are summed over their processes.
    for rank, said in enumerate(run_group([1, 1], {"job": "fsdp_each"}, tmp_path)):
        assert said["refused in one call"], rank
        for got, expected in zip(said["differences"], said["expected"]):
            assert torch.equal(got, expected), rank
        assert torch.allclose(torch.stack(said["norms"]), torch.stack([e.norm() for e in said["expected"]]), rtol=1e-12), rank



def test_norms_of_shards_on_two_sets_of_processes_are_summed_over_each_one_s_own(tmp_path):
    # One tensor sharded over all 4 ranks, one over each half's 2 (a 1-D submesh): each one's
    # parts are summed over its own processes, one collective for each set.
    for rank, said in enumerate(run_group([1, 1, 1, 1], {"job": "fsdp_meshes"}, tmp_path)):
        expected = torch.stack(said["expected"])
        assert torch.allclose(torch.stack(said["norms"]), expected, rtol=1e-12), rank
        assert torch.allclose(said["summed squares"], expected.square().sum(), rtol=1e-12), rank
