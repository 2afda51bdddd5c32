"""`memopd serve-teacher DIR`: the teacher as a server process, outside training memory.

It loads a teacher directory once and answers restored-state packed batches (the same
`PackedBatch` the in-process teacher gets, in the safetensors + JSON format of
`memopd.teacher_wire`) with the teacher's last hidden states at the teacher-masked
positions (fp32 or bf16, as asked), or with its top-k log-probs there. The trainer keeps
only the teacher's lm_head and computes the full-vocabulary KL with the fused op, exactly
as in process (`memopd.teacher_client.ServedTeacher` is the client).

Endpoints: `GET /info` (weight fingerprint, lm_head shape/dtype/scale, embedding rows,
limits), `GET /lm_head` (the head's weight and bias as safetensors), `POST /score`.

HTTP stack: uvicorn (ASGI server) + starlette (routing, requests, responses), the optional
extra `serve`. Python's own http.server says in its documentation that it is not for
production (it implements only basic security checks); uvicorn is a maintained server with
keep-alive, h11's strict HTTP/1.1 parsing, and graceful shutdown, and starlette is the thin
layer FastAPI itself sits on: nothing here needs FastAPI's schemas, since bodies are binary.

Faults and security: the server binds 127.0.0.1 unless `--host` says otherwise, and a
non-loopback address needs `--secret-file` (every request then carries
`Authorization: Bearer <secret>`). Bodies over `--max-request-mb`, batches over
`--max-tokens` tokens and requests over `--rate` a second are refused with one JSON error
(413, 413, 429); a malformed body is one 400; the server keeps serving after each.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import socket
import sys
import threading
import time

import torch

from .errors import UserError
from .teacher_wire import TRANSPORT_DTYPES, WireError, batch_from_wire, decode, encode

__all__ = ["TeacherService", "make_app", "serve_main", "read_secret", "PROTOCOL"]

PROTOCOL = 1  # the version of the wire protocol; /info reports it and the client checks it


def read_secret(path: str) -> str:
    """The shared secret in `path` (surrounding whitespace dropped); UserError if unusable."""
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as e:
        raise UserError(f"--secret-file {path!r}: {e.strerror or e}") from None
    if len(secret) < 16:
        raise UserError(f"--secret-file {path!r}: the secret has {len(secret)} characters; use at least 16 "
                        "(e.g. python3 -c 'import secrets; print(secrets.token_hex(32))' > FILE)")
    return secret


def _head_tensor_names(model, model_dir: str) -> dict:
    """{"weight": name, "bias": name | None}: the names under which the model's weight files
    store its lm_head (a tied head is stored as the input embedding), so that a client with a
    local copy of the same files can read the head without loading the model."""
    from safetensors import safe_open

    from .hf import lm_head_of

    head = lm_head_of(model)
    keys: set[str] = set()
    for n in sorted(os.listdir(model_dir)):
        if n.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, n), framework="pt") as f:
                keys.update(f.keys())
    out: dict = {}
    for part in ("weight", "bias"):
        t = getattr(head, part, None)
        names = [n for n, p in model.named_parameters(remove_duplicate=False) if t is not None and p is t]
        out[part] = next((n for n in names if n in keys), None)
    return out


class _RateLimit:
    """A token bucket: `rate` requests a second on average, bursts of up to `rate`."""

    def __init__(self, rate: float):
        self.rate = float(rate)
        self.tokens = max(1.0, self.rate)
        self.t = time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> float:
        """0 when a request may go now, else the seconds until one may."""
        if self.rate <= 0:
            return 0.0
        with self.lock:
            now = time.monotonic()
            self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rate


class TeacherService:
    """The loaded teacher and what the endpoints compute (no HTTP here)."""

    def __init__(self, model_dir: str, *, device: str = "auto", dtype: str = "fp32", attention_backend: str = "auto",
                 max_tokens: int = 65536, max_request_bytes: int = 64 << 20):
        from .files import weights_fingerprint
        from .hf import head_of
        from .models import check_model_dir, load_local_model

        if dtype not in TRANSPORT_DTYPES:
            raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(TRANSPORT_DTYPES)}")
        self.model_dir = os.path.abspath(check_model_dir(model_dir, "teacher"))
        self.fingerprint = weights_fingerprint(self.model_dir)
        if self.fingerprint is None:
            raise UserError(f"{model_dir!r} holds no weight files (*.safetensors, *.bin): not a teacher directory")
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        self.model = load_local_model(self.model_dir, what="teacher", dtype=TRANSPORT_DTYPES[dtype])
        self.model.to(dev).eval().requires_grad_(False)
        self.device = dev
        self.head = head_of(self.model)  # measured once: the scale the client's fused op applies
        self.attention_backend = attention_backend
        self.max_tokens = int(max_tokens)
        self.max_request_bytes = int(max_request_bytes)
        self.embedding_rows = int(self.model.get_input_embeddings().weight.shape[0])
        self.head_names = _head_tensor_names(self.model, self.model_dir)
        self.lock = threading.Lock()  # one forward at a time: they share the device

    def info(self) -> dict:
        w = self.head.weight
        return {
            "protocol": PROTOCOL,
            "fingerprint": {"sha256": self.fingerprint["sha256"], "path": self.fingerprint["path"],
                            "files": {n: {"sha256": f["sha256"]} for n, f in self.fingerprint["files"].items()}},
            "lm_head": {"shape": list(w.shape), "dtype": str(w.dtype).replace("torch.", ""),
                        "bias": self.head.bias is not None, "scale": self.head.scale, "tensors": self.head_names},
            "hidden_size": int(w.shape[1]),
            "embedding_rows": self.embedding_rows,
            "model_type": getattr(self.model.config, "model_type", None),
            "limits": {"max_tokens": self.max_tokens, "max_request_bytes": self.max_request_bytes},
        }

    def lm_head_body(self) -> bytes:
        t = {"weight": self.head.weight}
        if self.head.bias is not None:
            t["bias"] = self.head.bias
        return encode(t, {"scale": self.head.scale})

    @torch.no_grad()
    def score(self, body: bytes) -> bytes:
        """One request: a packed batch in, the teacher's output at its teacher-masked entries out."""
        from .hf import packed_hidden_states

        tensors, meta = decode(body)
        req = meta.get("request") if isinstance(meta.get("request"), dict) else {}
        output = req.get("output", "hidden")
        if output not in ("hidden", "topk"):
            raise WireError(f"request.output {output!r}: 'hidden' or 'topk'")
        batch = batch_from_wire(tensors, meta)
        if batch.num_tokens > self.max_tokens:
            raise _TooLarge(f"a batch of {batch.num_tokens} tokens; this server takes at most {self.max_tokens} "
                            "(--max-tokens): lower the trainer's max_tokens or raise the server's")
        ids = batch.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.embedding_rows):
            raise WireError(f"input ids outside the teacher's embedding rows [0, {self.embedding_rows})")
        rows = torch.nonzero(batch.teacher_mask.bool()).flatten()
        with self.lock:
            h = packed_hidden_states(self.model, batch, attention_backend=self.attention_backend)
            h = h.index_select(0, batch.pred_index.to(h.device)[rows.to(h.device)])
            if output == "hidden":
                dtype = req.get("dtype", "fp32")
                if dtype not in TRANSPORT_DTYPES:
                    raise WireError(f"request.dtype {dtype!r}: choose one of {', '.join(TRANSPORT_DTYPES)}")
                return encode({"hidden": h.to(TRANSPORT_DTYPES[dtype])}, self._answer_meta(rows))
            k, temperature, vocab = req.get("k"), req.get("temperature", 1.0), req.get("vocab_size")
            V = int(self.head.weight.shape[0])
            if not (isinstance(k, int) and 0 < k and isinstance(vocab, int) and k <= vocab <= V
                    and isinstance(temperature, (int, float)) and temperature > 0):
                raise WireError(f"top-k request needs integers 0 < k <= vocab_size <= {V} and temperature > 0; got "
                                f"k={k!r}, vocab_size={vocab!r}, temperature={temperature!r}")
            z = self.head.logits(h)[:, :vocab].float()
            lp = torch.log_softmax(z / float(temperature), dim=-1)
            top = lp.topk(k, dim=-1)
            return encode({"topk_ids": top.indices.to(torch.int32), "topk_logprobs": top.values},
                          self._answer_meta(rows))

    def _answer_meta(self, rows: torch.Tensor) -> dict:
        """The JSON of a /score answer: its row count and the weights that computed it (the
        client refuses an answer from other weights than it connected to)."""
        return {"rows": int(rows.numel()), "weights": self.fingerprint["sha256"]}


