"""The world's rule as a teacher: an exact reader of whatever state a packed row shows it.

A neural teacher is scored on a packed batch under some layout (aligned calls, the
flattened history, a broken state) and gives a distribution per action token. The
`RuleTeacher` takes the same packed batch, reads for each prediction position the token
ids that position can see (the prefix interval and its own causal segment, from the
batch's `AttentionMeta`: so every layout works, as it does for a model) and answers with
the rational rule of `memopd.trainer.experiments.infogap_expert` (`RationalExpert`) on that state:

- the visible ids split into the state (everything before the action) and the action
  prefix written so far (the entry's `token_index` last ids);
- **rule completion**: the rule's next token after that prefix is
  1. the rule's own action's next token while the prefix follows the rule's action;
  2. once the prefix has left it but has closed its notes (`</mem>`), the next token of the
     rule's search or answer for *those* notes (the rule run on the state with the notes
     the student wrote), while the rest of the prefix follows it;
  3. nothing otherwise: the rule is **silent** (inside notes that have left the rule's,
     after an action that has left the completion, after the rule's action has ended,
     and on the re-encoded copies of a naive action domain).
- a spoken target y becomes the distribution softmax(β · onehot(y)) over the scored
  vocabulary, with β set so that p(y) = `p_target` at the scoring temperature; a silent
  position is masked out of the distillation term (`read_packed`'s last column, which
  `trainer.update.score` turns into `Scored.teacher_speaks`).

As a module it looks like a causal LM to the trainer where it must: an output head
(`get_output_embeddings`: β·I, so the fused ops compute the KL to exactly that
distribution from the one-hot "hidden state"), an input embedding whose rows are the ids
it reads, and `read_packed(batch)` in place of a forward. It holds no trainable weight
and needs no SFT. What it says nothing about: how often a trained teacher reads the
history at such points (it reads every visible fact, always).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from memopd.env.qa.expert import make_expert

from .infogap_expert import RationalExpert, rational_action_text

__all__ = ["RuleTeacher", "beta_for", "rule_next_token"]


def beta_for(p_target: float, vocab_size: int, temperature: float = 1.0) -> float:
    """β with softmax(β · onehot / temperature)[target] = p_target over `vocab_size` ids."""
    if not 0.0 < p_target < 1.0:
        raise ValueError(f"p_target must lie in (0, 1), got {p_target!r}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if not p_target > 1.0 / vocab_size:
        raise ValueError(f"p_target={p_target} is not above the uniform 1/{vocab_size}: the target would not be the top-1")
    return temperature * math.log(p_target * (vocab_size - 1) / (1.0 - p_target))


class _Reader:
    """The rule's actions on token states, cached per state (a call's every token shares it)."""

    def __init__(self, expert: RationalExpert):
        self.expert = expert
        self.tk = expert.tokens
        self._act: dict[tuple, list[int]] = {}
        self._completion: dict[tuple, list[int] | None] = {}

    def action(self, state: tuple) -> list[int]:
        a = self._act.get(state)
        if a is None:
            a = self._act[state] = self.expert.act(list(state))
        return a

    def completion(self, state: tuple, notes: tuple) -> list[int] | None:
        """The ids after `</mem>` of the rule's action on `state` when its notes are `notes`
        (the ids between `<mem>` and `</mem>` the student wrote)."""
        key = (state, notes)
        if key not in self._completion:
            ex = self.expert
            questions, _, infos = ex.state(list(state))
            mem_text = ex.tokenizer.decode(list(notes), skip_special_tokens=True)
            text = rational_action_text(questions, mem_text, infos, values=ex.values, descending=ex.descending)
            ids = [int(i) for i in ex.tokenizer.encode(text, add_special_tokens=False)]
            close = ids.index(self.tk.mem_close) if self.tk.mem_close in ids else None
            self._completion[key] = None if close is None else ids[close + 1:]
        return self._completion[key]

    def next_token(self, state: Sequence[int], prefix: Sequence[int]) -> int | None:
        """The rule's next action token after `prefix` on `state`, or None (silent)."""
        state, prefix = tuple(int(i) for i in state), [int(i) for i in prefix]
        own = self.action(state)
        j = len(prefix)
        if own[:j] == prefix:
            return own[j] if j < len(own) else None
        tk = self.tk
        if not prefix or prefix[0] != tk.mem_open or tk.mem_close not in prefix:
            return None
        close = prefix.index(tk.mem_close)
        rest = self.completion(state, tuple(prefix[1:close]))
        done = prefix[close + 1:]
        if rest is None or rest[:len(done)] != done or len(done) >= len(rest):
            return None
        return rest[len(done)]


def rule_next_token(expert: RationalExpert, state: Sequence[int], prefix: Sequence[int]) -> int | None:
    """The rule completion of the module doc, once (no cache kept)."""
    return _Reader(expert).next_token(state, prefix)


class RuleTeacher(nn.Module):
    """The rule as a frozen teacher over `vocab_size` ids (see the module doc).

    `read_packed(batch)` -> [A, vocab_size + 1]: per action entry the one-hot target
    (zeros where silent) and, last column, 1.0 where the rule speaks."""

    def __init__(self, tokenizer, world_config, *, vocab_size: int, p_target: float, temperature: float = 1.0):
        super().__init__()
        self.expert = make_expert("rational", tokenizer, world_config)
        self.vocab_size = int(vocab_size)
        self.p_target = float(p_target)
        self.beta = beta_for(p_target, self.vocab_size, temperature)
        self.lm_head = nn.Linear(self.vocab_size, self.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(self.vocab_size) * self.beta)
        # the ids it reads (token-id checks ask the input embedding for its rows); no weight is used
        self.embed_tokens = nn.Embedding(self.vocab_size, 1)
        self._memopd_logit_scale = 1.0  # logits = β·onehot exactly: nothing to measure
        self.requires_grad_(False)
        self._reader = _Reader(self.expert)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def visible_ids(self, batch) -> list[list[int]]:
        """Per action entry of `batch`: the ids its prediction position sees, in order (the
        prefix interval, then its own segment up to itself)."""
        ids = batch.input_ids.tolist()
        a = batch.attn
        ps, pe, ss = a.prefix_start.tolist(), a.prefix_end.tolist(), a.seg_start.tolist()
        return [ids[ps[i]:pe[i]] + ids[ss[i]:i + 1] for i in batch.pred_index.tolist()]

    def targets(self, batch) -> list[int | None]:
        """Per action entry: the rule's next token on what it sees, or None (silent)."""
        out: list[int | None] = []
        sampled = batch.is_sampled.tolist()
        for vis, j, s in zip(self.visible_ids(batch), batch.token_index.tolist(), sampled):
            if not s:  # a re-encoded copy (naive action domain): not an action the rule takes
                out.append(None)
                continue
            state, prefix = (vis[:len(vis) - j], vis[len(vis) - j:]) if j else (vis, [])
            y = self._reader.next_token(state, prefix)
            out.append(y if y is not None and 0 <= y < self.vocab_size else None)
        return out

    @torch.no_grad()
    def read_packed(self, batch) -> torch.Tensor:
        ys = self.targets(batch)
        out = torch.zeros(len(ys), self.vocab_size + 1, device=self.lm_head.weight.device)
        rows = [i for i, y in enumerate(ys) if y is not None]
        if rows:
            r = torch.tensor(rows, dtype=torch.long, device=out.device)
            out[r, torch.tensor([ys[i] for i in rows], dtype=torch.long, device=out.device)] = 1.0
            out[r, -1] = 1.0
        return out
