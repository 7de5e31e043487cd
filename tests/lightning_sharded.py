"""A Lightning Trainer with FSDP2 (``ModelParallelStrategy``) and the cockpit's callback in each
process of ``torchrun`` (test helper).

``torchrun --nproc_per_node=2 tests/lightning_sharded.py OUT``: an MLP, ``fully_shard`` on each
Linear and the whole in ``configure_model``, 4 samples per process and step (Lightning's
distributed sampler, seed 0); each rank saves its cockpit's output to
``OUT/rank<r>.pt``. ``python tests/lightning_sharded.py OUT --one``: one process, no sharding,
each step's 8 samples of both ranks, saved to ``OUT/one.pt``.

``torchrun --nproc_per_node=2 tests/lightning_sharded.py OUT --resume mp|ddp``: both runs of a
resume inside one ``torchrun``, with Adam, under ``ModelParallelStrategy`` (FSDP2, as above) or
``strategy="ddp"``: 4 steps (2 an epoch) checkpointed every 2 by ``ModelCheckpoint``, then a
second trainer resumed from the step-2 checkpoint (``fit(ckpt_path=...)``); each rank saves both
cockpits' outputs to ``OUT/resume_rank<r>.pt`` (``{"whole": ..., "resumed": ...}``).
"""

import os
import sys

import torch

torch.set_num_threads(1)
import lightning  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from cockpit_fast import quantities  # noqa: E402
from cockpit_fast.integrations.lightning import CockpitCallback  # noqa: E402
from distributed_training import leave_process_group  # noqa: E402

SAMPLES, STEP, FEATURES, CLASSES = 16, 8, 6, 3
EVERY = staticmethod(lambda step: True)


class _Sharded(lightning.LightningModule):
    def __init__(self, shard):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()
        self.shard = shard

    def configure_model(self):  # (after the callbacks' setup)
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2], self.net):
                fully_shard(layer, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.individual_losses = F.cross_entropy(self.net(x), y, reduction="none")
        return self.individual_losses.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=gen, dtype=torch.float64), torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    )


def main(out, one):
    data = _data()
    if one:  # each step's samples as the ranks take them (Lightning's sampler shuffles, seed 0)
        ranks = [list(torch.utils.data.DistributedSampler(range(SAMPLES), 2, r, seed=0)) for r in range(2)]
        order = [i for start in range(0, SAMPLES // 2, STEP // 2) for r in ranks for i in r[start : start + STEP // 2]]
        data = torch.utils.data.Subset(data, order)
        strategy = dict(devices=1)
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = dict(devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"))
    tracked = [quantities.Loss(EVERY), quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.GradNorm(EVERY), quantities.Distance(EVERY)]
    callback = CockpitCallback(tracked, plot=False)
    trainer = lightning.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **strategy,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=STEP if one else STEP // 2, shuffle=False)
    trainer.fit(_Sharded(shard=not one), loader)
    name = "one" if one else f"rank{trainer.global_rank}"
    torch.save(dict(callback.cockpit.get_output()), os.path.join(out, f"{name}.pt"))


class _Adam(_Sharded):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def resume(out, mode):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    data = _data()
    outputs = {}
    for run in ("whole", "resumed"):
        strategy = ModelParallelStrategy(2, 1, process_group_backend="gloo") if mode == "mp" else "ddp"
        tracked = [quantities.Loss(EVERY), quantities.GradNorm(EVERY), quantities.Alpha(EVERY), quantities.Distance(EVERY), quantities.UpdateSize(EVERY)]
        callback = CockpitCallback(tracked, plot=False)
        saving = [ModelCheckpoint(os.path.join(out, "ckpt"), "s{step}", every_n_train_steps=2, save_top_k=-1)] if run == "whole" else []
        trainer = lightning.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=4, callbacks=[callback, *saving], logger=False,
            enable_checkpointing=run == "whole", enable_progress_bar=False, enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=STEP // 2, shuffle=False)  # 2 steps an epoch
        checkpoint = os.path.join(out, "ckpt", "sstep=2.ckpt") if run == "resumed" else None
        trainer.fit(_Adam(shard=mode == "mp"), loader, ckpt_path=checkpoint)
        outputs[run] = {step: dict(row) for step, row in callback.cockpit.get_output().items()}
    torch.save(outputs, os.path.join(out, f"resume_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    if "--resume" in sys.argv:
        resume(sys.argv[1], sys.argv[sys.argv.index("--resume") + 1])
    else:
        main(sys.argv[1], "--one" in sys.argv)
    leave_process_group()
