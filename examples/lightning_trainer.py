"""A Lightning Trainer run with the cockpit in one line: a small classifier on random data, with
gradient accumulation (a shorter last cycle included) and clipping, tracking the "economy"
configuration. Runs in seconds on a CPU:

    python examples/lightning_trainer.py --out logs/lightning

writes logs/lightning/cockpit.json, the dashboard beside it, the CSV logger's metrics (with the
cockpit's numbers under cockpit/...), and prints a few values.
"""

import argparse

import lightning
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_fast.integrations.lightning import CockpitCallback


class Classifier(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        # Each sample's loss, for the quantities that need it; their mean is the loss returned.
        self.individual_losses = F.cross_entropy(self.net(x), y, reduction="none")
        return self.individual_losses.mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="logs/lightning", help="folder of the trainer's and the cockpit's output")
    parser.add_argument("--epochs", type=int, default=3, help="epochs over 200 samples")
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(200, 20), torch.randint(0, 5, (200,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    callback = CockpitCallback("economy", logpath=f"{args.out}/cockpit")  # the one line
    trainer = lightning.Trainer(
        max_epochs=args.epochs, accumulate_grad_batches=3, gradient_clip_val=1.0, callbacks=[callback],
        accelerator="cpu", logger=lightning.pytorch.loggers.CSVLogger(args.out), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(Classifier(), loader)
    output = callback.cockpit.get_output()
    for step in sorted(output)[:: max(1, len(output) // 6)]:
        row = output[step]
        print(f"step {step}: loss {row['Loss']:.4f}  NormTest {row['NormTest']:.3f}  InnerTest {row['InnerTest']:.3f}")


if __name__ == "__main__":
    main()
