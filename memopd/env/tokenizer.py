"""A local tokenizer for the QA environment, saved in Hugging Face format.

Built with the `tokenizers` library over the world's own text (no download):
- "word": a word-level vocabulary (lower-cased, split on whitespace and punctuation)
  for the generated world: a few hundred ids, every word one token;
- "bpe": a byte-level BPE for user corpora, where a closed word list would be lossy.

The protocol tags (`<mem>`, `</mem>`, `<search>`, `</search>`, `<answer>`, `</answer>`,
`<info>`, `</info>`) plus `<pad>`, `<bos>`, `<eos>`, `<unk>` are special tokens with one
id each. The result is a `PreTrainedTokenizerFast`, so `save_pretrained` writes a normal
HF tokenizer next to the model weights and `AutoTokenizer.from_pretrained` reads it back.

`ProtocolTokens` resolves the tag ids of any tokenizer and refuses one that splits a tag,
so the environment and the rollout engine can work on ids alone.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

from .protocol import DOC_SEPARATOR, ERRORS, INSTRUCTION, MAX_QUESTIONS, NO_RESULTS, SPECIAL_TOKENS, ProtocolError, ProtocolTokens

__all__ = [
    "SPECIAL_TOKENS",
    "PROTOCOL_TEXTS",
    "build_tokenizer",
    "load_tokenizer",
    "ProtocolTokens",
    "TokenizerError",
]

# Texts the environment itself writes; the word-level vocabulary must hold all their words.
PROTOCOL_TEXTS = (
    INSTRUCTION,
    *ERRORS.values(),
    f"{NO_RESULTS} {DOC_SEPARATOR} ; : ? . , - ' \" ( ) ! /",
    # question / hop / note markers, up to 64 questions per set
    " ".join(f"q{i} k{i} r{i} a{i}" for i in range(1, MAX_QUESTIONS + 1)),
)


class TokenizerError(ProtocolError):
    """The tokenizer cannot serve the agent protocol (e.g. a tag is not one token)."""


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    # Whitespace splits on \w+|[^\w\s]+ : "q12", "a3" and "12" stay one token each.
    return pre_tokenizers.Whitespace()


def build_tokenizer(texts: Iterable[str], *, kind: str = "word", vocab_size: int = 8000, min_frequency: int = 1):
    """Build a PreTrainedTokenizerFast over `texts` (plus the protocol's own texts).

    kind="word": deterministic word-level vocabulary (specials first, then words in
    sorted order). kind="bpe": byte-level BPE of at most `vocab_size` ids.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) + list(PROTOCOL_TEXTS)
    if kind == "word":
        pre = _pre_tokenizer()
        norm = normalizers.Lowercase()
        counts: dict[str, int] = {}
        for t in texts:
            for w, _ in pre.pre_tokenize_str(norm.normalize_str(t)):
                counts[w] = counts.get(w, 0) + 1
        words = sorted(w for w, c in counts.items() if c >= min_frequency and w not in SPECIAL_TOKENS)
        vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        for w in words:
            vocab.setdefault(w, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.normalizer = norm
        tok.pre_tokenizer = pre
        # No decoder: WordLevel decoding joins tokens with single spaces, which is what
        # the normalised answer comparison expects.
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose 'word' or 'bpe'")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[4:])})
    ProtocolTokens.from_tokenizer(fast)  # fail now, not in the middle of a rollout
    return fast


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer saved with `save_pretrained` and check it serves the protocol."""
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "tokenizer.json")) and not os.path.exists(
        os.path.join(path, "tokenizer_config.json")
    ):
        raise TokenizerError(f"{path!r} holds no tokenizer (no tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(path)
    ProtocolTokens.from_tokenizer(tok)
    return tok


def encode(tok, text: str) -> list[int]:
    """Token ids of plain text, no special tokens added."""
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
