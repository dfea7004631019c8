"""The serving engine: one instance (a whole model, or this rank's TP shard) and its decode loop.

Requests wait in a queue and are admitted while fewer than ``concurrency`` are in flight; an admitted
request is prefilled at once (prefill first, as a server without chunked prefill does), so a long prompt
stalls the decode of the others. Decode is batched: one token for every in-flight request per step,
attending to its own cache. Greedy sampling (argmax), so runs are deterministic.

KV cache: one tensor per request (:func:`~labkit.parallel.serving.kv_cache.kv_cache_shape`), reserved at
admission and freed when the request finishes or is cancelled. :meth:`Engine.live_kv_bytes` *measures* the
bytes of the cache tensors still alive (weak references to every cache ever allocated: a leaked reference
keeps its bytes counted); :func:`labkit.theory.memory.kv_cache_bytes` *predicts* them.

Failures the loop survives: a cancel storm (``cancel_step``), a lost rank (``lose_at_step`` raises
:class:`RankLost` in the rank chosen to be lost) and a collective that fails because a TP peer is gone
(every in-flight request ends ``comm_timeout``).
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from dataclasses import dataclass, field

import torch

from labkit.checks import positive_int
from labkit.models import Transformer
from labkit.parallel.serving.kv_cache import decode, kv_cache_shape, prefill
from labkit.theory import memory as mem
from labkit.theory.spec import ModelSpec

#: server errors a request attempt can end with (failures: they count in the error rate)
ERROR_TYPES = ("rank_lost", "comm_timeout")
#: outcomes the client chose (not failures: counted on their own, outside the error rate)
CLIENT_OUTCOMES = ("cancelled",)
KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class RankLost(RuntimeError):
    """Raised inside the rank chosen to be lost, at the decode step chosen for it (failure injection)."""


def prompt_tokens(rid: int, prompt_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The prompt of request ``rid``: int64 [prompt_len], a pure function of (seed, rid), so every rank of a
    TP group and every replica builds the same prompt."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(rid))
    return torch.randint(vocab_size, (prompt_len,), generator=g)


def check_requests(spec: ModelSpec, requests: list[dict]) -> None:
    """Raise ValueError (:meth:`ModelSpec.check_seq_len`) for a request whose prompt_len + max_new_tokens
    exceeds the model's max_seq_len: its cache could not hold it."""
    for r in requests:
        try:
            spec.check_seq_len(r["prompt_len"] + r["max_new_tokens"], "prompt_len + max_new_tokens")
        except ValueError as e:
            raise ValueError(f"request {r['rid']}: {e}; shorten the prompt or the output") from None


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer is gone (gloo: timed out, connection closed)."""
    text = str(e)
    return any(m in text for m in ("Timed out", "timed out", "Connection closed", "Connection reset",
                                   "Broken pipe", "recvBytes", "sendBytes"))


@dataclass
class _Live:
    req: dict
    attempt: int
    tokens: list = field(default_factory=list)
    cache: torch.Tensor | None = None
    arrival_ns: int = 0
    admitted_ns: int = 0
    first_ns: int = 0
    prefill_ns: int = 0


class Engine:
    """One serving instance: a model (whole, or this rank's TP shard) and a decode loop over requests.

    ``ctx``: optional, anything with ``ctx.timeline`` (prefill / decode / cancel events go there) and
    ``ctx.now_ns()`` (the clock; default ``time.monotonic_ns``); ``seed``: prompt seed
    (:func:`prompt_tokens`). ``commlog``: optional factory of a collective log (a context manager with
    ``tagged(tag)`` and ``records``: dicts with ``op``, ``tag``, ``start_ns``, ``end_ns``, such as
    :class:`labkit.runtime.commlog.CommLog`); with it every collective of a serve call is recorded, tagged
    prefill / decode, and its time and count come back *measured*.
    """

    def __init__(self, model: Transformer, *, ctx=None, seed: int = 0, commlog=None):
        self.model = model.eval()
        self.spec = model.spec
        self.timeline = getattr(ctx, "timeline", None)
        self.now_ns = ctx.now_ns if ctx is not None else time.monotonic_ns
        self.seed = seed
        self.commlog = commlog
        self.tp = getattr(model, "tp", 1)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._caches: list[weakref.ref] = []
        self.kv_trace: list[dict] = []
        self.last_records: list[dict] = []
        self.last_queue: list[dict] = []

    # -- KV memory ---------------------------------------------------------------------------------------
    def alloc(self, capacity: int) -> torch.Tensor:
        """A zeroed cache for ``capacity`` tokens on this rank, tracked by :meth:`live_kv_bytes`."""
        t = torch.zeros(kv_cache_shape(self.model, capacity), dtype=self.dtype, device=self.device)
        self._caches.append(weakref.ref(t))
        return t

    def live_kv_bytes(self) -> int:
        """Measured: bytes of every KV cache tensor this engine allocated that is still alive."""
        alive = [(w, w()) for w in self._caches]
        self._caches = [w for w, t in alive if t is not None]
        return sum(t.untyped_storage().nbytes() for _, t in alive if t is not None)

    def predicted_kv_bytes(self, live: list[_Live]) -> int:
        """Predicted: :func:`labkit.theory.memory.kv_cache_bytes` of the tokens reserved by the live requests."""
        tokens = sum(x.req["prompt_len"] + x.req["max_new_tokens"] for x in live)
        return mem.kv_cache_bytes(self.spec, tokens, KV_DTYPE_NAMES[self.dtype], tp=self.tp)

    def _trace(self, t0: int, live: list[_Live], event: str = "") -> None:
        self.kv_trace.append({"t_s": (self.now_ns() - t0) / 1e9, "in_flight": len(live),
                              "kv_bytes_measured": self.live_kv_bytes(),
                              "kv_bytes_predicted": self.predicted_kv_bytes(live), "event": event})

    def _span(self, name, kind="compute", **tags):
        return self.timeline.span(name, kind, **tags) if self.timeline is not None else contextlib.nullcontext()

    # -- serving -----------------------------------------------------------------------------------------
    def serve(self, requests: list[dict], concurrency: int, *, cancel_step: int | None = None,
              lose_at_step: int | None = None, attempt: int | dict = 1, arrival_ns: dict | None = None,
              t0_ns: int | None = None) -> dict:
        """Serve ``requests`` (dicts ``{rid, kind, prompt_len, max_new_tokens}``) with at most ``concurrency``
        in flight.

        ``cancel_step``: at that decode step, cancel every other in-flight request (half, rounded up), free
        their caches and record the KV bytes measured before and after. ``lose_at_step``: raise
        :class:`RankLost` at that decode step (this rank is the one lost). A communication error in a step
        (a TP peer gone: gloo times out) fails every in-flight request with ``comm_timeout``; the requests
        never admitted are returned in ``unserved``. ``arrival_ns``: rid -> arrival time for retried requests
        (default: the start of this call); ``attempt``: the attempt number of every request, or rid -> attempt;
        ``t0_ns``: the clock origin of ``kv_trace``.

        Returns ``{"records": [...], "unserved": [...], "cancel": {...} or None, "failed": bool,
        "prefill_s", "decode_s", "comm_s", "comm_calls", "prefills", "steps", "wall_s"}`` (times measured on
        this rank; ``comm_calls``: ``"<prefill|decode>_<op>"`` -> collectives counted by the commlog).
        Raises ValueError for concurrency < 1 or a request longer than the model's context.
        """
        concurrency = positive_int("concurrency", concurrency)
        check_requests(self.spec, requests)
        now = self.now_ns
        start = now()
        t0 = start if t0_ns is None else t0_ns
        queue = list(requests)
        live: list[_Live] = []
        records: list[dict] = []
        cancel_info = None
        step = 0
        prefill_ns = decode_ns = 0
        arrivals = arrival_ns or {}
        failed = False
        self.last_records, self.last_queue = records, queue  # readable after RankLost

        def finish(x: _Live, status: str, end: int):
            dec_s = (end - x.first_ns) / 1e9 if x.first_ns else 0.0
            n = len(x.tokens)
            arr = x.arrival_ns
            records.append({
                "rid": x.req["rid"], "kind": x.req["kind"], "prompt_len": x.req["prompt_len"],
                "max_new_tokens": x.req["max_new_tokens"], "new_tokens": n, "status": status,
                "attempt": x.attempt, "ttft_s": (x.first_ns - arr) / 1e9 if x.first_ns else float("nan"),
                "queue_s": (x.admitted_ns - arr) / 1e9 if x.admitted_ns else float("nan"),
                "prefill_s": x.prefill_ns / 1e9, "e2e_s": (end - arr) / 1e9,
                "tps": (n - 1) / dec_s if n > 1 and dec_s > 0 else float("nan"),
                "tokens": list(x.tokens)})
            x.cache = None

        log = self.commlog() if self.commlog is not None else None
        with log if log is not None else contextlib.nullcontext():
            try:
                while queue or live:
                    while queue and len(live) < concurrency:
                        req = queue.pop(0)
                        x = _Live(req, attempt.get(req["rid"], 1) if isinstance(attempt, dict) else attempt,
                                  arrival_ns=arrivals.get(req["rid"], start), admitted_ns=now())
                        x.cache = self.alloc(req["prompt_len"] + req["max_new_tokens"])
                        live.append(x)
                        toks = prompt_tokens(req["rid"], req["prompt_len"], self.spec.vocab_size, self.seed)
                        t1 = now()
                        with self._span("prefill", microbatch=req["rid"]), _tagged(log, "prefill"):
                            logits = prefill(self.model, toks.to(self.device), x.cache)  # (V,)
                        x.tokens.append(int(logits.argmax()))
                        x.first_ns = now()
                        x.prefill_ns = x.first_ns - t1
                        prefill_ns += x.prefill_ns
                        self._trace(t0, live, "admit")
                        if req["max_new_tokens"] == 1:
                            live.remove(x)
                            finish(x, "ok", x.first_ns)
                    if not live:
                        continue
                    step += 1
                    if lose_at_step is not None and step == lose_at_step:
                        raise RankLost(f"rank lost at decode step {step} (failure injection)")
                    if cancel_step is not None and step == cancel_step:
                        before = self.live_kv_bytes()
                        pred_before = self.predicted_kv_bytes(live)
                        victims = live[::2]
                        with self._span("cancel", "other", step=step):
                            for x in victims:
                                live.remove(x)
                                finish(x, "cancelled", now())
                            gc.collect()
                        after = self.live_kv_bytes()
                        cancel_info = {"step": step, "cancelled": len(victims),
                                       "in_flight_before": len(victims) + len(live),
                                       "kv_bytes_before_measured": before, "kv_bytes_after_measured": after,
                                       "kv_bytes_freed_measured": before - after,
                                       "kv_bytes_before_predicted": pred_before,
                                       "kv_bytes_freed_predicted": pred_before - self.predicted_kv_bytes(live)}
                        self._trace(t0, live, "cancel")
                        if not live:
                            continue
                    toks = torch.tensor([x.tokens[-1] for x in live], device=self.device)  # (B,)
                    pos = torch.tensor([x.req["prompt_len"] + len(x.tokens) - 1 for x in live],
                                       device=self.device)  # (B,)
                    t1 = now()
                    with self._span("decode", step=step), _tagged(log, "decode"):
                        logits = decode(self.model, toks, pos, [x.cache for x in live])  # (B, V)
                    decode_ns += now() - t1
                    nxt = logits.argmax(-1).tolist()
                    end = now()
                    for x, tok in zip(list(live), nxt):
                        x.tokens.append(int(tok))
                        if len(x.tokens) >= x.req["max_new_tokens"]:
                            live.remove(x)
                            finish(x, "ok", end)
                    self._trace(t0, live, "step")
            except RankLost:
                end = now()
                for x in live:
                    finish(x, "rank_lost", end)
                live.clear()
                gc.collect()
                raise
            except RuntimeError as e:  # a collective failed: a TP peer is gone (gloo: timed out)
                if not is_comm_failure(e):
                    raise
                failed = True
                end = now()
                for x in live:
                    finish(x, "comm_timeout", end)
                live.clear()
                gc.collect()
                self._trace(t0, live, "failure")
        comm = log.records if log is not None else []
        calls: dict[str, int] = {}
        for r in comm:
            key = f"{r['tag']}_{r['op']}"
            calls[key] = calls.get(key, 0) + 1
        return {"records": records, "unserved": queue, "cancel": cancel_info, "failed": failed,
                "prefill_s": prefill_ns / 1e9, "decode_s": decode_ns / 1e9,
                "comm_s": sum(r["end_ns"] - r["start_ns"] for r in comm) / 1e9, "comm_calls": calls,
                "prefills": sum(1 for r in records if r["prefill_s"] > 0), "steps": step,
                "wall_s": (now() - start) / 1e9}


def _tagged(log, tag: str):
    return log.tagged(tag) if log is not None else contextlib.nullcontext()
