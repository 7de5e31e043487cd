"""A Hugging Face Trainer with the cockpit's callback in each process of ``torchrun`` (test helper).

``torchrun --nproc_per_node=2 tests/hf_distributed.py OUT``: GPT-2 from a small config, the
sequences in order (rank r takes the r-th batch of each step), learning rate 0, one optimizer
step; each rank saves its cockpit's output to ``OUT/rank<r>.pt``. ``python tests/hf_distributed.py
OUT --one`` runs one process on every rank's sequences at once and saves ``OUT/one.pt``.

``torchrun --nproc_per_node=2 tests/hf_distributed.py OUT --resume``: both runs of a resume
inside one ``torchrun``, GPT-2 in float64, AdamW (the trainer's default), 4 steps of 2 sequences
a process: an uninterrupted one that saves a checkpoint every 2 steps, then a second trainer
resumed from its ``checkpoint-2``; each rank saves both cockpits' outputs to
``OUT/resume_rank<r>.pt`` (``{"whole": ..., "resumed": ...}``).
"""

import os
import sys

import torch

torch.set_num_threads(1)
import transformers  # noqa: E402

from cockpit_fast import quantities  # noqa: E402
from cockpit_fast.integrations.transformers import CockpitCallback  # noqa: E402
from distributed_training import leave_process_group  # noqa: E402

SEQUENCES, TOKENS, VOCAB, PER_PROCESS = 8, 8, 16, 4
EVERY = staticmethod(lambda step: True)


class _InOrder(transformers.Trainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def main(out, one):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (SEQUENCES, TOKENS), generator=torch.Generator().manual_seed(1))
    ids[1, 5:] = 0  # padding: the sequences hold different numbers of tokens
    labels = ids.masked_fill(ids == 0, -100)
    data = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]
    args = transformers.TrainingArguments(
        os.path.join(out, "hf"), per_device_train_batch_size=SEQUENCES if one else PER_PROCESS, max_steps=1,
        learning_rate=0.0, report_to="none", use_cpu=True, save_strategy="no", logging_strategy="no", seed=0,
        disable_tqdm=True, average_tokens_across_devices=True,  # (the trainer's default)
    )
    tracked = [quantities.Loss(EVERY), quantities.NormTest(EVERY), quantities.InnerTest(EVERY), quantities.GradNorm(EVERY)]
    callback = CockpitCallback(tracked, plot=False)
    _InOrder(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    name = "one" if one else f"rank{os.environ['RANK']}"
    torch.save(dict(callback.cockpit.get_output()), os.path.join(out, f"{name}.pt"))


def resume(out):
    outputs = {}
    for run in ("whole", "resumed"):
        torch.manual_seed(0)
        # Untied embeddings: with GPT-2's tied ones Alpha came ~1e-7 apart after a resume in one process.
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=TOKENS, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=False,
        )
        model = transformers.GPT2LMHeadModel(config).double()
        ids = torch.randint(1, VOCAB, (4 * SEQUENCES // 2, TOKENS), generator=torch.Generator().manual_seed(1))
        data = [{"input_ids": i, "labels": i} for i in ids]  # 16 sequences: 4 steps of 2 a process
        args = transformers.TrainingArguments(
            os.path.join(out, "hf"), per_device_train_batch_size=2, max_steps=4, learning_rate=0.05,
            save_strategy="steps" if run == "whole" else "no", save_steps=2, report_to="none", use_cpu=True,
            logging_strategy="no", seed=0, disable_tqdm=True,
        )
        tracked = [quantities.Loss(EVERY), quantities.GradNorm(EVERY), quantities.Alpha(EVERY), quantities.Distance(EVERY), quantities.UpdateSize(EVERY)]
        callback = CockpitCallback(tracked, plot=False)
        checkpoint = os.path.join(out, "hf", "checkpoint-2") if run == "resumed" else None
        _InOrder(model=model, args=args, train_dataset=data, callbacks=[callback]).train(resume_from_checkpoint=checkpoint)
        outputs[run] = {step: dict(row) for step, row in callback.cockpit.get_output().items()}
    torch.save(outputs, os.path.join(out, f"resume_rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    if "--resume" in sys.argv:
        resume(sys.argv[1])
    else:
        main(sys.argv[1], "--one" in sys.argv)
    leave_process_group()
