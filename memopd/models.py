"""Tiny Hugging Face causal LMs built from a config (random init, no download), and
checks and loading of local checkpoint directories.

`tiny_causal_lm_config` / `tiny_causal_lm` are the one place a small shape becomes a
Hugging Face config and a seeded model: the audit's embedded default, the SFT teacher and
student (`memopd.env.qa.sft.make_model`), the tests and the CPU benchmarks all build theirs
here. Every model is a normal transformers model: `save_pretrained` makes a checkpoint dir.
"""
from __future__ import annotations

import torch

__all__ = ["tiny_causal_lm", "tiny_causal_lm_config", "ARCHS", "model_dir_problem", "check_model_dir",
           "load_local_model"]

ARCHS = ("qwen2", "llama")


def tiny_causal_lm_config(
    arch: str = "qwen2",
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 4096,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.02,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
):
    """The Qwen2 or Llama config of a small causal LM (GQA when num_kv_heads < num_heads).

    `intermediate_size` defaults to 2 * hidden_size. A special-token id left at None keeps
    the architecture's own default (Llama's bos/eos are 1/2, Qwen2 has none).
    """
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        attention_dropout=0.0,
    )
    for name, value in (("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None:
            kw[name] = value
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**kw)


def tiny_causal_lm(
    arch: str = "qwen2",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **shape,
):
    """A random-init causal LM of `tiny_causal_lm_config(arch, **shape)`, in eval mode.

    The weights are a function of the shape and `seed` alone (the global torch RNG is
    seeded here). A larger `initializer_range` (e.g. 0.2) gives sharp, context-sensitive
    distributions, which is what an audit needs from an untrained model.
    `attn_implementation` (e.g. "eager", "sdpa"): None keeps transformers' default.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_causal_lm_config(arch, **shape)
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **kw)
    return model.to(dtype).eval()


def model_dir_problem(path) -> str | None:
    """Why `path` is not a local Hugging Face checkpoint directory, or None if it looks like one.

    Only the file system is checked (a directory holding config.json): cheap enough for
    config validation, before anything is loaded.
    """
    import os

    p = os.fspath(path)
    if not os.path.exists(p):
        return f"model directory {p!r} does not exist"
    if not os.path.isdir(p):
        return f"{p!r} is a file, not a model directory (expected a Hugging Face checkpoint directory)"
    if not os.path.isfile(os.path.join(p, "config.json")):
        return (f"{p!r} has no config.json: not a Hugging Face checkpoint directory "
                "(write one with model.save_pretrained(DIR) or `memopd sft --out DIR`)")
    return None


def check_model_dir(path, what: str = "model") -> str:
    """`path` as a string if it is a local checkpoint directory, else `UserError` naming `what`."""
    import os

    from .errors import UserError

    problem = model_dir_problem(path)
    if problem:
        raise UserError(f"{what}: {problem}")
    return os.fspath(path)


def load_local_model(path, *, what: str = "model", dtype: torch.dtype | None = None):
    """`AutoModelForCausalLM` from a local checkpoint directory, never from the Hub.

    A missing directory, a directory without config.json, or one transformers cannot load
    (missing weights, unknown architecture) is a `UserError` naming `what` and the path,
    instead of transformers' Hub "repo id" error.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from .errors import UnsafeFileError, UserError

    p = check_model_dir(path, what)
    kw = {"local_files_only": True}
    if dtype is not None:
        kw["dtype"] = dtype
    import pickle

    try:
        return AutoModelForCausalLM.from_pretrained(p, **kw)
    except pickle.UnpicklingError:
        # transformers reads pickled weights (pytorch_model.bin) with the weights-only
        # unpickler: this file holds more, and loading it could run code
        raise UnsafeFileError(f"{what}: refused to load the weights in {p!r}: the pickled weights file holds more "
                              "than tensors, and unpickling it could run code; use safetensors weights") from None
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        # SafetensorError: a truncated or damaged .safetensors file (not an OSError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what}: cannot load the model in {p!r}: {first}"
                        + (" (a damaged or truncated weights file)" if isinstance(e, SafetensorError) else "")) from e
