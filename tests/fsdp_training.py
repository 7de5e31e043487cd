"""Language models trained under FSDP2 (``fully_shard`` on each block and the root) or in one
process on the global batch, tracked by a cockpit or a gradient-metrics collector (test helper,
run in the ranks of :func:`distributed_training.run_group` with ``config["job"]`` "fsdp" or
"fsdp_collect"); a model whose samples take a branch and experts by their data ("fsdp_routed").

The same model, initial weights and global batches either way: rank r trains on its slice of
each global batch. FSDP2 averages the ranks' gradients, the global batch's mean only for equal
batch sizes: the one-process reference then steps with that average too (``rank_sizes``), so
that both track the same parameters at every step.
"""

import warnings

import torch
import torch.distributed as dist

from cockpit_fast import quantities as q
from cockpit_fast.cockpit import Cockpit
from cockpit_fast.utils import schedules
from cockpit_fast.utils.configuration import configuration
from distributed_training import QUANTITY_SETS, restored

VOCAB, LENGTH = 64, 12


def build_lm(kind):
    """A causal language model from a tiny config (random weights), float64, and its blocks."""
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
        )
        model = LlamaForCausalLM(config)
        blocks = model.model.layers
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0,
        )
        model = GPT2LMHeadModel(config)  # its embedding is tied to the output layer
        blocks = model.transformer.h
    return model.double(), blocks


def quantities(name, sgd=True):
    """The first-order set of the DDP tests and the gradient noise scale (without CABS and
    EarlyStopping, which need plain SGD, unless ``sgd``), or one BackPACK curvature."""
    if name == "curvature":
        return [q.TICDiag(schedules.linear(1))]
    chosen = QUANTITY_SETS["first_order"]() + [q.GradNoiseScale(schedules.linear(1))]
    return [quantity for quantity in chosen if sgd or not isinstance(quantity, (q.CABS, q.EarlyStopping))]


def sharded(model, blocks, config):
    """``model`` under FSDP2 over every process (bf16 parameters with ``config["mixed"]``, reduced
    in bf16 too with ``config["reduce_bf16"]``, blocks compiled with ``config["compile"]``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reduce_dtype = torch.bfloat16 if config.get("reduce_bf16") else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if config.get("mixed") else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
        if config.get("compile"):
            block.compile()
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _losses(model, ids):
    """Each sequence's mean next-token loss (in float32 at least: bf16 logits under mixed precision)."""
    logits = model(ids).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    return shifted.view(ids.shape[0], -1).mean(1)


def _batches(config, rank_sizes):
    data = torch.Generator().manual_seed(1)
    for _ in range(config["steps"]):
        yield torch.randint(0, VOCAB, (sum(rank_sizes), LENGTH), generator=data)


def _accumulated(model, cockpit, step, ids, micro_batches, opt, distributed):
    """One step over ``micro_batches`` micro-batches, as README's accumulation: the step entered
    before the first forward pass (on step 0 before FSDP2 has unsharded any parameter), the
    gradients reduced on the last micro-batch only."""
    parts = ids.chunk(micro_batches)
    with cockpit(step, info={"batch_size": len(ids), "optimizer": opt}) as tracked:
        for index, part in enumerate(parts):
            if distributed:
                model.set_requires_gradient_sync(index == len(parts) - 1)
            losses = _losses(model, part)
            loss = losses.sum() / len(ids)
            tracked.micro_batch(individual_losses=losses, loss=loss)
            loss.backward()


def train(config, rank=0, rank_sizes=None):
    """Train ``config["steps"]`` steps; under ``torch.distributed`` rank ``rank`` takes its
    slice of each global batch. config keys: model, steps, quantities ("first_order",
    "curvature"), optimizer ("sgd", "adam"), frozen (freeze the first block's MLP), mixed,
    compile, float32, micro_batches (accumulated over that many), restored_after and
    rank0_state (as :func:`distributed_training.train`'s), save_state_to (a file the cockpit's
    state goes to then), state_from (a file the cockpit is restored from instead), clip (the
    gradient's norm clipped to it after the block)."""
    distributed = dist.is_initialized()
    model, blocks = build_lm(config["model"])
    if config.get("float32"):
        model = model.float()
    if config.get("frozen"):
        for p in blocks[0].mlp.parameters():
            p.requires_grad_(False)
    if distributed:
        model = sharded(model, blocks, config)
    params = [p for p in model.parameters() if p.requires_grad]
    sgd = config.get("optimizer", "sgd") == "sgd"
    opt = torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.Adam(params, lr=0.01)
    make_cockpit = lambda: Cockpit(params, quantities=quantities(config.get("quantities", "first_order"), sgd))  # noqa: E731
    cockpit = make_cockpit()
    sizes = rank_sizes if distributed else [sum(rank_sizes)]
    start, local_n = sum(sizes[:rank]), sizes[rank]
    for step, batch in enumerate(_batches(config, rank_sizes)):
        ids = batch[start : start + local_n]
        if step == config.get("restored_after"):
            if config.get("save_state_to"):
                torch.save(cockpit.state_dict(), config["save_state_to"])
            cockpit = restored(cockpit, make_cockpit, config.get("rank0_state", False), config.get("state_from"))
        opt.zero_grad()
        if config.get("micro_batches"):
            _accumulated(model, cockpit, step, ids, config["micro_batches"], opt, distributed)
        else:
            losses = _losses(model, ids)
            loss = losses.mean()
            with cockpit(step, info={"batch_size": local_n, "individual_losses": losses, "loss": loss, "optimizer": opt}):
                loss.backward()
        if not distributed and len(set(rank_sizes)) > 1:
            # FSDP2's gradient: the average of the ranks' mean gradients.
            opt.zero_grad()
            slices = torch.split(_losses(model, ids), rank_sizes)
            (sum(part.mean() for part in slices) / len(rank_sizes)).backward()
        if config.get("clip"):
            torch.nn.utils.clip_grad_norm_(params, config["clip"])
        opt.step()
    return {"output": {step: dict(values) for step, values in cockpit.get_output().items()}}


