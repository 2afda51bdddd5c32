"""TRL's GKD trainer with memopd's fused loss: the whole change is one import.

    from trl.experimental.gkd import GKDTrainer                              # before
    from memopd.integrations.trl import MemopdGKDTrainer as GKDTrainer       # after

Everything else (GKDConfig, the collator, on-policy generation with `lmbda`, the
optimiser) is TRL's. This script trains a tiny Qwen2 student against a tiny Llama
teacher for a few steps on CPU, once with each trainer from the same weights, and prints
both loss curves: they agree to float32 rounding (tests/integrations/test_integrations_trl.py checks
one step to 1e-12 in float64). Needs `pip install 'memopd[integrations]'` (trl 1.16,
datasets). `python examples/trl_gkd.py --steps 3`; `tests/integrations/test_examples.py` runs it.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch

from memopd.models import tiny_causal_lm

VOCAB = 50


def tokenizer():
    """A word-level tokenizer over the ids the models use ('w0' .. 'w47')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def dataset(n: int = 12, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p, c = (int(x) for x in torch.randint(2, 6, (2,), generator=g))
        rows.append({"ids": torch.randint(2, VOCAB, (p + c,), generator=g).tolist(), "prompt_len": p})
    return Dataset.from_list(rows)


def collate(features):
    """TRL GKD's batch: right-padded input_ids / labels (-100 on the prompt and padding)
    and the left-padded prompts on-policy generation starts from."""
    B, L, P = len(features), max(len(f["ids"]) for f in features), max(f["prompt_len"] for f in features)
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.zeros(B, L, dtype=torch.long),
             "labels": torch.full((B, L), -100), "prompts": torch.zeros(B, P, dtype=torch.long),
             "prompt_attention_mask": torch.zeros(B, P, dtype=torch.long)}
    for i, f in enumerate(features):
        n, p = len(f["ids"]), f["prompt_len"]
        ids = torch.tensor(f["ids"])
        batch["input_ids"][i, :n], batch["attention_mask"][i, :n], batch["labels"][i, p:n] = ids, 1, ids[p:]
        batch["prompts"][i, P - p:], batch["prompt_attention_mask"][i, P - p:] = ids[:p], 1
    return batch


def train(trainer_cls, student, teacher, steps: int, lmbda: float) -> list[float]:
    from trl.experimental.gkd import GKDConfig

    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=5e-3,
                         lr_scheduler_type="constant", lmbda=lmbda, beta=0.5, temperature=0.9, max_new_tokens=4,
                         logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=False,
                         disable_tqdm=True)
        trainer = trainer_cls(model=student, teacher_model=teacher, args=args, train_dataset=dataset(),
                              data_collator=collate, processing_class=tokenizer())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv=None) -> int:
    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    from memopd.integrations.trl import MemopdGKDTrainer as GKDTrainer  # the one changed line

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lmbda", type=float, default=0.0, help="fraction of on-policy (student-sampled) batches")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    student = tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             seed=1, initializer_range=0.1)
    teacher = tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=2,
                             seed=2, initializer_range=0.1).requires_grad_(False)
    theirs = train(TRLGKDTrainer, copy.deepcopy(student), teacher, args.steps, args.lmbda)
    ours = train(GKDTrainer, copy.deepcopy(student), teacher, args.steps, args.lmbda)
    print("step  TRL GKDTrainer  MemopdGKDTrainer")
    for i, (a, b) in enumerate(zip(theirs, ours), 1):
        print(f"{i:>4}  {a:>14.6f}  {b:>16.6f}")
    same = len(theirs) == len(ours) == args.steps and all(abs(a - b) <= 1e-4 * max(1.0, abs(a))
                                                          for a, b in zip(theirs, ours))
    print("the loss curves agree" if same else "the loss curves DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