class _TooLarge(ValueError):
    pass


def make_app(service: TeacherService, *, secret: str | None = None, rate: float = 0.0):
    """The starlette application of `service`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    bucket = _RateLimit(rate)
    octet = "application/octet-stream"

    def error(status: int, message: str, **headers) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    def refused(request) -> JSONResponse | None:
        if secret is not None:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {secret}".encode()):
                return error(401, "missing or wrong shared secret (Authorization: Bearer ...)")
        wait = bucket.take()
        if wait:
            return error(429, f"rate limit of {bucket.rate:g} requests a second", **{"Retry-After": f"{wait:.3f}"})
        return None

    async def info(request):
        return refused(request) or JSONResponse(service.info())

    async def lm_head(request):
        no = refused(request)
        if no is not None:
            return no
        return Response(await run_in_threadpool(service.lm_head_body), media_type=octet)

    async def score(request):
        no = refused(request)
        if no is not None:
            return no
        limit = service.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return error(413, f"request body of {declared} bytes; this server takes at most {limit} "
                              "(--max-request-mb): lower the trainer's max_tokens or raise the server's limit")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                return error(413, f"request body over {limit} bytes (--max-request-mb)")
            chunks.append(chunk)
        try:
            out = await run_in_threadpool(service.score, b"".join(chunks))
        except _TooLarge as e:
            return error(413, str(e))
        except (WireError, ValueError) as e:  # a malformed request: one error answer, the server keeps serving
            return error(400, f"malformed request: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
        return Response(out, media_type=octet)

    return Starlette(routes=[Route("/info", info), Route("/lm_head", lm_head), Route("/score", score, methods=["POST"])])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="memopd serve-teacher",
        description="Serve a teacher's hidden states (or top-k log-probs) on restored packed batches, for "
                    "`memopd train teacher_url=http://HOST:PORT`.")
    p.add_argument("teacher", help="the teacher's model directory (a local HF causal-LM checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; others need --secret-file)")
    p.add_argument("--port", type=int, default=8765, help="port (0: a free one, printed)")
    p.add_argument("--secret-file", help="file holding a shared secret (>= 16 characters) every request must carry")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="fp32", choices=sorted(TRANSPORT_DTYPES), help="the teacher's weights")
    p.add_argument("--attention-backend", default="auto", help="memopd packed attention backend (auto, torch, triton)")
    p.add_argument("--max-tokens", type=int, default=65536, help="largest batch in tokens")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB")
    p.add_argument("--rate", type=float, default=200.0, help="requests a second (token bucket; 0: no limit)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    args = p.parse_args(argv)
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("memopd serve-teacher needs uvicorn and starlette: pip install 'memopd[serve]'") from None
    if not _is_loopback(args.host) and not args.secret_file:
        raise UserError(f"--host {args.host} is not a loopback address: give --secret-file FILE (a shared secret "
                        "the trainer reads with teacher_secret_file=FILE), or bind 127.0.0.1")
    secret = read_secret(args.secret_file) if args.secret_file else None
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    service = TeacherService(args.teacher, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                             max_tokens=args.max_tokens, max_request_bytes=int(args.max_request_mb * (1 << 20)))
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its port back at once
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise UserError(f"cannot bind {args.host}:{args.port}: {e.strerror or e}; choose another --port") from None
    sock.listen(128)  # connections wait in the backlog from now on, before uvicorn starts accepting
    host, port = sock.getsockname()[:2]
    info = service.info()
    print(f"memopd serve-teacher: {service.model_dir} (weights {info['fingerprint']['sha256'][:16]}, lm_head "
          f"{tuple(info['lm_head']['shape'])} {info['lm_head']['dtype']}, {service.device}) on http://{host}:{port}",
          flush=True)
    config = uvicorn.Config(make_app(service, secret=secret, rate=args.rate), log_level="warning", timeout_keep_alive=30,
                            access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(serve_main())
