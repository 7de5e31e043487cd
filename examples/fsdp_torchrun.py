"""Sharded training with FSDP2 (``fully_shard``) and the cockpit, one process per rank: a tiny GPT-2
(random weights, built from a config: nothing is downloaded) on random token sequences, each rank
on its own slice of every global batch, tracking the "economy" configuration. Every quantity is
that of the global batch, the same on every rank. Runs in seconds on a CPU (gloo):

    torchrun --standalone --nproc_per_node=2 examples/fsdp_torchrun.py --out logs/fsdp

(``--nproc_per_node`` up to the batch size; NCCL and one GPU per rank where CUDA is available.)
Rank 0 writes logs/fsdp/cockpit.json and the dashboard logs/fsdp/cockpit__primary.png, and prints
a few values.
"""

import argparse
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from cockpit_fast import Cockpit, CockpitPlotter
from cockpit_fast.integrations.language_models import causal_lm_losses
from cockpit_fast.utils.configuration import configuration


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="logs/fsdp", help="folder of the cockpit's log and dashboard")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences of the global batch")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings (tied to the output layer), final norm
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))  # the world group by default

    data = torch.Generator().manual_seed(1)  # the same global batches on every rank
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, 32), generator=data)
        ids = ids.tensor_split(world)[rank].to(device)  # this rank's samples (sizes may differ)
        opt.zero_grad()
        losses = causal_lm_losses(model(ids).logits, ids)
        loss = losses.mean()
        with cockpit(step, info={"batch_size": len(ids), "individual_losses": losses, "loss": loss, "optimizer": opt}):
            loss.backward()
        opt.step()

    output = cockpit.get_output()  # the global batch's, on every rank
    cockpit.write(os.path.join(args.out, "cockpit"))  # rank 0 writes
    CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=args.out)  # rank 0 draws
    if rank == 0:
        for step in sorted(output):
            row = output[step]
            print(f"step {step}: loss {row['Loss']:.4f}  NormTest {row['NormTest']:.3f}  InnerTest {row['InnerTest']:.3f}")
        print("routes:", sorted(set(cockpit.routes().values())))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
