"""The serving engine: one instance (a whole model, or this rank's TP shard), its queue and its step loop.

Requests arrive (all at the start: a closed loop; or at their ``arrival_s``: open loop), wait in a queue and
are admitted while fewer than ``concurrency`` are in flight. Two scheduling policies:

* ``"prefill_first"`` — an admitted request is prefilled at once, its whole prompt in one forward pass (a
  server without chunked prefill), so a long prompt stalls the decode of every other request;
* ``"chunked"`` — every step is one forward pass of at most ``token_budget`` tokens: one decode token for
  every decoding request first, then prompt chunks in admission order with what is left (chunked prefill,
  Agrawal et al. 2024, "Sarathi-Serve"); a long prompt is spread over several steps.

Greedy sampling (argmax), so runs are deterministic. KV cache: one tensor per request, reserved at admission
(prompt + max_new_tokens) and freed when it ends; :meth:`Engine.live_kv_bytes` *measures* the bytes of the
cache tensors still alive (weak references: a leaked reference keeps its bytes counted);
:func:`labkit.theory.memory.kv_cache_bytes` *predicts* them. Every step adds a row to the run's ``series``:
time, queue length, requests in flight (prefilling / decoding), tokens in the step, KV bytes reserved
(measured and predicted) and written, outcomes so far by type.

What a server must survive, injected on purpose: a cancel storm (``cancel_step``), a lost rank
(``lose_at_step`` raises :class:`RankLost` in the rank chosen to be lost), a collective that fails because a
TP peer is gone (every in-flight request ends ``comm_timeout``), and a hot swap (``swap``: stop admitting,
drain, swap the weights, resume). With a TP model and open-loop arrivals, group rank 0 decides how many
requests have arrived and broadcasts it, so every rank of the group schedules the same batch.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref

import torch
import torch.distributed as dist

from labkit.checks import check_choice, positive_int
from labkit.models import Transformer
from labkit.parallel.serving.kv_cache import forward_segments, kv_cache_shape, prefill
from labkit.parallel.serving.requests import (
    Live,
    RankLost,
    Run,
    check_requests,
    is_comm_failure,
    prompt_tokens,
    record,
)
from labkit.theory import memory as mem

POLICIES = ("prefill_first", "chunked")
KV_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Engine:
    """One serving instance: a model (whole, this rank's TP shard, or a quantized copy) and its step loop.

    ``ctx``: optional, anything with ``ctx.timeline`` (prefill / decode / cancel / swap events go there)
    and ``ctx.now_ns()`` (the clock; default ``time.monotonic_ns``); ``seed``: prompt seed
    (:func:`~labkit.parallel.serving.requests.prompt_tokens`). ``commlog``: optional factory of a
    collective log (a context manager with ``tagged(tag)`` and ``records``: dicts with ``op``, ``tag``,
    ``start_ns``, ``end_ns``, such as :class:`labkit.runtime.commlog.CommLog`); with it every collective of
    a serve call is recorded, tagged prefill / decode, and its time and count come back *measured*.
    ``step_time``: optional ``f(prefill_tokens, decode_tokens) -> seconds``: *fixed compute* — every forward
    pass is padded (slept) to last at least that long, as on a device whose step time is known (the way
    chapter 06 fixes its compute), so a run's timing follows a cost model instead of this machine's load.
    """

    def __init__(self, model: Transformer, *, ctx=None, seed: int = 0, commlog=None, step_time=None):
        self.timeline = getattr(ctx, "timeline", None)
        self.step_time = step_time
        self.now_ns = ctx.now_ns if ctx is not None else time.monotonic_ns
        self.seed = seed
        self.commlog = commlog
        self.version = 0
        self._set_model(model)
        self._caches: list[weakref.ref] = []
        self.kv_trace: list[dict] = []
        self.last_records: list[dict] = []
        self.last_queue: list[dict] = []

    def _set_model(self, model) -> None:
        self.model = model.eval()
        self.spec = model.spec
        self.tp = getattr(model, "tp", 1)
        w = model.embed.weight  # a quantized copy's dequantized weight: its float dtype
        self.device, self.dtype = w.device, w.dtype
        self._kv_token_bytes = mem.kv_cache_bytes(self.spec, 1, KV_DTYPE_NAMES[self.dtype], tp=self.tp)

    def model_name(self) -> str:
        """The served model's preset name, with its weight dtype when it is a quantized copy."""
        q = getattr(self.model, "quant", None)
        return f"{self.spec.name} ({q['weight_dtype']})" if q else self.spec.name

    def swap_model(self, model) -> None:
        """Serve ``model`` from now on (call with nothing in flight: caches of the old model do not fit it).
        Raises ValueError when its vocabulary differs (token ids would change meaning)."""
        if model.spec.vocab_size != self.spec.vocab_size:
            raise ValueError(f"cannot swap {self.spec.name!r} (vocab_size={self.spec.vocab_size}) for "
                             f"{model.spec.name!r} (vocab_size={model.spec.vocab_size}): token ids would change "
                             f"meaning; swap to a model with vocab_size={self.spec.vocab_size}")
        self._set_model(model)
        self.version += 1

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

    def _kv_bytes(self, tokens: int) -> int:
        return self._kv_token_bytes * tokens  # kv_cache_bytes is linear in tokens (whole bytes per element)

    def predicted_kv_bytes(self, live: list) -> int:
        """Predicted: :func:`labkit.theory.memory.kv_cache_bytes` of the tokens reserved by the live requests."""
        return self._kv_bytes(sum(x.req["prompt_len"] + x.req["max_new_tokens"] for x in live))

    def _span(self, name, kind="compute", **tags):
        return self.timeline.span(name, kind, **tags) if self.timeline is not None else contextlib.nullcontext()

    # -- the loop ------------------------------------------------------------------------------------------
    def serve(self, requests: list[dict], concurrency: int, *, policy: str = "prefill_first",
              token_budget: int | None = None, cancel_step: int | None = None, lose_at_step: int | None = None,
              swap: dict | None = None, attempt: int | dict = 1, arrival_ns: dict | None = None,
              t0_ns: int | None = None) -> dict:
        """Serve ``requests`` (dicts, :mod:`~labkit.parallel.serving.requests`) with at most ``concurrency``
        in flight, scheduled by ``policy`` (:data:`POLICIES`; ``token_budget``: tokens per step, chunked).

        ``cancel_step``: at that step, cancel every other in-flight request (half, rounded up), free their
        caches and record the KV bytes measured before and after. ``lose_at_step``: raise :class:`RankLost`
        at that step. ``swap``: ``{"at_step" and/or "after_admitted", "model_fn", "drain"}`` — from that
        step (once that many requests were admitted) admit nothing (``"cancel_storm": True``: a cancel
        storm at the next step, while draining),
        ``drain="finish"`` lets the in-flight requests finish, ``"requeue"`` stops them (status
        ``preempted``) and queues them again; with nothing in flight the engine serves ``model_fn(old
        model)`` and resumes. A failed collective ends every in-flight request ``comm_timeout``; requests
        not admitted come back in ``unserved``. ``arrival_ns``: rid -> arrival time (retries; default: the
        start of this call, or ``arrival_s`` after ``t0_ns``); ``attempt``: every request's, or rid ->
        attempt; ``t0_ns``: the clock origin of open-loop arrivals and of the series.

        Returns ``{"records", "series", "unserved", "cancel", "swap", "failed", "prefill_s", "decode_s",
        "comm_s", "comm_calls", "prefills", "steps", "wall_s"}`` (times measured on this rank;
        ``comm_calls``: ``"<prefill|decode>_<op>"`` -> collectives counted by the commlog). Raises ValueError
        for concurrency or token_budget < 1, an unknown policy, a request longer than the model's context.
        """
        concurrency = positive_int("concurrency", concurrency)
        check_choice("policy", policy, POLICIES)
        if policy == "chunked":
            token_budget = positive_int("token_budget (tokens per step)", token_budget)
        check_requests(self.spec, requests)
        start = self.now_ns()
        t0 = start if t0_ns is None else t0_ns
        arrivals = arrival_ns or {}
        opened = sorted((t0 + int(r["arrival_s"] * 1e9), i, r) for i, r in enumerate(requests) if "arrival_s" in r)
        run = Run(t0=t0, start=start, pending=[(a, r) for a, _, r in opened],
                   queue=[r for r in requests if "arrival_s" not in r],
                   attempt={r["rid"]: attempt.get(r["rid"], 1) if isinstance(attempt, dict) else attempt
                            for r in requests},
                   arrival={r["rid"]: arrivals.get(r["rid"], start) for r in requests})
        run.arrival.update({r["rid"]: a for a, r in run.pending})
        run.cancel_at = cancel_step
        if run.pending and self.tp > 1:
            run.sync = self.model.group
        self.last_records, self.last_queue = run.records, run.queue  # readable after RankLost
        failed = False
        run.log = self.commlog() if self.commlog is not None else None
        with run.log if run.log is not None else contextlib.nullcontext():
            try:
                while run.pending or run.queue or run.live:
                    self._maybe_swap(run, swap)
                    self._arrivals(run)
                    if not run.draining:
                        self._admit(run, concurrency, policy)
                    if not run.live:
                        continue
                    run.step += 1
                    if lose_at_step is not None and run.step == lose_at_step:
                        raise RankLost(f"rank lost at decode step {run.step} (failure injection)")
                    if run.cancel_at is not None and run.step == run.cancel_at:
                        self._cancel(run)
                        if not run.live:
                            continue
                    self._step(run, policy, token_budget)
                if run.draining:  # drained with nothing left to serve: swap all the same
                    self._maybe_swap(run, swap)
            except RankLost:
                self._fail_all(run, "rank_lost")
                self.last_queue = run.queue + [r for _, r in run.pending]
                raise
            except RuntimeError as e:  # a collective failed: a TP peer is gone (gloo: timed out)
                if not is_comm_failure(e):
                    raise
                failed = True
                self._fail_all(run, "comm_timeout")
                self._row(run, "failure")
        comm = run.log.records if run.log is not None else []
        calls: dict[str, int] = {}
        for r in comm:
            calls[f"{r['tag']}_{r['op']}"] = calls.get(f"{r['tag']}_{r['op']}", 0) + 1
        return {"records": run.records, "series": run.series, "unserved": run.queue + [r for _, r in run.pending],
                "cancel": run.cancel, "swap": run.swap, "failed": failed, "prefill_s": run.prefill_ns / 1e9,
                "decode_s": run.decode_ns / 1e9, "comm_s": sum(r["end_ns"] - r["start_ns"] for r in comm) / 1e9,
                "comm_calls": calls, "prefills": sum(1 for r in run.records if r["prefill_s"] > 0),
                "steps": run.step, "wall_s": (self.now_ns() - start) / 1e9}

    def _arrivals(self, run: Run) -> None:
        """Move the requests that have arrived from ``pending`` to the queue; idle, wait for the next one.
        With a TP group, its rank 0 decides (and waits) and broadcasts the count."""
        if not run.pending:
            return
        leader = run.sync is None or dist.get_rank(run.sync) == 0
        n = 0
        if leader:
            if not run.queue and not run.live:
                time.sleep(max(0, run.pending[0][0] - self.now_ns()) / 1e9)  # idle until the next arrival
            now = self.now_ns()
            while n < len(run.pending) and run.pending[n][0] <= now:
                n += 1
        if run.sync is not None:
            t = torch.tensor([n], device=self.device)
            dist.broadcast(t, dist.get_global_rank(run.sync, 0), group=run.sync)
            n = int(t)
        run.queue += [r for _, r in run.pending[:n]]
        del run.pending[:n]

    def _admit(self, run: Run, concurrency: int, policy: str) -> None:
        while run.queue and len(run.live) < concurrency:
            req = run.queue.pop(0)
            x = Live(req, run.attempt[req["rid"]], run.arrival[req["rid"]], admitted_ns=self.now_ns(),
                     model_version=self.version)
            x.prompt = prompt_tokens(req["rid"], req["prompt_len"], self.spec.vocab_size, self.seed).to(self.device)
            x.cache = self.alloc(x.reserved_tokens())
            run.live.append(x)
            run.admitted += 1
            if policy != "prefill_first":
                continue
            x.prefill_start_ns = self.now_ns()
            with self._span("prefill", microbatch=req["rid"]), _tagged(run.log, "prefill"):
                logits = prefill(self.model, x.prompt, x.cache)  # (V,)
                self._pad(x.prefill_start_ns, req["prompt_len"], 0)
            x.done = req["prompt_len"]
            end = self.now_ns()
            run.prefill_ns += end - x.prefill_start_ns
            run.last = {"tokens": req["prompt_len"], "prefill_tokens": req["prompt_len"], "decode_tokens": 0,
                        "step_s": (end - x.prefill_start_ns) / 1e9}
            complete = x.add_token(int(logits.argmax()), end)
            self._row(run, "admit")
            if complete:
                self._finish(run, x, "ok", end)

    def _step(self, run: Run, policy: str, budget: int | None) -> None:
        """One forward pass: a decode token for every decoding request, and (chunked) prompt chunks."""
        dec = [x for x in run.live if not x.prefilling]
        last = torch.tensor([x.tokens[-1] for x in dec], dtype=torch.long, device=self.device)  # (B,)
        segs = [(last[j : j + 1], x.req["prompt_len"] + len(x.tokens) - 1, x.cache) for j, x in enumerate(dec)]
        owners = list(dec)
        room = (budget - len(dec) if dec else budget) if policy == "chunked" else 0
        for x in [x for x in run.live if x.prefilling]:
            if room <= 0:
                break
            n = min(room, x.req["prompt_len"] - x.done)
            if x.done == 0:
                x.prefill_start_ns = self.now_ns()
            segs.append((x.prompt[x.done : x.done + n], x.done, x.cache))
            owners.append(x)
            x.done += n
            room -= n
        if not segs:
            return
        n_pre = sum(int(s[0].shape[0]) for s in segs[len(dec):])
        t1 = self.now_ns()
        with self._span("decode", step=run.step), _tagged(run.log, "decode"):
            logits = forward_segments(self.model, segs)  # (S, V)
            self._pad(t1, n_pre, len(dec))
        del segs  # it holds the caches: a finished request's must be freed below
        nxt = logits.argmax(-1).tolist()
        end = self.now_ns()
        took = end - t1
        share = n_pre / (n_pre + len(dec))  # chunked: the step's time attributed by token share
        run.prefill_ns += int(took * share)
        run.decode_ns += took - int(took * share)
        run.last = {"tokens": n_pre + len(dec), "prefill_tokens": n_pre, "decode_tokens": len(dec),
                    "step_s": took / 1e9}
        for x, tok in zip(owners, nxt):
            if not x.prefilling and x.add_token(tok, end):  # a decode token, or the last chunk's first token
                self._finish(run, x, "ok", end)
        self._row(run, "step")

    def _pad(self, start_ns: int, prefill_tokens: int, decode_tokens: int) -> None:
        if self.step_time is not None:
            left = start_ns + self.step_time(prefill_tokens, decode_tokens) * 1e9 - self.now_ns()
            if left > 0:
                time.sleep(left / 1e9)

    def _cancel(self, run: Run) -> None:
        """The cancel storm: every other in-flight request cancelled by its client, its cache freed."""
        before, pred_before = self.live_kv_bytes(), self.predicted_kv_bytes(run.live)
        victims = run.live[::2]
        with self._span("cancel", "other", step=run.step):
            for x in victims:
                self._finish(run, x, "cancelled", self.now_ns())
            gc.collect()
        after = self.live_kv_bytes()
        run.cancel = {"step": run.step, "cancelled": len(victims), "in_flight_before": len(victims) + len(run.live),
                      "kv_bytes_before_measured": before, "kv_bytes_after_measured": after,
                      "kv_bytes_freed_measured": before - after, "kv_bytes_before_predicted": pred_before,
                      "kv_bytes_freed_predicted": pred_before - self.predicted_kv_bytes(run.live)}
        run.last = {}
        self._row(run, "cancel")

    def _maybe_swap(self, run: Run, swap: dict | None) -> None:
        """Hot swap: from decode step ``swap["at_step"]`` (or once ``swap["after_admitted"]`` requests were
        admitted) admit nothing; once nothing is in flight, swap and resume."""
        if swap is None or (run.swap is not None and not run.draining):
            return
        if run.swap is None:
            if run.step < swap.get("at_step", 0) or run.admitted < swap.get("after_admitted", 0):
                return
            run.draining = True
            if swap.get("cancel_storm") and run.cancel_at is None:
                run.cancel_at = run.step + 1  # the client side gives up on half of them while the engine drains
            run.swap = {"trigger_step": run.step, "admitted_before": run.admitted,
                        "in_flight_at_trigger": len(run.live), "preempted": 0,
                        "drain": swap.get("drain", "finish"), "from": self.model_name(), "_t": self.now_ns()}
            if run.swap["drain"] == "requeue":  # stop them now; they start again, from the prompt, after the swap
                for x in list(run.live)[::-1]:
                    self._finish(run, x, "preempted", self.now_ns())
                    run.attempt[x.req["rid"]] += 1
                    run.queue.insert(0, x.req)
                    run.swap["preempted"] += 1
                gc.collect()
            run.last = {}
            self._row(run, "drain")
        if run.live:
            return
        t = self.now_ns()
        with self._span("swap", "other", step=run.step):
            self.swap_model(swap["model_fn"](self.model))
            gc.collect()
        end = self.now_ns()
        run.swap.update({"drain_s": (t - run.swap.pop("_t")) / 1e9, "swap_s": (end - t) / 1e9, "to": self.model_name(),
                         "at_s": (end - run.t0) / 1e9})
        run.swap["pause_s"] = run.swap["drain_s"] + run.swap["swap_s"]
        run.draining = False
        run.last = {}
        self._row(run, "swap")

    def _finish(self, run: Run, x: Live, status: str, end: int) -> None:
        if x in run.live:
            run.live.remove(x)
        run.records.append(record(x, status, end, run.t0))
        run.counts[status] += 1
        x.cache = None

    def _fail_all(self, run: Run, status: str) -> None:
        end = self.now_ns()
        for x in list(run.live):
            self._finish(run, x, status, end)
        gc.collect()

    def _row(self, run: Run, event: str) -> None:
        """One row of the run's time series (and of ``kv_trace``): after every step and event."""
        live = run.live
        row = {"t_s": (self.now_ns() - run.t0) / 1e9, "step": run.step, "event": event, "in_flight": len(live),
               "prefilling": sum(x.prefilling for x in live), "queue": len(run.queue), "tokens": 0,
               "prefill_tokens": 0, "decode_tokens": 0, "step_s": float("nan"), **run.last,
               "kv_bytes_measured": self.live_kv_bytes(), "kv_bytes_predicted": self.predicted_kv_bytes(live),
               "kv_bytes_used": self._kv_bytes(sum(x.used_tokens() for x in live)),
               "model_version": self.version, **{f"n_{k}": v for k, v in run.counts.items()}}
        row["decoding"] = row["in_flight"] - row["prefilling"]
        run.series.append(row)
        self.kv_trace.append(row)


def _tagged(log, tag: str):
    return log.tagged(tag) if log is not None else contextlib.nullcontext()