class Experts(torch.nn.Module):
    """Two experts, each called on the rows routed to it only (none where none is)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(12, 4), torch.nn.Linear(12, 4)])

    def forward(self, h, choice):
        out = h.new_zeros(h.shape[0], 4)
        for k, expert in enumerate(self.experts):
            rows = (choice == k).nonzero().squeeze(1)
            if len(rows):
                out = out.index_add(0, rows, expert(h[rows]))
        return out


class Routed(torch.nn.Module):
    """A trunk, experts each sample picks by its second feature's sign, and a branch only the
    samples with a positive first feature take (skipped where none does)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Tanh())
        self.head = torch.nn.Linear(12, 4)
        self.experts = Experts()
        self.branch = torch.nn.Linear(10, 4)

    def forward(self, x):
        h = self.trunk(x)
        out = self.head(h) + self.experts(h, (x[:, 1] > 0).long())
        taken = x[:, 0] > 0
        if taken.any():
            out = out + self.branch(x) * taken[:, None].to(x.dtype)
        return out


def _routed_batches(steps):
    """Global batches of 12: samples 0 to 2 take the branch at every step; the second expert
    is taken by sample 1 at step 0, by samples 1 and 9 at step 1, by samples 2 and 10 at step 2
    (with two ranks of 6 samples: the first rank's samples alone take the branch, and the
    second's take the second expert first at step 1, a call only that rank's engine checks)."""
    data = torch.Generator().manual_seed(1)
    second_expert = [[1], [1, 9], [2, 10]]
    for step in range(steps):
        x = torch.randn(12, 10, generator=data, dtype=torch.float64)
        x[:, 0] = x[:, 0].abs() * torch.where(torch.arange(12) < 3, 1.0, -1.0).double()
        x[:, 1] = -x[:, 1].abs()
        x[second_expert[step], 1] *= -1
        yield x, torch.randint(0, 4, (12,), generator=data)


def train_routed(config, rank=0, rank_sizes=None):
    """:func:`train`'s steps for :class:`Routed` (float64, FSDP2 on the trunk, on the experts
    with ``config["experts_apart"]``, and the root; a parameter none of a rank's samples use is
    reduce-scattered with zeros there), tracking the economy configuration; ranks of equal
    batch sizes (FSDP2 then steps with the global batch's mean)."""
    distributed = dist.is_initialized()
    torch.manual_seed(0)
    model = Routed().double()
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.trunk, mesh=mesh)
        if config.get("experts_apart"):
            fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    sizes = rank_sizes if distributed else [sum(rank_sizes)]
    start, local_n = sum(sizes[:rank]), sizes[rank]
    for step, (x, y) in enumerate(_routed_batches(config["steps"])):
        x, y = x[start : start + local_n], y[start : start + local_n]
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": local_n, "individual_losses": losses, "loss": losses.mean(), "optimizer": opt}):
            losses.mean().backward()
        opt.step()
    return {"output": {step: dict(values) for step, values in cockpit.get_output().items()}}


