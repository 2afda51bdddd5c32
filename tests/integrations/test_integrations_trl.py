"""memopd.integrations.trl against TRL 1.16's own GKD code: `gkd_loss_from_hidden` against
`GKDTrainer.generalized_jsd_loss` on the full logits (float64), and one optimiser step of
`MemopdGKDTrainer` against one step of TRL's `GKDTrainer` on the same batch and weights,
off-policy (lmbda=0) and on-policy (lmbda=1: both sample the same completions from the
same seed and weights)."""
import copy

import pytest
import torch

gkd = pytest.importorskip("trl.experimental.gkd", reason="trl not installed (pip install 'memopd[integrations]')")

from memopd.hf import head_of  # noqa: E402
from memopd.integrations.trl import gkd_loss_from_hidden  # noqa: E402
from memopd.models import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 50


def _models(dtype=torch.float64, teacher_vocab=V):
    student = tiny_causal_lm("qwen2", vocab_size=V, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1,
                             dtype=dtype, initializer_range=0.1)
    teacher = tiny_causal_lm("llama", vocab_size=teacher_vocab, hidden_size=48, num_layers=1, num_heads=2,
                             num_kv_heads=2, seed=2, dtype=dtype, initializer_range=0.1).requires_grad_(False)
    return student, teacher


def _labels(B=3, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100      # prompt
    labels[1, :2] = -100
    labels[1, 6:] = -100      # right padding (ragged lengths)
    labels[2, :] = -100       # a row with nothing to learn
    labels[2, 5] = ids[2, 5]
    return ids, labels


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "num_items"])
def test_loss_matches_generalized_jsd_loss(beta, reduction):
    student, teacher = _models()
    ids, labels = _labels()
    h_s = student(ids, output_hidden_states=True).hidden_states[-1]
    with torch.no_grad():
        out_t = teacher(ids, output_hidden_states=True)
    logits_s = student(ids).logits
    kw = dict(num_items_in_batch=torch.tensor(7)) if reduction == "num_items" else dict(reduction=reduction)
    ref = gkd.GKDTrainer.generalized_jsd_loss(logits_s[:, :-1], out_t.logits[:, :-1], labels=labels[:, 1:], beta=beta,
                                              temperature=1.3, **kw)
    got = gkd_loss_from_hidden(h_s, head_of(student), out_t.hidden_states[-1], head_of(teacher), labels, beta=beta,
                               temperature=1.3, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-15)
    g_ref = torch.autograd.grad(ref, student.lm_head.weight, retain_graph=True)[0]
    g_got = torch.autograd.grad(got, student.lm_head.weight)[0]
    torch.testing.assert_close(g_got, g_ref, rtol=1e-10, atol=1e-14)


def test_loss_refuses_trl_none_reduction():
    student, teacher = _models()
    ids, labels = _labels()
    h = student(ids, output_hidden_states=True).hidden_states[-1]
    with pytest.raises(ValueError, match="never forms it"):
        gkd_loss_from_hidden(h, head_of(student), h.detach(), head_of(student), labels, reduction="none")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(V - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(2, V, (p + c,), generator=g).tolist(), "prompt_len": p} for p, c in [(3, 5), (5, 2), (2, 7)]]
    return Dataset.from_list(rows)


def _collate(features):
    """TRL's batch keys: right-padded input_ids/labels (-100 on prompt and padding) and the
    left-padded prompts that on-policy generation starts from."""
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


def _one_step(trainer_cls, student0, teacher, lmbda, tmp_path):
    student = copy.deepcopy(student0)
    args = gkd.GKDConfig(output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=3, max_steps=1,
                         learning_rate=2.0, lr_scheduler_type="constant", optim="sgd", lmbda=lmbda, beta=0.3,
                         temperature=0.9, max_new_tokens=6, report_to="none", use_cpu=True, save_strategy="no",
                         bf16=False, seed=0, disable_tqdm=True)
    trainer = trainer_cls(model=student, teacher_model=teacher, args=args, train_dataset=_dataset(),
                          data_collator=_collate, processing_class=_tokenizer())
    seen = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *a, **k):
        seen.append(inputs["input_ids"].clone())
        return compute_loss(model, inputs, *a, **k)

    trainer.compute_loss = recording
    trainer.train()
    return student, seen, trainer.state.log_history[-1]["train_loss"]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_one_step_equals_trl_gkd_trainer(tmp_path, dtype, tol, lmbda):
    from memopd.integrations.trl import MemopdGKDTrainer

    student0, teacher = _models(dtype)
    ref, ref_seen, ref_loss = _one_step(gkd.GKDTrainer, student0, teacher, lmbda, tmp_path)
    got, got_seen, got_loss = _one_step(MemopdGKDTrainer, student0, teacher, lmbda, tmp_path)
    assert len(ref_seen) == len(got_seen) == 1 and torch.equal(ref_seen[0], got_seen[0])
    if lmbda == 1.0:  # the step really trained on sampled completions (prompt width 5 + 6 new tokens)
        assert ref_seen[0].shape[1] == 11 != _collate(list(_dataset()))["input_ids"].shape[1]
    assert got_loss == pytest.approx(ref_loss, rel=tol)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(ref.parameters(), student0.parameters()))
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(ref.parameters(), got.parameters()))
    assert moved > 1e-4, "the step must move the weights for the comparison to mean anything"
    assert diff <= tol * moved, (diff, moved)
