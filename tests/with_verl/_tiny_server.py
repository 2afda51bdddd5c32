"""A real tiny model behind verl's rollout-server interface, on CPU: the `generate` that
verl's `LLMServerClient` calls on a server actor (`prompt_ids`, `sampling_params` ->
`TokenOutput` with the sampled ids and their log-probs). Sampling is plain ancestral
sampling at the request's temperature (top-p 1, top-k off) from a Hugging Face causal LM,
seeded per request so a run replays. Wrapped with `ray.remote` by the tests."""
from __future__ import annotations

import hashlib

import torch


class TinyModelServer:
    def __init__(self, model_kwargs: dict, max_new_tokens: int, stop_id: int | None = None):
        from memopd.models import tiny_causal_lm

        torch.set_num_threads(1)
        kw = dict(model_kwargs)
        self.model = tiny_causal_lm(kw.pop("family"), **kw).eval()
        self.max_new_tokens = int(max_new_tokens)
        self.stop_id = stop_id
        self.calls = 0

    async def generate(self, request_id, prompt_ids, sampling_params, image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        temperature = float(sampling_params.get("temperature", 1.0))
        digest = hashlib.sha256(f"{list(prompt_ids)}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        out, lps = [], []
        with torch.no_grad():
            for _ in range(self.max_new_tokens):
                logits = self.model(input_ids=ids, use_cache=False).logits[0, -1].double() / temperature
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=g))
                out.append(tok)
                lps.append(float(logp[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]])], 1)
                if tok == self.stop_id:
                    break
        return TokenOutput(token_ids=out, log_probs=lps, stop_reason="completed", extra_fields={"global_steps": 0})

    def num_calls(self) -> int:
        return self.calls
