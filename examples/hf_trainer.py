"""A Hugging Face Trainer run with the cockpit in one line: a tiny GPT-2 (random weights, built from a
config: nothing is downloaded) on random padded token sequences, with gradient accumulation and
clipping, tracking the "economy" configuration. Runs in seconds on a CPU:

    python examples/hf_trainer.py --out logs/hf

writes logs/hf/cockpit.json, the dashboard logs/hf/cockpit__primary.png, and prints a few values.
"""

import argparse

import torch
import transformers

from cockpit_fast.integrations.transformers import CockpitCallback


class RandomText(torch.utils.data.Dataset):
    """Token sequences of random lengths, padded at the end (labels -100 there)."""

    def __init__(self, sequences=64, tokens=32, vocab=256, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (sequences, tokens), generator=gen)
        lengths = torch.randint(tokens // 2, tokens + 1, (sequences,), generator=gen)
        self.mask = (torch.arange(tokens)[None, :] < lengths[:, None]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, n):
        labels = self.ids[n].masked_fill(self.mask[n] == 0, -100)
        return {"input_ids": self.ids[n], "attention_mask": self.mask[n], "labels": labels}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="logs/hf", help="folder of the trainer's and the cockpit's output")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=1e-3, max_grad_norm=1.0, report_to="none", use_cpu=True, save_strategy="no",
        logging_steps=4, disable_tqdm=True,
    )
    callback = CockpitCallback("economy", logpath=f"{args.out}/cockpit")  # the one line
    transformers.Trainer(model=model, args=training, train_dataset=RandomText(), callbacks=[callback]).train()
    output = callback.cockpit.get_output()
    for step in sorted(output):
        row = output[step]
        print(f"step {step}: loss {row['Loss']:.4f}  NormTest {row['NormTest']:.3f}  InnerTest {row['InnerTest']:.3f}")
    print("routes:", sorted(set(callback.cockpit.routes().values())))


if __name__ == "__main__":
    main()
