"""Serving: a small decode loop with a KV cache on the lab's model, replicas vs tensor parallelism on the same
ranks, latency under load, and the failures a server must survive.

Measured (run side, inside ranks launched by :func:`labkit.launch`):

* :class:`Engine` — prefill (one prompt at a time, the whole prompt in one forward pass, its keys and values
  written into the request's KV cache) and batched decode (one token for every in-flight request per step,
  attending to its cache). Requests wait in a queue and are admitted while fewer than ``concurrency`` are in
  flight; an admitted request is prefilled at once (prefill first, as a server without chunked prefill does),
  so a long prompt stalls the decode of the others. Greedy sampling (argmax), so runs are deterministic.
* KV cache: one tensor per request, ``[n_layers, 2, n_kv_heads/tp, prompt_len + max_new_tokens, head_dim]``,
  reserved at admission and freed when the request finishes or is cancelled. :meth:`Engine.live_kv_bytes`
  *measures* the bytes of the cache tensors still alive (weak references to every cache ever allocated: a
  leaked reference keeps its bytes counted); :func:`labkit.theory.memory.kv_cache_bytes` *predicts* them.
* Tensor parallelism for inference with :func:`labkit.parallel.tensor.apply_tp` (the same model the training
  chapter splits): attention heads (query and key/value heads together, so grouped-query attention keeps its
  groups) and MLP hidden units column/row-parallel, one all-reduce after attention and one after the MLP
  per layer (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3), a vocabulary-parallel embedding (one more
  all-reduce) and output layer (its logits all-gathered to sample). The decode loop here only reads the
  layers' projections, so the whole and the split model run the same code. Every rank keeps
  ``n_kv_heads/tp`` heads of the cache.
* Metrics per request: TTFT (time to first token: queueing + prefill, from the request's arrival), TPS
  (decode tokens per second of that request, after its first token), end-to-end time; per run: p50/p95 of
  both (the p95 of TPS is the slow tail: the rate 95 % of requests reach), aggregate tokens/s, prefill vs
  decode time, time in collectives and their count per step (TP).
* Failures: a cancel storm (half the in-flight requests cancelled at one step; the KV bytes measured before
  and after) and a lost rank (replicas: the lost replica's requests fail and are retried on the others,
  which never stop serving; TP: the survivors' next all-reduce times out, every in-flight request fails and
  is retried once the group is rebuilt with a replacement rank). Errors are counted by type.

Predicted (pure arithmetic, no launch): :func:`predict_deployments` — replicas vs TP for a published model on
real GPUs (memory from :mod:`labkit.theory.memory`, all-reduce time from :mod:`labkit.theory.costmodel`, a roofline for
prefill and decode).

Every table says in a ``source`` column whether its numbers are measured or predicted.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import math
import weakref
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.models import Transformer, apply_rope, build_model
from labkit.runtime.timeline import now_ns
from labkit.theory import memory as mem
from labkit.theory import tensor as tensor_theory
from labkit.theory.spec import ModelSpec, get_spec

MODES = ("replicas", "tp")
#: server errors a request attempt can end with (failures: they count in the error rate)
ERROR_TYPES = ("rank_lost", "comm_timeout")
#: outcomes the client chose (not failures: counted on their own, outside the error rate)
CLIENT_OUTCOMES = ("cancelled",)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class RankLost(RuntimeError):
    """Raised inside the rank chosen to be lost, at the decode step chosen for it (failure injection)."""


# ------------------------------------------------------------------------------------------------------
# workload
# ------------------------------------------------------------------------------------------------------
def make_workload(n_requests: int = 16, *, short_prompt: int = 16, long_prompt: int = 96, long_every: int = 4,
                  output_len: int = 16) -> list[dict]:
    """A mixed load: ``n_requests`` requests, every ``long_every``-th one (rid 0, long_every, ...) with a
    ``long_prompt``-token prompt, the others ``short_prompt`` tokens; each asks for ``output_len`` new tokens.
    Returns plain dicts ``{rid, kind, prompt_len, max_new_tokens}``; all requests arrive at time 0 (a closed
    loop: the concurrency cap decides when each is admitted).

    Raises ValueError for non-positive sizes.
    """
    n_requests = positive_int("n_requests", n_requests)
    short_prompt = positive_int("short_prompt", short_prompt)
    long_prompt = positive_int("long_prompt", long_prompt)
    long_every = positive_int("long_every", long_every)
    output_len = positive_int("output_len", output_len)
    return [{"rid": i, "kind": "long" if i % long_every == 0 else "short",
             "prompt_len": long_prompt if i % long_every == 0 else short_prompt, "max_new_tokens": output_len}
            for i in range(n_requests)]


def prompt_tokens(rid: int, prompt_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The prompt of request ``rid``: int64 [prompt_len], a pure function of (seed, rid), so every rank of a
    TP group and every replica builds the same prompt."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(rid))
    return torch.randint(vocab_size, (prompt_len,), generator=g)


def _check_workload(spec: ModelSpec, requests: list[dict]) -> None:
    for r in requests:
        ctx_len = r["prompt_len"] + r["max_new_tokens"]
        if ctx_len > spec.max_seq_len:
            raise ValueError(f"request {r['rid']}: prompt_len + max_new_tokens = {ctx_len} exceeds the model's "
                             f"max_seq_len={spec.max_seq_len}; shorten the prompt or the output")


# ------------------------------------------------------------------------------------------------------
# tensor parallelism for inference: labkit.parallel.tensor (its rules and counts: labkit.theory.tensor)
# ------------------------------------------------------------------------------------------------------
def check_tp(spec: ModelSpec, tp: int, *, pad_vocab: bool = False) -> dict:
    """Raise ValueError unless ``tp`` can split ``spec`` for serving: :func:`labkit.theory.tensor.check_tp`
    with ``kv_cache=True`` (heads, ffn_hidden_size, vocabulary unless ``pad_vocab``, and tp must divide
    n_kv_heads: every rank keeps its own kv heads' cache, as :func:`labkit.theory.memory.kv_cache_bytes`
    counts it; replicated kv heads are not served here). Returns the plan."""
    return tensor_theory.check_tp(spec, tp, pad_vocab=pad_vocab, kv_cache=True)


def shard_tp(model: Transformer, group):
    """The whole ``model`` (identical on every rank) split over ``group`` with
    :func:`labkit.parallel.tensor.apply_tp`: attention heads and MLP hidden units column/row-parallel
    (Shoeybi et al. 2019, Sec. 3), vocabulary-parallel embedding and output layer. ``model`` is consumed
    (pass a copy). Raises ValueError from :func:`check_tp`."""
    from labkit.parallel.tensor import apply_tp

    check_tp(model.spec, dist.get_world_size(group))
    return apply_tp(model, group)


def collectives_per_forward(spec: ModelSpec, tp: int) -> dict:
    """*Predicted* collectives of one TP forward pass (a prefill, or one decode step for the whole batch):
    :func:`labkit.theory.tensor.collectives_per_forward` with the logits gathered to sample —
    ``all_reduce`` = 2 per layer + 1 (the vocabulary-parallel embedding), ``all_gather`` = 1. Zero for
    tp = 1. Raises ValueError for a tp the model cannot use."""
    return tensor_theory.collectives_per_forward(spec, tp, gather_logits=True)


def _gather_vocab(model, logits: torch.Tensor) -> torch.Tensor:
    """A TP model's vocabulary blocks [..., Vp/tp] all-gathered to [..., vocab_size]; others unchanged."""
    if getattr(model, "tp", 1) > 1:
        from labkit.parallel.tensor import gather_from_tp_region

        logits = gather_from_tp_region(logits, model.group)[..., : model.vocab_size]
    return logits


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits of hidden ``x`` [B, T, H] -> [B, T, vocab_size]."""
    return _gather_vocab(model, model.head(x))


# ------------------------------------------------------------------------------------------------------
# prefill and decode with a KV cache
# ------------------------------------------------------------------------------------------------------
def _qkv(attn, x: torch.Tensor, pos: torch.Tensor):
    """q [B, hq, T, d], k/v [B, hk, T, d] of ``attn`` for x [B, T, H] at positions ``pos`` ([T], or [B, 1]
    for one token per sequence at different positions)."""
    b, t, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(b, t, -1, d).transpose(1, 2)
    k = attn.wk(x).view(b, t, -1, d).transpose(1, 2)
    v = attn.wv(x).view(b, t, -1, d).transpose(1, 2)
    if attn.use_rope:
        cos, sin = attn.rope_cos[pos], attn.rope_sin[pos]
        if pos.dim() == 2:  # [B, 1, d/2] -> [B, 1, 1, d/2]: broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


def _repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    return k.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else k


def kv_cache_shape(model: Transformer, capacity: int) -> tuple[int, ...]:
    """Shape of one request's cache on this rank: [n_layers, 2, local kv heads, capacity, head_dim]."""
    a = model.layers[0].attn
    return (len(model.layers), 2, a.wk.out_features // a.head_dim, capacity, a.head_dim)


@torch.inference_mode()
def prefill(model: Transformer, tokens: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Run the whole prompt ``tokens`` (int64 [T]) through ``model``, writing keys and values of positions
    0..T-1 into ``cache`` ([n_layers, 2, kv heads, capacity >= T, d]). Returns the logits of the last
    position, [vocab_size]."""
    t = tokens.shape[0]
    pos = torch.arange(t, device=tokens.device)
    x = model.embed_tokens(tokens[None], pos)
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = layer.attn_norm(x)
        q, k, v = _qkv(a, h, pos)
        cache[i, 0, :, :t] = k[0]
        cache[i, 1, :, :t] = v[0]
        n_rep = q.shape[1] // k.shape[1]
        o = a.core(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), causal=True)
        x = x + a.wo(o.transpose(1, 2).reshape(1, t, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    return _logits(model, x[:, -1:])[0, 0]


@torch.inference_mode()
def decode(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor]):
    """One decode step for B sequences: ``tokens`` int64 [B] (each sequence's latest token), ``positions``
    int64 [B] (where that token sits), ``caches`` their B caches (positions 0..p-1 filled; position p is
    written here). Returns logits [B, vocab_size]. The linear layers run batched; attention runs per
    sequence over its own cache length (no padding)."""
    b = tokens.shape[0]
    x = model.embed(tokens[:, None])
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions)[:, None]
    pos2 = positions[:, None]
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = layer.attn_norm(x)
        q, k, v = _qkv(a, h, pos2)
        n_rep = q.shape[1] // k.shape[1]
        outs = []
        for j in range(b):
            p = int(positions[j])
            c = caches[j]
            c[i, 0, :, p] = k[j, :, 0]
            c[i, 1, :, p] = v[j, :, 0]
            kk = _repeat_kv(c[i, 0, :, : p + 1], n_rep)[None]
            vv = _repeat_kv(c[i, 1, :, : p + 1], n_rep)[None]
            outs.append(a.core(q[j : j + 1], kk, vv, causal=False))  # one query sees every cached key
        o = torch.cat(outs)
        x = x + a.wo(o.transpose(1, 2).reshape(b, 1, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    return _logits(model, x)[:, 0]


# ------------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------------
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

    ``timeline``: where prefill / decode / cancel events go (``ctx.timeline``); ``seed``: prompt seed
    (:func:`prompt_tokens`). With a TP model (:func:`shard_tp`) every collective of a serve call is recorded
    (:class:`labkit.runtime.commlog.CommLog`, tagged prefill / decode): its time and count come back *measured*.
    """

    def __init__(self, model: Transformer, *, timeline=None, seed: int = 0):
        self.model = model.eval()
        self.spec = model.spec
        self.timeline = timeline
        self.seed = seed
        self.tp = getattr(model, "tp", 1)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._caches: list[weakref.ref] = []
        self.kv_trace: list[dict] = []
        self.last_records: list[dict] = []
        self.last_queue: list[dict] = []

    # -- KV memory ---------------------------------------------------------------------------------------
    def _alloc(self, capacity: int) -> torch.Tensor:
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
        return mem.kv_cache_bytes(self.spec, tokens, _KV_DTYPE_NAMES[self.dtype], tp=self.tp)

    def _trace(self, t0: int, live: list[_Live], event: str = "") -> None:
        self.kv_trace.append({"t_s": (now_ns() - t0) / 1e9, "in_flight": len(live),
                              "kv_bytes_measured": self.live_kv_bytes(),
                              "kv_bytes_predicted": self.predicted_kv_bytes(live), "event": event})

    def _span(self, name, kind="compute", **tags):
        return self.timeline.span(name, kind, **tags) if self.timeline is not None else contextlib.nullcontext()

    # -- serving -----------------------------------------------------------------------------------------
    def serve(self, requests: list[dict], concurrency: int, *, cancel_step: int | None = None,
              lose_at_step: int | None = None, attempt: int | dict = 1, arrival_ns: dict | None = None,
              t0_ns: int | None = None) -> dict:
        """Serve ``requests`` (dicts from :func:`make_workload`) with at most ``concurrency`` in flight.

        ``cancel_step``: at that decode step, cancel every other in-flight request (half, rounded up), free
        their caches and record the KV bytes measured before and after. ``lose_at_step``: raise
        :class:`RankLost` at that decode step (this rank is the one lost). A communication error in a step
        (a TP peer gone: gloo times out) fails every in-flight request with ``comm_timeout``; the requests
        never admitted are returned in ``unserved``. ``arrival_ns``: rid -> arrival time for retried requests
        (default: the start of this call); ``attempt``: the attempt number of every request, or rid -> attempt;
        ``t0_ns``: the clock origin of ``kv_trace``.

        Returns ``{"records": [...], "unserved": [...], "cancel": {...} or None, "failed": bool,
        "prefill_s", "decode_s", "comm_s", "comm_calls", "prefills", "steps", "wall_s"}`` (times measured on
        this rank; ``comm_calls``: ``"<prefill|decode>_<op>"`` -> collectives counted by CommLog, TP only).
        """
        concurrency = positive_int("concurrency", concurrency)
        _check_workload(self.spec, requests)
        start = now_ns()
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

        with self._commlog() as log:
            try:
                while queue or live:
                    while queue and len(live) < concurrency:
                        req = queue.pop(0)
                        x = _Live(req, attempt.get(req["rid"], 1) if isinstance(attempt, dict) else attempt,
                                  arrival_ns=arrivals.get(req["rid"], start), admitted_ns=now_ns())
                        x.cache = self._alloc(req["prompt_len"] + req["max_new_tokens"])
                        live.append(x)
                        toks = prompt_tokens(req["rid"], req["prompt_len"], self.spec.vocab_size, self.seed)
                        t1 = now_ns()
                        with self._span("prefill", microbatch=req["rid"]), _tagged(log, "prefill"):
                            logits = prefill(self.model, toks.to(self.device), x.cache)
                        x.tokens.append(int(logits.argmax()))
                        x.first_ns = now_ns()
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
                                finish(x, "cancelled", now_ns())
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
                    toks = torch.tensor([x.tokens[-1] for x in live], device=self.device)
                    pos = torch.tensor([x.req["prompt_len"] + len(x.tokens) - 1 for x in live], device=self.device)
                    t1 = now_ns()
                    with self._span("decode", step=step), _tagged(log, "decode"):
                        logits = decode(self.model, toks, pos, [x.cache for x in live])
                    decode_ns += now_ns() - t1
                    nxt = logits.argmax(-1).tolist()
                    end = now_ns()
                    for x, tok in zip(list(live), nxt):
                        x.tokens.append(int(tok))
                        if len(x.tokens) >= x.req["max_new_tokens"]:
                            live.remove(x)
                            finish(x, "ok", end)
                    self._trace(t0, live, "step")
            except RankLost:
                end = now_ns()
                for x in live:
                    finish(x, "rank_lost", end)
                live.clear()
                gc.collect()
                raise
            except RuntimeError as e:  # a collective failed: a TP peer is gone (gloo: timed out)
                if not _is_comm_failure(e):
                    raise
                failed = True
                end = now_ns()
                for x in live:
                    finish(x, "comm_timeout", end)
                live.clear()
                gc.collect()
                self._trace(t0, live, "failure")
        comm = log.to_frame() if log is not None else pd.DataFrame(columns=["op", "tag", "start_ns", "end_ns"])
        calls = {f"{tag}_{op}": int(n) for (tag, op), n in comm.groupby(["tag", "op"]).size().items()}
        return {"records": records, "unserved": queue, "cancel": cancel_info, "failed": failed,
                "prefill_s": prefill_ns / 1e9, "decode_s": decode_ns / 1e9,
                "comm_s": float((comm["end_ns"] - comm["start_ns"]).sum()) / 1e9, "comm_calls": calls,
                "prefills": sum(1 for r in records if r["prefill_s"] > 0), "steps": step,
                "wall_s": (now_ns() - start) / 1e9}

    def _commlog(self):
        if self.tp == 1:
            return contextlib.nullcontext()
        from labkit.runtime.commlog import CommLog

        return CommLog()


def _tagged(log, tag: str):
    return log.tagged(tag) if log is not None else contextlib.nullcontext()


def _is_comm_failure(e: BaseException) -> bool:
    text = str(e)
    return any(m in text for m in ("Timed out", "timed out", "Connection closed", "Connection reset",
                                   "Broken pipe", "recvBytes", "sendBytes"))


# ------------------------------------------------------------------------------------------------------
# the rank function: every serving experiment of a chapter in one launch
# ------------------------------------------------------------------------------------------------------
def _model(plan: dict) -> Transformer:
    return build_model(plan["model"], seed=plan.get("seed", 0), dtype=_TORCH_DTYPES[plan.get("dtype", "float32")],
                       attention=plan.get("attention", "sdpa"))


def _tp_engine(ctx, plan: dict, full: Transformer, group) -> Engine:
    return Engine(shard_tp(copy.deepcopy(full), group), timeline=ctx.timeline, seed=plan.get("seed", 0))


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _parity(ctx, plan: dict, full: Transformer, group) -> dict:
    """Max |difference| of (a) cached prefill + decode vs the full forward pass of the whole model, and
    (b) the TP model's full forward pass vs the whole model's, on one sequence."""
    spec = full.spec
    t = min(24, spec.max_seq_len - 4)
    seq = prompt_tokens(10_000, t + 4, spec.vocab_size, plan.get("seed", 0)).to(ctx.device)
    with torch.inference_mode():
        ref = full(seq[None])[0]  # [T+4, V]
    eng = Engine(full, seed=plan.get("seed", 0))
    cache = eng._alloc(t + 4)
    got = [prefill(full, seq[:t], cache)]
    for p in range(t, t + 3):
        got.append(decode(full, seq[p : p + 1], torch.tensor([p], device=ctx.device), [cache])[0])
    cached_diff = float((torch.stack(got) - ref[t - 1 : t + 3]).abs().max())
    out = {"cached_vs_full_max_abs": cached_diff, "tp": 1, "tp_vs_whole_max_abs": 0.0}
    if ctx.world_size > 1:
        tp_model = shard_tp(copy.deepcopy(full), group)
        with torch.inference_mode():
            tp_logits = _gather_vocab(tp_model, tp_model(seq[None]))[0]
        tcache = torch.zeros(kv_cache_shape(tp_model, t + 4), dtype=cache.dtype, device=ctx.device)
        tp_pre = prefill(tp_model, seq[:t], tcache)
        out.update({"tp": ctx.world_size, "tp_vs_whole_max_abs": float((tp_logits - ref).abs().max()),
                    "tp_cached_vs_whole_max_abs": float((tp_pre - ref[t - 1]).abs().max()),
                    "tp_kv_bytes_per_rank": tcache.untyped_storage().nbytes(),
                    "whole_kv_bytes": cache.untyped_storage().nbytes()})
    return out


def _serve_mode(ctx, plan, full, mode, requests, concurrency, group, **kw) -> dict:
    """One run of ``mode`` at total ``concurrency``: replicas split requests round-robin and concurrency
    evenly; TP serves all of them with the whole concurrency on every rank (rank 0 reports)."""
    w = ctx.world_size
    if mode == "replicas":
        eng = Engine(full, timeline=ctx.timeline, seed=plan.get("seed", 0))
        mine = requests[ctx.rank :: w]
        ctx.barrier()
        out = eng.serve(mine, concurrency // w, **kw)
    else:
        eng = _tp_engine(ctx, plan, full, group)
        ctx.barrier()
        out = eng.serve(requests, concurrency, **kw)
    out["kv_trace"] = eng.kv_trace
    out["rank"] = ctx.rank
    return out


def _rank_loss(ctx, plan, full, requests, spec_loss: dict) -> dict:
    """Lose rank ``world_size - 1`` at decode step ``step``: replicas (others keep serving, the lost
    replica's requests are retried on them) and TP (every in-flight request fails on a timeout; retried once
    the TP group is rebuilt with a replacement rank)."""
    w, lost = ctx.world_size, ctx.world_size - 1
    conc, step = spec_loss["concurrency"], spec_loss["step"]
    timeout = datetime.timedelta(seconds=spec_loss.get("detect_timeout_s", 1.0))
    seed = plan.get("seed", 0)
    result = {}
    # -- replicas --------------------------------------------------------------------------------------
    eng = Engine(full, timeline=ctx.timeline, seed=seed)
    mine = requests[ctx.rank :: w]
    ctx.barrier()
    t0 = now_ns()
    recs, unserved = [], []
    try:
        with ctx.timer("replicas: serving", "other"):
            out = eng.serve(mine, conc // w, lose_at_step=step if ctx.rank == lost else None, t0_ns=t0)
        recs, unserved = out["records"], out["unserved"]
    except RankLost:
        recs = eng.last_records
        lost_ids = {x["rid"] for x in recs if x["status"] == "rank_lost"}
        unserved = [r for r in mine if r["rid"] in lost_ids] + list(eng.last_queue)
    # the router learns which replica is down and re-routes its unfinished requests to the survivors
    gathered = _gather({"records": recs, "retry": unserved if ctx.rank == lost else []})
    retry = [r for g in gathered for r in g["retry"]]
    failed_ids = {x["rid"] for g in gathered for x in g["records"] if x["status"] != "ok"}
    retry_recs = []
    if ctx.rank != lost and retry:
        survivors = [r for r in range(w) if r != lost]
        share = retry[survivors.index(ctx.rank) :: len(survivors)]
        out2 = eng.serve(share, max(1, conc // w), attempt={rid: 2 for rid in failed_ids},
                         arrival_ns={r["rid"]: t0 for r in share}, t0_ns=t0)
        retry_recs = out2["records"]
    gathered2 = _gather(retry_recs)
    all_recs = [dict(r, replica=i) for i, g in enumerate(gathered) for r in g["records"]]
    all_recs += [dict(r, replica=i) for i, g in enumerate(gathered2) for r in g]
    result["replicas"] = all_recs
    # -- tensor parallel ---------------------------------------------------------------------------------
    group = dist.new_group(list(range(w)), timeout=timeout, backend=dist.get_backend())
    eng = _tp_engine(ctx, plan, full, group)
    ctx.barrier()
    t0 = now_ns()
    recs = []
    if ctx.rank == lost:
        try:
            eng.serve(requests, conc, lose_at_step=step, t0_ns=t0)
        except RankLost:
            pass
        recs = eng.last_records
        retry = None
    else:
        with ctx.timer("tp: serving until the failure", "other"):
            out = eng.serve(requests, conc, t0_ns=t0)
        recs = out["records"]
        done = {r["rid"] for r in recs if r["status"] == "ok"}
        retry = {"requests": [r for r in requests if r["rid"] not in done],
                 "failed": [r["rid"] for r in recs if r["status"] != "ok"]}
    # a replacement for the lost rank joins; every rank rebuilds the TP group and reloads its shard
    with ctx.timer("tp: rebuild group", "other"):
        t_rebuild = now_ns()
        group2 = dist.new_group(list(range(w)), backend=dist.get_backend())
        eng2 = _tp_engine(ctx, plan, full, group2)
        retry = _gather(retry)[0]  # rank 0 (a survivor) knows what failed
        rebuild_s = (now_ns() - t_rebuild) / 1e9
    out2 = eng2.serve(retry["requests"], conc, attempt={rid: 2 for rid in retry["failed"]},
                      arrival_ns={r["rid"]: t0 for r in retry["requests"]}, t0_ns=t0)
    result["tp"] = [dict(r, replica=0) for r in (recs if ctx.rank == 0 else [])] + \
                   ([dict(r, replica=0) for r in out2["records"]] if ctx.rank == 0 else [])
    result["tp_rebuild_s"] = rebuild_s
    result["detect_timeout_s"] = timeout.total_seconds()
    result["lost_rank"] = lost
    result["step"] = step
    return result


def serve_rank(ctx, plan: dict) -> dict:
    """Every serving experiment of a plan, in one launch (a rank function for :func:`labkit.launch`).

    ``plan`` keys: ``model`` (preset name), ``seed``, ``dtype`` ("float32"/"bfloat16"), ``attention``,
    ``workload`` (kwargs of :func:`make_workload`), ``modes`` (subset of :data:`MODES`), ``ramp`` (total
    concurrency levels, each a multiple of world_size), ``warmup`` (bool), ``parity`` (bool), ``cancel``
    (``{"concurrency", "step"}`` or None), ``rank_loss`` (``{"concurrency", "step", "detect_timeout_s"}`` or
    None; needs world_size >= 2). Returns a dict of plain data; rank 0's is the one to read.
    """
    torch.manual_seed(plan.get("seed", 0))
    full = _model(plan).to(ctx.device)
    requests = make_workload(**plan.get("workload", {}))
    group = dist.group.WORLD
    out: dict = {"rank": ctx.rank, "world_size": ctx.world_size, "runs": []}
    if plan.get("parity", True):
        out["parity"] = _parity(ctx, plan, full, group)
    if plan.get("warmup", True):
        warm = make_workload(ctx.world_size, short_prompt=8, long_prompt=8, output_len=3)
        for mode in plan.get("modes", MODES):
            if mode == "tp" and ctx.world_size == 1:
                continue
            _serve_mode(ctx, plan, full, mode, warm, ctx.world_size, group)
    for conc in plan.get("ramp", [ctx.world_size]):
        for mode in plan.get("modes", MODES):
            run = _serve_mode(ctx, plan, full, mode, requests, conc, group)
            gathered = _gather({k: run[k] for k in ("records", "prefill_s", "decode_s", "comm_s", "comm_calls",
                                                      "prefills", "wall_s", "steps", "kv_trace", "rank")})
            if ctx.rank == 0:
                out["runs"].append({"mode": mode, "concurrency": conc, "per_rank": gathered})
    if plan.get("cancel"):
        c = plan["cancel"]
        eng = Engine(full, timeline=ctx.timeline, seed=plan.get("seed", 0))
        ctx.barrier()
        res = eng.serve(requests[ctx.rank :: ctx.world_size], c["concurrency"], cancel_step=c["step"])
        res["kv_bytes_at_end_measured"] = eng.live_kv_bytes()
        res["kv_trace"] = eng.kv_trace
        out["cancel"] = _gather({k: res[k] for k in ("records", "cancel", "kv_trace", "kv_bytes_at_end_measured")})
    if plan.get("rank_loss") and ctx.world_size > 1:
        out["rank_loss"] = _rank_loss(ctx, plan, full, requests, plan["rank_loss"])
    return out


# ------------------------------------------------------------------------------------------------------
# notebook side: one launch, then tables
# ------------------------------------------------------------------------------------------------------
def default_model(world_size: int) -> str:
    """The lab model a serving chapter uses: ``lab-tiny-llama`` (2 kv heads) up to world_size 2,
    ``lab-small-llama`` (4 kv heads, so TP=4 splits them) above."""
    return "lab-tiny-llama" if world_size <= 2 else "lab-small-llama"


def make_plan(world_size: int, *, model: str | None = None, n_requests: int = 16, short_prompt: int = 16,
              long_prompt: int = 96, long_every: int = 4, output_len: int = 16, ramp=None,
              modes=MODES, cancel_step: int | None = 4, lose_at_step: int | None = 3,
              detect_timeout_s: float = 1.0, dtype: str = "float32", attention: str = "sdpa", seed: int = 0,
              parity: bool = True, warmup: bool = True) -> dict:
    """Validate the arguments of :func:`run` and build the plan :func:`serve_rank` executes.

    ``ramp``: total concurrency levels (default world_size x 1, 2, 4), each a multiple of world_size (the
    replicas share it evenly). On one rank only the replica mode runs (TP over one rank is the same).
    ``cancel_step`` / ``lose_at_step``: decode step of the cancel storm / of the rank loss (None: skip it);
    both run at the largest concurrency of the ramp.

    Raises ValueError naming the bad value: unknown model, mode or dtype; tp (= world_size) not dividing the
    model's heads; a concurrency that is not a multiple of world_size; a request longer than max_seq_len;
    cancel_step or lose_at_step not below output_len (the first requests would be done by then).
    """
    world_size = positive_int("world_size", world_size)
    model = model or default_model(world_size)
    spec = get_spec(model)
    modes = list(modes)
    for m in modes:
        check_choice("mode", m, MODES)
    if world_size == 1:  # TP over one rank is a replica: run it once
        modes = ["replicas"]
    check_choice("dtype", dtype, tuple(_TORCH_DTYPES))
    if "tp" in modes and world_size > 1:
        check_tp(spec, world_size)
    ramp = list(ramp) if ramp is not None else [world_size, 2 * world_size, 4 * world_size]
    for c in ramp:
        if positive_int("concurrency", c) % world_size:
            eg = ", ".join(str(world_size * k) for k in (1, 2, 3))
            raise ValueError(f"ramp={ramp}: concurrency={c} is not a multiple of world_size={world_size} (each "
                             f"replica takes concurrency / world_size requests at a time); each concurrency must "
                             f"be a multiple of world_size={world_size}, e.g. {eg}")
    workload = {"n_requests": n_requests, "short_prompt": short_prompt, "long_prompt": long_prompt,
                "long_every": long_every, "output_len": output_len}
    _check_workload(spec, make_workload(**workload))
    for name, step in (("cancel_step", cancel_step), ("lose_at_step", lose_at_step if world_size > 1 else None)):
        if step is not None and step >= output_len:
            # a later step is never reached by the first requests: the experiment would not happen
            raise ValueError(f"{name}={step} must be below output_len={output_len}, so that the first requests are "
                             f"still decoding at that step: use 1 to {output_len - 1}, or None to skip it")
    top = max(ramp)
    plan = {"model": model, "seed": seed, "dtype": dtype, "attention": attention, "workload": workload,
            "modes": modes, "ramp": ramp, "parity": parity, "warmup": warmup}
    if cancel_step is not None:
        plan["cancel"] = {"concurrency": top // world_size, "step": positive_int("cancel_step", cancel_step)}
    if lose_at_step is not None and world_size > 1:
        plan["rank_loss"] = {"concurrency": top, "step": positive_int("lose_at_step", lose_at_step),
                             "detect_timeout_s": positive_float("detect_timeout_s", detect_timeout_s)}
    return plan


def check_chapter(*, world_size: int, model: str | None, n_requests: int, short_prompt: int, long_prompt: int,
                  output_len: int, ramp, cancel_step: int | None, lose_at_step: int | None, detect_timeout_s: float,
                  backend: str, big_model: str, gpus: int, gpu: str, concurrency_gpu: int, prompt_len_gpu: int,
                  output_len_gpu: int) -> dict:
    """Validate chapter 10's parameters before anything is launched (the chapter's first code cell). Returns
    ``{"model", "plan", "backend"}``: the model name (``model`` or :func:`default_model`), :func:`make_plan`'s
    plan and the backend the launch will use.

    Raises ValueError naming the value and the fix: world_size < 2 (replicas vs TP needs two ranks to split or
    replicate over), anything :func:`make_plan` refuses (tp = world_size not dividing the model's heads or kv
    heads, a concurrency that is not a multiple of world_size, a request longer than the model's max_seq_len,
    steps < 1, cancel_step or lose_at_step >= output_len), a model this machine's memory cannot hold, a backend
    the machine cannot run, what :func:`predict_deployments` refuses (unknown big model or GPU, sizes < 1), and
    a big model that fits on no TP degree of gpus x gpu (:func:`check_deployments_fit`)."""
    from labkit.chapters.common import check_fits_in_memory, check_world_size
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("10", world_size, why="replicas vs tensor parallelism on the same ranks")
    model = model or default_model(world_size)
    try:
        check_tp(get_spec(model), world_size)
    except ValueError as e:
        raise ValueError(f"chapter 10 runs tp = world_size={world_size} on {model}: {e}") from None
    plan = make_plan(world_size, model=model, n_requests=positive_int("n_requests", n_requests),
                     short_prompt=positive_int("short_prompt", short_prompt),
                     long_prompt=positive_int("long_prompt", long_prompt),
                     output_len=positive_int("output_len", output_len), ramp=ramp, cancel_step=cancel_step,
                     lose_at_step=lose_at_step, detect_timeout_s=detect_timeout_s)
    check_fits_in_memory(plan["model"], world_size, copies=1, what="chapter 10's serving runs")
    sizes = {"gpus": positive_int("gpus", gpus), "gpu": gpu,
             "concurrency": positive_int("concurrency_gpu", concurrency_gpu),
             "prompt_len": positive_int("prompt_len_gpu", prompt_len_gpu),
             "output_len": positive_int("output_len_gpu", output_len_gpu)}
    check_deployments_fit(predict_deployments(big_model, **sizes), big_model, **sizes)
    return {"model": plan["model"], "plan": plan, "backend": resolve_backend(backend, world_size)}


def run(world_size: int = 2, *, backend: str = "auto", timeout_s: float = 300.0, **kwargs) -> dict:
    """Launch every serving experiment once on ``world_size`` ranks and return tables (all *measured*):

    * ``records`` — one row per request of the ramp runs (mode, concurrency, rid, kind, status, ttft_s,
      tps, e2e_s, prefill_s, ...);
    * ``summary`` — :func:`summarize` of the records;
    * ``parity`` — max |logit difference| of cached decode vs the full forward, and TP vs the whole model;
    * ``kv`` — the cancel-storm KV trace (bytes measured and predicted after every step, per replica);
    * ``cancel`` — per replica: requests cancelled, KV bytes freed measured vs predicted, bytes at the end;
    * ``failures`` — one row per request of the rank-loss runs (``experiment`` = replicas / tp);
    * ``errors`` — :func:`error_table` of the cancel storm and the rank-loss runs;
    * ``rank_loss`` — detection timeout, rebuild time, lost rank, step (``failures`` is empty and
      ``rank_loss`` says why when it was skipped: one rank, or ``lose_at_step=None``);
    * ``timeline``, ``plan``, ``wall_s``.

    ``kwargs`` are :func:`make_plan`'s. Raises what make_plan raises, and launch errors.
    """
    from labkit.runtime.launcher import launch

    plan = make_plan(world_size, **kwargs)
    res = launch(serve_rank, world_size, plan, backend=backend, timeout_s=timeout_s)
    r0 = res[0]
    rows = []
    for run_ in r0["runs"]:
        per_rank = run_["per_rank"] if run_["mode"] == "replicas" else run_["per_rank"][:1]
        for g in per_rank:
            for rec in g["records"]:
                rows.append({"mode": run_["mode"], "concurrency": run_["concurrency"], "replica": g["rank"],
                             **rec, "source": "measured"})
    records = pd.DataFrame(rows)
    out = {"plan": plan, "records": records, "summary": summarize(r0["runs"]), "parity": r0.get("parity"),
           "timeline": res.timeline, "wall_s": res.wall_s, "backend": res.backend}
    errs = []
    if "cancel" in r0:
        kv, canc = [], []
        for i, g in enumerate(r0["cancel"]):
            kv += [dict(t, replica=i) for t in g["kv_trace"]]
            c = g["cancel"] or {}
            canc.append({"replica": i, **c, "kv_bytes_at_end_measured": g["kv_bytes_at_end_measured"],
                         "source": "measured (bytes of live cache tensors) / predicted (labkit.theory.memory)"})
            errs += [dict(r, experiment="cancel storm", replica=i) for r in g["records"]]
        out["kv"] = pd.DataFrame(kv)
        out["cancel"] = pd.DataFrame(canc)
    if "rank_loss" in r0:
        rl = r0["rank_loss"]
        fail = [dict(r, experiment="rank loss: replicas", source="measured") for r in rl["replicas"]]
        fail += [dict(r, experiment="rank loss: tp", source="measured") for r in rl["tp"]]
        out["failures"] = pd.DataFrame(fail)
        errs += fail
        out["rank_loss"] = {k: rl[k] for k in ("tp_rebuild_s", "detect_timeout_s", "lost_rank", "step")}
    else:
        out["failures"] = pd.DataFrame(columns=["experiment", "rid", "attempt", "status", "ttft_s", "replica"])
        out["rank_loss"] = {"skipped": "losing a rank needs world_size >= 2 and lose_at_step"}
    out["errors"] = error_table(pd.DataFrame(errs)) if errs else pd.DataFrame()
    return out


def _q(s: pd.Series, q: float) -> float:
    s = s.dropna()
    return float(s.quantile(q)) if len(s) else float("nan")


def _per(per_rank: list[dict], key: str, denom: str) -> float:
    n = sum(g[denom] for g in per_rank)
    return sum(g["comm_calls"].get(key, 0) for g in per_rank) / n if n else float("nan")


def summarize(runs: list[dict]) -> pd.DataFrame:
    """One row per (mode, concurrency) run, all *measured*: requests, ``ttft_p50_s``/``ttft_p95_s`` (time
    to first token, from arrival), the same for short and long prompts, ``tps_p50``/``tps_p95`` (decode
    tokens per second of one request; higher is better, so p95 is the rate 95 % of requests reach or beat:
    the 5th percentile of TPS, the 95th of time per output token), ``throughput_tok_s`` (every generated
    token / the slowest instance's wall time), ``prefill_s``/``decode_s`` (compute time summed over serving
    instances: every replica, or rank 0 of the TP group), ``prefill_fraction``, ``comm_s`` (TP: time inside
    collectives on rank 0), and the collectives counted per forward pass (TP; compare
    :func:`collectives_per_forward`): ``decode_all_reduce_per_step``, ``decode_all_gather_per_step``,
    ``prefill_all_reduce_per_prompt``."""
    rows = []
    for run_ in runs:
        mode = run_["mode"]
        per_rank = run_["per_rank"] if mode == "replicas" else run_["per_rank"][:1]
        recs = pd.DataFrame([r for g in per_rank for r in g["records"]])
        ok = recs[recs["status"] == "ok"]
        wall = max(g["wall_s"] for g in run_["per_rank"])
        pre = sum(g["prefill_s"] for g in per_rank)
        dec = sum(g["decode_s"] for g in per_rank)
        rows.append({
            "mode": mode, "concurrency": run_["concurrency"], "requests": len(recs), "ok": len(ok),
            "ttft_p50_s": _q(ok["ttft_s"], 0.5), "ttft_p95_s": _q(ok["ttft_s"], 0.95),
            "ttft_p50_short_s": _q(ok.loc[ok["kind"] == "short", "ttft_s"], 0.5),
            "ttft_p50_long_s": _q(ok.loc[ok["kind"] == "long", "ttft_s"], 0.5),
            "tps_p50": _q(ok["tps"], 0.5), "tps_p95": _q(ok["tps"], 0.05),
            "e2e_p50_s": _q(ok["e2e_s"], 0.5), "throughput_tok_s": ok["new_tokens"].sum() / wall,
            "wall_s": wall, "prefill_s": pre, "decode_s": dec, "prefill_fraction": pre / (pre + dec),
            "comm_s": sum(g["comm_s"] for g in per_rank),
            "decode_all_reduce_per_step": _per(per_rank, "decode_all_reduce", "steps"),
            "decode_all_gather_per_step": _per(per_rank, "decode_all_gather", "steps"),
            "prefill_all_reduce_per_prompt": _per(per_rank, "prefill_all_reduce", "prefills"),
            "source": "measured"})
    return pd.DataFrame(rows)


def _trend(what: str, concs: list, values: list, fmt: str, unit: str) -> str:
    """'what rose from A unit at concurrency c1 to B unit at c2, then fell to C unit at c3' (one clause per
    change of direction; 'stayed at' for equal values)."""
    def word(a, b):
        return "rose" if b > a else "fell" if b < a else "stayed"

    def v(x):
        return f"{format(x, fmt)} {unit}"

    parts, i = [], 0
    while i < len(values) - 1:
        j, w = i + 1, word(values[i], values[i + 1])
        while j < len(values) - 1 and word(values[j], values[j + 1]) == w:
            j += 1
        start = f"from {v(values[i])} at concurrency {concs[i]} " if not parts else ""
        parts.append(f"{w} {start}{'at' if w == 'stayed' else 'to'} {v(values[j])} at {concs[j]}")
        i = j
    return f"{what} " + ", then ".join(parts) if parts else f"{what} was {v(values[0])} (one concurrency)"


def ramp_findings(summary: pd.DataFrame) -> list[str]:
    """What *this* run measured along the concurrency ramp, as sentences computed from :func:`summarize`'s
    table (so the chapter's prose cannot contradict its data): per mode, how TTFT p50, TPS p50 per request and
    total throughput moved with concurrency (each change of direction named), how far TPS p95 sat below p50 at
    the top concurrency; TP against replicas on throughput at each concurrency, and the share of TP rank 0's
    prefill + decode time spent inside collectives. Every number is *measured*. Raises ValueError for a table
    without the columns of :func:`summarize`."""
    need = {"mode", "concurrency", "ttft_p50_s", "tps_p50", "tps_p95", "throughput_tok_s", "comm_s", "prefill_s",
            "decode_s"}
    missing = sorted(need - set(summary.columns))
    if missing:
        raise ValueError(f"summary lacks columns {missing}; pass serving.summarize(...) / run(...)['summary']")
    out = []
    for mode, g in summary.sort_values("concurrency").groupby("mode", sort=False):
        c = list(g["concurrency"])
        top = g.iloc[-1]
        out.append(f"{mode}: " + "; ".join([
            _trend("TTFT p50", c, list(g["ttft_p50_s"]), ".3f", "s"),
            _trend("TPS p50 per request", c, list(g["tps_p50"]), ".1f", "tok/s"),
            _trend("total throughput", c, list(g["throughput_tok_s"]), ".0f", "tok/s")])
            + f"; at concurrency {top['concurrency']} TPS p95 was {top['tps_p95'] / top['tps_p50']:.0%} of p50 "
              "(measured).")
    modes = set(summary["mode"])
    if {"replicas", "tp"} <= modes:
        both = summary.pivot_table(index="concurrency", columns="mode", values="throughput_tok_s")
        both = both.dropna()
        ratio = both["tp"] / both["replicas"]
        slower = list(ratio.index[ratio < 1])
        if len(slower) == len(ratio):
            verdict = f"TP's total throughput was below replicas' at every concurrency ({ratio.min():.2f}x to " \
                      f"{ratio.max():.2f}x of it)"
        elif not slower:
            verdict = f"TP's total throughput was at or above replicas' at every concurrency ({ratio.min():.2f}x " \
                      f"to {ratio.max():.2f}x of it)"
        else:
            verdict = (f"TP's total throughput was below replicas' at concurrency {', '.join(map(str, slower))} "
                       f"only ({ratio.min():.2f}x to {ratio.max():.2f}x of it over the ramp)")
        tp = summary[summary["mode"] == "tp"]
        busy = float((tp["prefill_s"] + tp["decode_s"]).sum())
        comm = float(tp["comm_s"].sum())
        share = f"{comm / busy:.0%}" if busy > 0 else "n/a"
        out.append(f"{verdict}; collectives took {comm:.2f} s of TP rank 0's {busy:.2f} s of prefill + decode "
                   f"({share}) (measured).")
    return out


def deployment_findings(pred: pd.DataFrame, model: str) -> list[str]:
    """What :func:`predict_deployments`' table says, as sentences computed from it (every number *predicted*):
    which TP degrees fit and which do not (with the weights per GPU), and among those that fit, which has the
    lowest TTFT, the lowest time per output token, the highest total throughput and holds the most sequences;
    whether decode is memory- or compute-bound there. Raises ValueError when no row fits (nothing to compare:
    see :func:`check_deployments_fit`)."""
    ok = pred[pred["fits"]]
    if ok.empty:
        raise ValueError(f"no deployment of {model} fits (every row has fits=False); "
                         "check_deployments_fit says what would")
    g = pred.iloc[0]
    tp1 = pred[pred["tp"] == 1]
    whole = f"{tp1['weights_bytes_per_gpu'].iloc[0] / mem.GB:.1f} GB of weights per whole copy (GB = 10^9)" \
        if len(tp1) else ""
    fit_tp = ", ".join(f"TP{t}" for t in ok["tp"])
    bad = pred[~pred["fits"]]
    need = ", ".join(f"TP{t} ({b / mem.GiB:.1f} GiB)" for t, b in zip(bad["tp"], bad["peak_bytes_per_gpu"]))
    out = [f"{model} on {int(g['tp'] * g['replicas'])} x {g['gpu']}: {whole}; fits at {fit_tp}"
           + (f"; not at {need} > {g['device_bytes'] / mem.GiB:.1f} GiB per GPU, so those rows carry no timing"
              if len(bad) else "") + " (predicted)."]

    def best(col, fn, fmt, unit):
        r = ok.loc[getattr(ok[col], fn)()]
        return f"TP{int(r['tp'])} x {int(r['replicas'])} ({format(r[col] * (1e3 if unit == 'ms' else 1), fmt)} {unit})"

    out.append(f"Among those that fit: lowest TTFT {best('ttft_s', 'idxmin', '.1f', 'ms')}; lowest time per output "
               f"token {best('tpot_s', 'idxmin', '.2f', 'ms')}; highest total throughput "
               f"{best('throughput_tok_s', 'idxmax', ',.0f', 'tok/s')} (predicted).")
    seqs = ok.dropna(subset=["max_sequences_total"])
    if len(seqs):
        r = seqs.loc[seqs["max_sequences_total"].astype(float).idxmax()]
        out.append(f"Most sequences held in memory at once: TP{int(r['tp'])} x {int(r['replicas'])}, "
                   f"{int(r['max_sequences_total'])} (predicted).")
    bounds = ok.groupby("decode_bound")["tp"].apply(lambda t: ", ".join(f"TP{x}" for x in t))
    out.append("Decode is " + "; ".join(f"{b}-bound at {t}" for b, t in bounds.items()) + " (predicted).")
    return out


def error_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per experiment, *measured* counts: ``requests`` (distinct rids), ``attempts``, how many attempts ended
    ``ok``, ``cancelled`` (by the client: :data:`CLIENT_OUTCOMES`, not a failure) or with each server error of
    :data:`ERROR_TYPES`; ``error_rate`` = attempts that failed with a server error / attempts the client did not
    cancel (NaN when the client cancelled every attempt); ``retried_ok`` (requests that failed first and
    succeeded on a retry); ``failed_final`` (requests whose last attempt failed with a server error: never
    served, though the client still wanted them; a cancelled request is not one)."""
    rows = []
    for exp, g in records.groupby("experiment", sort=False):
        counts = g["status"].value_counts()
        last = g.sort_values("attempt").groupby("rid").tail(1)
        failed = g["status"].isin(ERROR_TYPES)
        wanted = ~g["status"].isin(CLIENT_OUTCOMES)
        first_bad = set(g.loc[(g["attempt"] == 1) & failed, "rid"])
        rows.append({"experiment": exp, "requests": g["rid"].nunique(), "attempts": len(g),
                     "ok": int(counts.get("ok", 0)), **{t: int(counts.get(t, 0)) for t in CLIENT_OUTCOMES},
                     **{t: int(counts.get(t, 0)) for t in ERROR_TYPES},
                     "error_rate": float(failed.sum() / wanted.sum()) if wanted.any() else float("nan"),
                     "retried_ok": int(((last["status"] == "ok") & last["rid"].isin(first_bad)).sum()),
                     "failed_final": int(last["status"].isin(ERROR_TYPES).sum()), "source": "measured"})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------------
# predicted: replicas vs TP for a published model on real GPUs (no launch)
# ------------------------------------------------------------------------------------------------------
def predict_deployments(model: str | ModelSpec = "llama-2-13b", *, gpus: int = 8, gpu: str = "h100-80gb",
                        tps=None, concurrency: int = 64, prompt_len: int = 1024, output_len: int = 256,
                        weight_dtype: str = "bf16", mfu: float = 0.5, hbm_efficiency: float = 0.8,
                        link: str | None = None) -> pd.DataFrame:
    """*Predicted* serving of ``model`` on ``gpus`` GPUs of one node: for each TP degree, ``gpus / tp``
    replicas share ``concurrency`` sequences evenly. One row per TP degree:

    * memory per GPU — :func:`labkit.theory.memory.infer_memory` (weights, KV cache for batch × (prompt + output),
      workspace, headroom): ``peak_bytes_per_gpu``, ``fits``, ``max_batch_per_replica``
      (:func:`labkit.theory.memory.serving_rows`);
    * decode step (one token for every sequence of a replica) — a roofline: the larger of reading this
      GPU's weights and the batch's KV cache at mean context (prompt + output/2) from HBM
      (``hbm_gbps × hbm_efficiency``), and the FLOPs ``batch × flops_per_token(ctx, inference) / tp`` at
      ``peak × mfu``; plus 2 all-reduces per layer of ``batch × hidden × 2`` bytes over NVLink
      (:func:`labkit.theory.costmodel.collective_time`). Decode is memory-bound at small batch (Pope et al. 2022,
      "Efficiently Scaling Transformer Inference", Sec. 2-3); the all-reduces are Megatron's (Shoeybi et al.
      2019, Sec. 3). ``tpot_s`` = that step, ``tps_per_seq`` = 1 / tpot, ``throughput_tok_s`` = replicas ×
      batch / tpot;
    * ``ttft_s`` — prefill of one prompt alone on an idle replica (no queueing): the larger of its FLOPs
      (``prompt × flops_per_token(prompt, inference) / tp`` at ``peak × mfu``) and one read of the weights,
      plus 2 all-reduces per layer of ``prompt × hidden × 2`` bytes.

    ``mfu`` and ``hbm_efficiency`` are assumptions (columns ``assumed_mfu``, ``assumed_hbm_efficiency``);
    the GPU's peak, HBM bandwidth and NVLink come from data/hardware.yaml. ``tps`` defaults to every divisor
    of ``gpus`` that divides the model's heads, kv heads and ffn_hidden_size.

    Raises ValueError for an unknown model or GPU, a GPU without peak/bandwidth data, a TP degree that does
    not divide ``gpus`` or the model, or ``concurrency`` not a multiple of the number of replicas.
    """
    from labkit.checks import divisors
    from labkit.models import flops_per_token
    from labkit.theory import costmodel as cm

    spec = get_spec(model) if isinstance(model, str) else model
    gpus = positive_int("gpus", gpus)
    concurrency = positive_int("concurrency", concurrency)
    mfu = positive_float("mfu", mfu)
    hbm_efficiency = positive_float("hbm_efficiency", hbm_efficiency)
    dev = cm.get_device(gpu)
    missing = [k for k in ("peak_bf16_tflops", "hbm_gbps", "nvlink") if k not in dev]
    if missing:
        need = ("peak_bf16_tflops", "hbm_gbps", "nvlink")
        have = [n for n, d in cm.devices().items() if all(k in d for k in need)]
        raise ValueError(f"gpu={gpu!r} has no {', '.join(missing)} in data/hardware.yaml; "
                         f"use one of: {', '.join(have)}")
    link = link or dev["nvlink"]
    peak = dev["peak_bf16_tflops"] * 1e12
    hbm = dev["hbm_gbps"] * 1e9 * hbm_efficiency
    if tps is None:
        tps = []
        for t in divisors(gpus):
            try:
                check_tp(spec, t, pad_vocab=True)
                tps.append(t)
            except ValueError:
                pass
    act_bytes = 2  # bf16 activations on the wire
    avg_ctx = prompt_len + output_len // 2
    rows = []
    for tp in tps:
        check_divides("tp", tp, "gpus", gpus)
        check_tp(spec, tp, pad_vocab=True)
        replicas = gpus // tp
        check_divides("replicas", replicas, "concurrency", concurrency,
                      hint=f"gpus/tp = {replicas} replicas share the sequences evenly")
        batch = concurrency // replicas
        wl = {"batch": batch, "prompt_len": prompt_len, "output_len": output_len, "weight_dtype": weight_dtype}
        row = mem.serving_rows(spec, [wl], device=gpu, tp=tp)[0]
        est = mem.infer_memory(spec, mem.ParallelConfig(tp=tp), mem.InferConfig(**wl), device=gpu)
        weights = est.categories["parameters"]
        kv_dtype = {32: "fp32", 16: "bf16", 8: "fp8"}[mem.InferConfig(**wl).kv_bits()]
        kv_avg = mem.kv_cache_bytes(spec, batch * avg_ctx, kv_dtype, tp=tp)

        def allreduce_s(nbytes, _tp=tp):
            if _tp == 1:
                return 0.0
            return 2 * spec.n_layers * cm.collective_time("all_reduce", int(nbytes), _tp, link, None,
                                                          gpus_per_node=gpus)

        t_mem = (weights + kv_avg) / hbm
        t_flop = batch * flops_per_token(spec, avg_ctx, training=False) / tp / (peak * mfu)
        comm = allreduce_s(batch * spec.hidden_size * act_bytes)
        tpot = max(t_mem, t_flop) + comm
        pre_flop = prompt_len * flops_per_token(spec, prompt_len, training=False) / tp / (peak * mfu)
        pre_comm = allreduce_s(prompt_len * spec.hidden_size * act_bytes)
        ttft = max(pre_flop, weights / hbm) + pre_comm
        timing = {"ttft_s": ttft, "tpot_s": tpot, "tps_per_seq": 1 / tpot,
                  "throughput_tok_s": replicas * batch / tpot,
                  "decode_bound": "memory" if t_mem >= t_flop else "compute",
                  "decode_allreduce_s": comm, "prefill_allreduce_s": pre_comm}
        note = ""
        if not est.fits:  # a deployment that cannot be loaded has no latency: no timing predicted
            timing = dict.fromkeys(timing, float("nan")) | {"decode_bound": None}
            note = (f"does not fit: peak {est.total_bytes / mem.GiB:.1f} GiB > {est.device_bytes / mem.GiB:.1f} GiB "
                    f"per GPU, so no timing is predicted")
        rows.append({
            "tp": tp, "replicas": replicas, "batch_per_replica": batch, "fits": est.fits,
            "peak_bytes_per_gpu": est.total_bytes, "device_bytes": est.device_bytes, "weights_bytes_per_gpu": weights,
            "kv_bytes_per_gpu": est.categories["kv_cache"], "max_batch_per_replica": row["max_batch"], **timing,
            "max_sequences_total": None if row["max_batch"] is None else replicas * row["max_batch"],
            "note": note, "gpu": gpu, "link": link, "assumed_mfu": mfu, "assumed_hbm_efficiency": hbm_efficiency,
            "source": "predicted"})
    return pd.DataFrame(rows)


def check_deployments_fit(pred: pd.DataFrame, model: str | ModelSpec, *, gpus: int, gpu: str,
                          concurrency: int, prompt_len: int, output_len: int) -> None:
    """Raise ValueError unless at least one row of ``pred`` (:func:`predict_deployments` of ``model`` on
    ``gpus`` x ``gpu`` with these sizes) fits in memory. The message names the closest deployment and its
    shortfall per GPU, and what would fit instead: every GPU of data/hardware.yaml with peak and bandwidth data
    on which some TP degree fits, the largest preset of data/models.yaml that fits here, and more GPUs only
    when a larger TP degree exists (tp must divide the model's heads, kv heads and ffn_hidden_size)."""
    from labkit.theory import costmodel as cm
    from labkit.theory.spec import presets

    if pred["fits"].any():
        return
    spec = get_spec(model) if isinstance(model, str) else model
    best = pred.loc[pred["peak_bytes_per_gpu"].idxmin()]
    short = (best["peak_bytes_per_gpu"] - best["device_bytes"]) / mem.GiB
    sizes = {"concurrency": concurrency, "prompt_len": prompt_len, "output_len": output_len}

    def fits(m, g, n):
        try:
            return bool(predict_deployments(m, gpus=n, gpu=g, **sizes)["fits"].any())
        except ValueError:
            return False

    need = ("peak_bf16_tflops", "hbm_gbps", "nvlink")
    gpus_ok = [g for g, d in cm.devices().items() if g != gpu and all(k in d for k in need) and fits(spec, g, gpus)]
    fixes = []
    more = [n for n in (2 * gpus, 4 * gpus) if fits(spec, gpu, n)]
    if more:
        fixes.append(f"more GPUs (gpus={more[0]})")
    if gpus_ok:
        fixes.append(f"a GPU with more memory (gpu={' or '.join(repr(g) for g in gpus_ok)})")
    smaller = sorted(((p.n_params(), n) for n, p in presets().items()
                      if p.n_params() < spec.n_params() and not n.startswith("lab-")), reverse=True)
    smaller = [n for _, n in smaller if fits(n, gpu, gpus)][:1]
    if smaller:
        fixes.append(f"a smaller model (the largest preset that fits: big_model={smaller[0]!r})")
    max_tp = math.gcd(spec.n_heads, spec.n_kv_heads, spec.ffn_hidden_size)
    tail = "" if more else (f"; more GPUs alone would not (tried gpus={2 * gpus} and {4 * gpus}: tp can be at most "
                            f"{max_tp}, the largest divisor of n_heads, n_kv_heads and ffn_hidden_size, and more "
                            f"replicas do not shrink one; splitting it further needs pipeline parallelism, not "
                            f"modelled here)")
    raise ValueError(f"big_model={spec.name!r} fits on no deployment of {gpus} x {gpu} ({concurrency} sequences of "
                     f"{prompt_len} + {output_len} tokens): the closest is tp={int(best['tp'])} x "
                     f"{int(best['replicas'])} replica(s) at {best['peak_bytes_per_gpu'] / mem.GiB:.1f} GiB per GPU "
                     f"> {best['device_bytes'] / mem.GiB:.1f} GiB, short by {short:.1f} GiB; what would fit: "
                     f"{'; or '.join(fixes) or 'none of the presets or GPUs in data/'}{tail}")
