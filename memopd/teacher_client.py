"""`ServedTeacher`: the trainer's client of `memopd serve-teacher` (`teacher_url=`).

It stands where the in-process teacher model stands in `trainer/update.py`'s `score`: given
a step's trajectories packed in the teacher's layout, it returns the teacher's last hidden
states [A, H] (fp32; zero outside the teacher mask, where the KL is masked out anyway), so
the fused op computes the same full-vocabulary KL from them and the teacher's lm_head
(`lm_head()`, downloaded once or read from a local copy of the teacher's files whose
fingerprint must match the server's). `topk(...)` asks for top-k log-probs instead.

Streaming: `submit` packs and cuts the batch into micro-batches in a background thread and
sends each one as soon as it is cut, `inflight` requests at a time, while the trainer
computes its own scoring passes; `.result()` gathers them in action order.

Faults: every request has a timeout; connection failures, timeouts, 429 and 5xx answers are
retried `retries` times with exponential backoff; then a `PeerError` (exit 69, one line
naming the server) ends the run before anything of the step is written. A 400, 401 or 413
answer is a `UserError` (exit 2) carrying the server's message.
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import threading
import time
import urllib.parse
from typing import Callable

import torch

from .errors import PeerError, UserError
from .hf import LMHead
from .layout import PackedBatch
from .teacher_wire import TRANSPORT_DTYPES, batch_to_wire, decode, encode, topk_answer_problem

__all__ = ["ServedTeacher"]

PROTOCOL = 1  # memopd.teacher_server.PROTOCOL (not imported: the server module needs the serve extra's imports)


class _Pending:
    """The answers of one `submit`: `.result()` waits for them all."""

    def __init__(self, future: cf.Future):
        self._future = future

    def result(self):
        return self._future.result()


class ServedTeacher:
    """The teacher behind `url` (http://HOST:PORT). Connects at construction: `/info`
    fetched (with retries), its protocol checked; `.fingerprint` is the server's."""

    def __init__(self, url: str, *, secret_file: str | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, transport: str = "fp32", head_dir: str | None = None, inflight: int = 2,
                 resume_hint: str = "continue with --resume"):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
            raise UserError(f"teacher_url={url!r}: give http://HOST:PORT (the address `memopd serve-teacher` prints)")
        if transport not in TRANSPORT_DTYPES:
            raise UserError(f"teacher transport {transport!r}: choose one of {', '.join(TRANSPORT_DTYPES)}")
        self.url = f"{parsed.scheme}://{parsed.netloc}"
        self._parsed = parsed
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.transport = transport
        self.head_dir = head_dir
        self.resume_hint = resume_hint  # how the caller's run goes on once the server is back (said on a PeerError)
        self._headers = {"Content-Type": "application/octet-stream"}
        if secret_file:
            from .teacher_server import read_secret

            self._headers["Authorization"] = f"Bearer {read_secret(secret_file)}"
        self._local = threading.local()
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, int(inflight)), thread_name_prefix="memopd-teacher")
        self._producer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="memopd-teacher-pack")
        self.bytes_sent = self.bytes_received = 0  # body bytes, for measurements
        self._count_lock = threading.Lock()
        self.info = json.loads(self._request("GET", "/info"))
        if self.info.get("protocol") != PROTOCOL:
            raise UserError(f"the teacher server at {self.url} speaks protocol {self.info.get('protocol')!r}; this "
                            f"memopd speaks {PROTOCOL}: run the same memopd version on both sides")
        self._head: LMHead | None = None

    # ---- what the trainer reads -----------------------------------------------------
    @property
    def fingerprint(self) -> dict:
        """The server's weight fingerprint ({"sha256", "path", "files"}) and its url."""
        return {**self.info["fingerprint"], "url": self.url}

    @property
    def head_rows(self) -> int:
        return int(self.info["lm_head"]["shape"][0])

    @property
    def embedding_rows(self) -> int:
        return int(self.info["embedding_rows"])

    @property
    def hidden_size(self) -> int:
        return int(self.info["hidden_size"])

    def check(self, vocab_size: int) -> None:
        """Refuse, at connect, a teacher that cannot score `vocab_size` ids (another tokenizer)."""
        short = [f"{what} has {n} rows" for what, n in (("lm_head", self.head_rows), ("input embedding", self.embedding_rows))
                 if n < vocab_size]
        if short:
            raise UserError(f"the teacher served at {self.url}: its {' and its '.join(short)}, but this run scores "
                            f"vocab_size={vocab_size} ids: a teacher of another tokenizer? serve the teacher of this "
                            "student's tokenizer")

    def lm_head(self) -> LMHead:
        """The teacher's head (weight, bias, logit scale), read once: from the server, or
        from `head_dir` (a local copy of the teacher's files, same fingerprint)."""
        if self._head is None:
            spec = self.info["lm_head"]
            if self.head_dir:
                weight, bias = self._local_head(spec)
            else:
                t, meta = decode(self._request("GET", "/lm_head"), max_header=1 << 16)
                weight, bias = t.get("weight"), t.get("bias")
            if weight is None or list(weight.shape) != list(spec["shape"]) or (bias is not None) != bool(spec["bias"]):
                raise PeerError(f"the teacher server at {self.url} sent an lm_head that does not match its /info "
                                f"({None if weight is None else tuple(weight.shape)} vs {tuple(spec['shape'])})")
            self._head = LMHead(weight, bias, float(spec["scale"]))
        return self._head

    def _local_head(self, spec: dict):
        from safetensors import safe_open

        from .files import weights_fingerprint

        fp = weights_fingerprint(self.head_dir)
        want = self.info["fingerprint"]["sha256"]
        if fp is None or fp["sha256"] != want:
            raise UserError(f"teacher_head_dir={self.head_dir!r}: its weights (fingerprint "
                            f"{(fp or {}).get('sha256', 'none')[:16]}) are not the served teacher's ({want[:16]} at "
                            f"{self.url}): give a copy of the served teacher's directory, or leave it out to download")
        names = spec.get("tensors") or {}
        found: dict = {}
        for n in sorted(os.listdir(self.head_dir)):
            if n.endswith(".safetensors"):
                with safe_open(os.path.join(self.head_dir, n), framework="pt") as f:
                    for part in ("weight", "bias"):
                        if names.get(part) in f.keys():
                            found[part] = f.get_tensor(names[part])
        if "weight" not in found:
            raise UserError(f"teacher_head_dir={self.head_dir!r}: no safetensors file holds the head tensor "
                            f"{names.get('weight')!r}; leave teacher_head_dir out to download the head")
        return found["weight"], found.get("bias")

    # ---- scoring ----------------------------------------------------------------------
    def submit(self, make_batch: Callable[[], PackedBatch] | PackedBatch, max_tokens: int, *, output: str = "hidden",
               k: int = 0, temperature: float = 1.0, vocab_size: int = 0) -> _Pending:
        """Pack (`make_batch()`), cut into micro-batches of `max_tokens` and send each as it
        is cut, in the background; `.result()` is [A, H] fp32 hidden states (output="hidden")
        or ([A, k] int64 ids, [A, k] fp32 log-probs) (output="topk"; the ids travel as int32
        and are checked to lie in [0, vocab_size)), in action order, zero outside the teacher
        mask."""
        request = {"output": output, "dtype": self.transport}
        if output == "topk":
            request.update(k=int(k), temperature=float(temperature), vocab_size=int(vocab_size))

        def run():
            batch = make_batch() if callable(make_batch) else make_batch
            parts = []
            try:
                for mb in batch.iter_micro_batches(max_tokens):
                    tensors, meta = batch_to_wire(mb)
                    body = encode(tensors, {**meta, "request": request})
                    parts.append((mb, self._pool.submit(self._score_body, body)))
                return self._gather(batch, parts, output, k, vocab_size)
            except BaseException:
                for _, f in parts:
                    f.cancel()
                raise

        return _Pending(self._producer.submit(run))

    def hidden_states(self, batch: PackedBatch, max_tokens: int = 1 << 30) -> torch.Tensor:
        """[A, H] fp32 teacher hidden states of `batch` (zero outside its teacher mask)."""
        return self.submit(batch, max_tokens).result()

    def topk(self, batch: PackedBatch, k: int, *, temperature: float = 1.0, vocab_size: int = 0,
             max_tokens: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor]:
        """([A, k] ids, [A, k] log-probs) of the teacher's top k at `temperature` over the first
        `vocab_size` rows (0: all), zero outside the teacher mask."""
        return self.submit(batch, max_tokens, output="topk", k=k, temperature=temperature,
                           vocab_size=vocab_size or self.head_rows).result()

    def _score_body(self, body: bytes) -> dict:
        tensors, meta = decode(self._request("POST", "/score", body))
        want = self.info["fingerprint"]["sha256"]
        got = meta.get("weights")
        if got != want:  # the server was restarted with other weights since this client connected
            raise PeerError(f"the teacher server at {self.url} now answers with weights {str(got)[:16]}, but this "
                            f"run connected to weights {want[:16]}; scores of two teachers would be mixed, so nothing "
                            "of this step was written: serve the first teacher again and continue with --resume")
        return tensors

    def _gather(self, batch: PackedBatch, parts, output: str, k: int, vocab_size: int):
        A = batch.num_actions
        if output == "hidden":
            out = torch.zeros(A, self.hidden_size, dtype=torch.float32)
        else:
            ids, lps = torch.zeros(A, k, dtype=torch.long), torch.zeros(A, k, dtype=torch.float32)
        for mb, fut in parts:
            t = fut.result()
            rows = torch.nonzero(mb.teacher_mask.bool().cpu()).flatten()
            where = (mb.action_id.cpu() if mb.action_id is not None else torch.arange(A))[rows]
            if output == "hidden":
                h = t.get("hidden")
                if h is None or tuple(h.shape) != (rows.numel(), self.hidden_size):
                    raise PeerError(f"the teacher server at {self.url} answered with hidden states of shape "
                                    f"{None if h is None else tuple(h.shape)} for {rows.numel()} positions of width "
                                    f"{self.hidden_size}")
                out[where] = h.float()
            else:
                i, lp = t.get("topk_ids"), t.get("topk_logprobs")
                problem = topk_answer_problem(i, lp, rows.numel(), k, vocab_size or self.head_rows)
                if problem:
                    raise PeerError(f"the teacher server at {self.url} answered a top-{k} request with {problem}")
                ids[where], lps[where] = i.long(), lp.float()
        return out if output == "hidden" else (ids, lps)

    # ---- HTTP -------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
            c = cls(self._parsed.hostname, self._parsed.port, timeout=self.timeout)
            self._local.conn = c
        return c

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """The 200 body of one request, with bounded retries and backoff for transient failures."""
        t0 = time.monotonic()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                conn = self._conn()
                conn.request(method, path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut off
                self._drop()
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            with self._count_lock:
                self.bytes_sent += len(body or b"")
                self.bytes_received += len(data)
            if resp.status == 200:
                return data
            try:
                said = json.loads(data).get("error", "")
            except (ValueError, AttributeError):
                said = data[:200].decode(errors="replace")
            if resp.status == 429 or resp.status >= 500:
                last = f"HTTP {resp.status}: {said}"
                wait = resp.getheader("Retry-After")
                if resp.status == 429 and wait:
                    try:
                        time.sleep(min(float(wait), 10.0))
                    except ValueError:
                        pass
                continue
            raise UserError(f"the teacher server at {self.url} refused {method} {path} (HTTP {resp.status}): {said}")
        raise PeerError(f"the teacher server at {self.url} did not answer {method} {path} after {self.retries + 1} "
                        f"tries over {time.monotonic() - t0:.1f} s ({last}): it stopped or is unreachable; nothing of "
                        f"this step was written: start it again and {self.resume_hint}")

    def close(self) -> None:
        self._producer.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