def collect_rows(config, rank=0, rank_sizes=None):
    """gradient-metrics rows of this rank's samples of one global batch, and the warnings."""
    from cockpit_fast.gradient_metrics import GradientMetricCollector
    from cockpit_fast.gradient_metrics.metrics import Max, MeanStd, PNorm

    distributed = dist.is_initialized()
    model, blocks = build_lm(config["model"])
    if distributed:
        model = sharded(model, blocks, config)
    collector = GradientMetricCollector([Max(model), MeanStd(blocks[0]), PNorm(model, p=2)])
    sizes = rank_sizes if distributed else [sum(rank_sizes)]
    start, local_n = sum(sizes[:rank]), sizes[rank]
    ids = next(_batches({"steps": 1}, rank_sizes))[start : start + local_n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = collector(_losses(model, ids))
    return {"rows": rows.detach(), "warnings": [str(w.message) for w in caught]}


def refusals(config, rank=0, rank_sizes=None):
    """What the cockpit and the ops say to FSDP1's flat parameters and to FSDP2's DTensors."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from cockpit_fast import ops

    said = {}
    for original in (False, True):  # (use_orig_params=True: Lightning's FSDPStrategy's)
        model, blocks = build_lm("gpt2")
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=original)
        try:
            Cockpit(wrapped.parameters(), quantities=quantities("first_order"))
        except ValueError as error:
            said[f"fsdp1, use_orig_params={original}"] = str(error)
    for original in (True, False):  # wrapped after the cockpit
        model, blocks = build_lm("gpt2")
        cockpit = Cockpit(list(model.parameters()), quantities=quantities("first_order"))
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=original)
        losses = _losses(model, torch.randint(0, VOCAB, (2, LENGTH)))
        try:
            with cockpit(0, info={"batch_size": 2, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()
        except (ValueError, RuntimeError) as error:
            said[f"fsdp1, wrapped later, use_orig_params={original}"] = str(error)
    model, blocks = build_lm("gpt2")
    weight = sharded(model, blocks, config).transformer.wte.weight
    try:
        ops.batch_l2(weight)
    except ValueError as error:
        said["op"] = str(error)
    cockpit = Cockpit(list(model.parameters()), quantities=quantities("curvature"))
    losses = _losses(model, torch.randint(0, VOCAB, (2, LENGTH)))
    try:
        with cockpit(0, info={"batch_size": 2, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    except ValueError as error:
        said["curvature"] = str(error)
    return said


def foreach_over_a_mix(config, rank=0, rank_sizes=None):
    """``fsdp.each`` and ``fsdp.norms`` over a list mixing FSDP2's shards and plain tensors (a
    model whose root is not sharded), which DTensor's foreach ops refuse in one call: the
    differences and their norms, with what the per-tensor ops give."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from cockpit_fast.fsdp import each, norms

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same full tensors in every process
    full = [torch.randn(6, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)]
    start = [torch.randn_like(t) for t in full]
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    mixed, mixed_start = [shard(full[0]), full[1], shard(full[2])], [shard(start[0]), start[1], shard(start[2])]
    try:
        torch._foreach_sub(mixed, mixed_start)
        refused = False
    except RuntimeError:
        refused = True
    differences = each(torch._foreach_sub, mixed, mixed_start)
    return {
        "refused in one call": refused,
        "differences": [d.full_tensor() if hasattr(d, "full_tensor") else d for d in differences],
        "norms": norms(differences),
        "expected": [a - b for a, b in zip(full, start)],
    }


def norms_over_two_meshes(config, rank=0, rank_sizes=None):
    """``fsdp.norms`` and ``fsdp.summed_squares`` of tensors sharded over two sets of processes
    (4 ranks: one tensor over all, one over each half's own, HSDP's shard dimension alone), with
    the norms of the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from cockpit_fast.fsdp import local_part, norms, summed_squares

    every = init_device_mesh("cpu", (dist.get_world_size(),))
    halves = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replica", "shard"))["shard"]
    torch.manual_seed(0)  # the same full tensors in every process
    full = [torch.randn(6, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)]
    params = [distribute_tensor(full[0], halves, [Shard(0)]), full[1], distribute_tensor(full[2], every, [Shard(0)])]
    return {
        "norms": norms(params),
        "summed squares": summed_squares([[local_part(t, p) for t, p in zip(full, params)]], params),
        "expected": [t.norm() for t in full],
    }



def cockpit_on_rank0_only(config, rank=0, rank_sizes=None):
    """Steps of GPT-2 under FSDP2 where rank 0 alone makes a cockpit of ``config["quantities"]``
    ("parameters": UpdateSize and Distance, which read no batch but sum over the shards)."""
    model, blocks = build_lm("gpt2")
    model = sharded(model, blocks, config)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    every = schedules.linear(1)
    tracked = [q.UpdateSize(every), q.Distance(every)] if config["quantities"] == "parameters" else quantities("first_order")
    cockpit = Cockpit(params, quantities=tracked) if rank == 0 else None
    for step, ids in enumerate(_batches(config, rank_sizes)):
        ids = ids[sum(rank_sizes[:rank]) : sum(rank_sizes[: rank + 1])]
        opt.zero_grad()
        losses = _losses(model, ids)
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
        else:
            with cockpit(step, info={"batch_size": len(ids), "individual_losses": losses, "loss": loss, "optimizer": opt}):
                loss.backward()
        opt.step()
    return {}
