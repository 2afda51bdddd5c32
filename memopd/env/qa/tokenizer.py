"""A local tokenizer for the QA environment, saved in Hugging Face format.

Built with the `tokenizers` library over the world's own text (no download). It is a
byte-level BPE whose normaliser, pre-tokeniser and decoder are exactly those of
transformers' `Qwen2Tokenizer`, because `AutoTokenizer.from_pretrained` on a directory
whose config is a Qwen2 model always rebuilds the tokenizer as a `Qwen2Tokenizer` from
the saved vocabulary and merges (transformers >= 5): any other pipeline (e.g. a
word-level one) would silently encode differently once reloaded. Two kinds:

- "word": trained on the closed world's text until every word is a single token
  (a few hundred ids; the alphabet is printable ASCII: other characters are dropped);
- "bpe": an open byte-level BPE of `vocab_size` ids for user corpora.

Words are tokenised with their leading space ("Ġkalo"): the environment writes every
text span as " word word ..." right after a tag, so a word always has one id.

The protocol tags (`<mem>`, `</mem>`, `<search>`, `</search>`, `<answer>`, `</answer>`,
`<info>`, `</info>`) plus `<pad>`, `<bos>`, `<eos>`, `<unk>` are special tokens with one
id each here; `ProtocolTokens` resolves them. `load_tokenizer` also loads any other HF
tokenizer (bring-your-own models): there a tag is usually several tokens, and the
environment works on the tag's id sequence instead.
"""
from __future__ import annotations

import os
from typing import Iterable

from .protocol import (
    DOC_SEPARATOR,
    ERRORS,
    INSTRUCTION,
    MAX_QUESTIONS,
    NO_RESULTS,
    SPECIAL_TOKENS,
    ProtocolError,
    ProtocolTokens,
    marker,
)

__all__ = [
    "SPECIAL_TOKENS",
    "PROTOCOL_TEXTS",
    "build_tokenizer",
    "load_tokenizer",
    "ProtocolTokens",
    "TokenizerError",
]

# Texts the environment itself writes; the closed vocabulary must hold all their words.
PROTOCOL_TEXTS = (
    INSTRUCTION,
    *ERRORS.values(),
    f"{NO_RESULTS} {DOC_SEPARATOR} ; : ? . , -",
    # question / key / hop / note markers
    " ".join(f"{marker(c, i)}" for i in range(1, MAX_QUESTIONS + 1) for c in "qkrx"),
)

# transformers' Qwen2Tokenizer pre-tokenisation regex (GPT-4 style, digits one by one).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TokenizerError(ProtocolError):
    """The tokenizer cannot serve the agent protocol (e.g. a tag is not one token)."""


def _qwen2_pipeline(tok) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def build_tokenizer(texts: Iterable[str], *, kind: str = "word", vocab_size: int = 8000, min_frequency: int = 1):
    """Build a `PreTrainedTokenizerFast` over `texts` (plus the protocol's own texts).

    kind="word": every word of the texts becomes one token (closed vocabulary).
    kind="bpe": byte-level BPE of at most `vocab_size` ids over the full byte alphabet.
    Deterministic for the same texts.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) + list(PROTOCOL_TEXTS)
    tok = Tokenizer(models.BPE())
    _qwen2_pipeline(tok)
    if kind == "word":
        # Words as the environment writes them: after a space ("Ġword"; a word at the very
        # start of a string stays split, the environment never writes one). No cap:
        # merging continues until every word is a single token.
        texts = [" " + t for t in texts]
        # Alphabet: printable ASCII (ByteLevel maps it to itself, and space to "Ġ"), so
        # any ASCII text round-trips even where it is not a whole word of the world.
        ascii_alphabet = [chr(c) for c in range(33, 127)] + ["Ġ"]
        trainer = trainers.BpeTrainer(vocab_size=1_000_000, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=ascii_alphabet, show_progress=False)
    elif kind == "bpe":
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose 'word' or 'bpe'")
    tok.train_from_iterator(texts, trainer=trainer)
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
    """Load a tokenizer saved with `save_pretrained` (via `AutoTokenizer`, as anyone
    else would, local files only) and check it serves the protocol.

    Any HF tokenizer with an eos token works: the project's own (tags are single
    special tokens) or a generic one (Llama/GPT-2/Qwen BPE...), whose tags are id
    sequences (see `ProtocolTokens`)."""
    from transformers import AutoTokenizer

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer directory {path!r} does not exist")
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise TokenizerError(f"{path!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json); "
                             "save one there with tokenizer.save_pretrained(DIR)")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot load the tokenizer in {path!r}: {e}") from None
    ProtocolTokens.from_tokenizer(tok)
    return tok
