"""Serving, measured: the rank function that runs every serving experiment of a plan in one launch, the
workloads it serves, and the tables made from its results (all *measured*).

* :func:`make_workload` — a mixed closed-loop load (short and long prompts, all at time 0);
* :func:`make_plan` — validate everything before a launch; :func:`serve_rank` — parity (cached decode vs
  the full forward, TP vs the whole model), the concurrency ramp for replicas and TP, the cancel storm,
  the lost rank (:func:`rank_loss`);
* :func:`run` — launch it and return tables; :func:`summarize` (TTFT/TPS percentiles per run, collectives
  counted per step) and :func:`error_table` (attempts by outcome and error type).

The strategy is :mod:`labkit.parallel.serving`; the predictions are :mod:`labkit.theory.serving`.
"""

from __future__ import annotations

import copy
import datetime

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_choice, positive_float, positive_int
from labkit.experiments.serving_metrics import latency_columns, pct
from labkit.models import Transformer, build_model
from labkit.parallel.serving import (
    CLIENT_OUTCOMES,
    ERROR_TYPES,
    RETRIED_OUTCOMES,
    Engine,
    RankLost,
    check_requests,
    decode,
    gather_vocab,
    kv_cache_shape,
    prefill,
    prompt_tokens,
    shard_tp,
)
from labkit.runtime.commlog import CommLog
from labkit.runtime.timeline import now_ns
from labkit.theory.serving import check_tp
from labkit.theory.spec import get_spec

MODES = ("replicas", "tp")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# ------------------------------------------------------------------------------------------------------
# the rank function: every serving experiment of a chapter in one launch
# ------------------------------------------------------------------------------------------------------
def build(plan: dict) -> Transformer:
    """The plan's whole model (identical on every rank: same preset, seed and dtype)."""
    return build_model(plan["model"], seed=plan.get("seed", 0), dtype=TORCH_DTYPES[plan.get("dtype", "float32")],
                       attention=plan.get("attention", "sdpa"))


def replica_engine(ctx, plan: dict, full: Transformer, **kw) -> Engine:
    """An engine on this rank's whole model (a replica), its events on ``ctx.timeline`` (``kw``: Engine's)."""
    return Engine(full, ctx=ctx, seed=plan.get("seed", 0), **kw)


def tp_engine(ctx, plan: dict, full: Transformer, group, **kw) -> Engine:
    """An engine on this rank's TP shard of a copy of ``full``, every collective counted by a CommLog."""
    return Engine(shard_tp(copy.deepcopy(full), group), ctx=ctx, seed=plan.get("seed", 0), commlog=CommLog, **kw)


def gather(obj):
    """``all_gather_object`` over the world: every rank's ``obj``, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def parity(ctx, plan: dict, full: Transformer, group) -> dict:
    """Max |difference| of (a) cached prefill + decode vs the full forward pass of the whole model, and
    (b) the TP model's full forward pass vs the whole model's, on one sequence."""
    spec = full.spec
    t = min(24, spec.max_seq_len - 4)
    seq = prompt_tokens(10_000, t + 4, spec.vocab_size, plan.get("seed", 0)).to(ctx.device)
    with torch.inference_mode():
        ref = full(seq[None])[0]  # [T+4, V]
    eng = Engine(full, seed=plan.get("seed", 0))
    cache = eng.alloc(t + 4)
    got = [prefill(full, seq[:t], cache)]
    for p in range(t, t + 3):
        got.append(decode(full, seq[p : p + 1], torch.tensor([p], device=ctx.device), [cache])[0])
    cached_diff = float((torch.stack(got) - ref[t - 1 : t + 3]).abs().max())
    out = {"cached_vs_full_max_abs": cached_diff, "tp": 1, "tp_vs_whole_max_abs": 0.0}
    if ctx.world_size > 1:
        tp_model = shard_tp(copy.deepcopy(full), group)
        with torch.inference_mode():
            tp_logits = gather_vocab(tp_model, tp_model(seq[None]))[0]
        tcache = torch.zeros(kv_cache_shape(tp_model, t + 4), dtype=cache.dtype, device=ctx.device)
        tp_pre = prefill(tp_model, seq[:t], tcache)
        out.update({"tp": ctx.world_size, "tp_vs_whole_max_abs": float((tp_logits - ref).abs().max()),
                    "tp_cached_vs_whole_max_abs": float((tp_pre - ref[t - 1]).abs().max()),
                    "tp_kv_bytes_per_rank": tcache.untyped_storage().nbytes(),
                    "whole_kv_bytes": cache.untyped_storage().nbytes()})
    return out


def serve_mode(ctx, plan, full, mode, requests, concurrency, group, **kw) -> dict:
    """One run of ``mode`` at total ``concurrency``: replicas split requests round-robin and concurrency
    evenly; TP serves all of them with the whole concurrency on every rank (rank 0 reports)."""
    w = ctx.world_size
    if mode == "replicas":
        eng = replica_engine(ctx, plan, full)
        mine = requests[ctx.rank :: w]
        ctx.barrier()
        out = eng.serve(mine, concurrency // w, **kw)
    else:
        eng = tp_engine(ctx, plan, full, group)
        ctx.barrier()
        out = eng.serve(requests, concurrency, **kw)
    out["kv_trace"] = eng.kv_trace
    out["rank"] = ctx.rank
    return out


def rank_loss(ctx, plan, full, requests, spec_loss: dict) -> dict:
    """Lose rank ``world_size - 1`` at decode step ``step``: replicas (others keep serving, the lost
    replica's requests are retried on them) and TP (every in-flight request fails on a timeout; retried once
    the TP group is rebuilt with a replacement rank)."""
    w, lost = ctx.world_size, ctx.world_size - 1
    conc, step = spec_loss["concurrency"], spec_loss["step"]
    timeout = datetime.timedelta(seconds=spec_loss.get("detect_timeout_s", 1.0))
    result = {}
    # -- replicas --------------------------------------------------------------------------------------
    eng = replica_engine(ctx, plan, full)
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
    gathered = gather({"records": recs, "retry": unserved if ctx.rank == lost else []})
    retry = [r for g in gathered for r in g["retry"]]
    failed_ids = {x["rid"] for g in gathered for x in g["records"] if x["status"] != "ok"}
    retry_recs = []
    if ctx.rank != lost and retry:
        survivors = [r for r in range(w) if r != lost]
        share = retry[survivors.index(ctx.rank) :: len(survivors)]
        out2 = eng.serve(share, max(1, conc // w), attempt={rid: 2 for rid in failed_ids},
                         arrival_ns={r["rid"]: t0 for r in share}, t0_ns=t0)
        retry_recs = out2["records"]
    gathered2 = gather(retry_recs)
    all_recs = [dict(r, replica=i) for i, g in enumerate(gathered) for r in g["records"]]
    all_recs += [dict(r, replica=i) for i, g in enumerate(gathered2) for r in g]
    result["replicas"] = all_recs
    # -- tensor parallel ---------------------------------------------------------------------------------
    group = dist.new_group(list(range(w)), timeout=timeout, backend=dist.get_backend())
    eng = tp_engine(ctx, plan, full, group)
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
        eng2 = tp_engine(ctx, plan, full, group2)
        retry = gather(retry)[0]  # rank 0 (a survivor) knows what failed
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
    full = build(plan).to(ctx.device)
    requests = make_workload(**plan.get("workload", {}))
    group = dist.group.WORLD
    out: dict = {"rank": ctx.rank, "world_size": ctx.world_size, "runs": []}
    if plan.get("parity", True):
        out["parity"] = parity(ctx, plan, full, group)
    if plan.get("warmup", True):
        warm = make_workload(ctx.world_size, short_prompt=8, long_prompt=8, output_len=3)
        for mode in plan.get("modes", MODES):
            if mode == "tp" and ctx.world_size == 1:
                continue
            serve_mode(ctx, plan, full, mode, warm, ctx.world_size, group)
    for conc in plan.get("ramp", [ctx.world_size]):
        for mode in plan.get("modes", MODES):
            run_ = serve_mode(ctx, plan, full, mode, requests, conc, group)
            gathered = gather({k: run_[k] for k in ("records", "prefill_s", "decode_s", "comm_s", "comm_calls",
                                                     "prefills", "wall_s", "steps", "kv_trace", "rank")})
            if ctx.rank == 0:
                out["runs"].append({"mode": mode, "concurrency": conc, "per_rank": gathered})
    if plan.get("cancel"):
        c = plan["cancel"]
        eng = replica_engine(ctx, plan, full)
        ctx.barrier()
        res = eng.serve(requests[ctx.rank :: ctx.world_size], c["concurrency"], cancel_step=c["step"])
        res["kv_bytes_at_end_measured"] = eng.live_kv_bytes()
        res["kv_trace"] = eng.kv_trace
        out["cancel"] = gather({k: res[k] for k in ("records", "cancel", "kv_trace", "kv_bytes_at_end_measured")})
    if plan.get("rank_loss") and ctx.world_size > 1:
        out["rank_loss"] = rank_loss(ctx, plan, full, requests, plan["rank_loss"])
    return out


# ------------------------------------------------------------------------------------------------------
# one launch, then tables
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
    check_choice("dtype", dtype, tuple(TORCH_DTYPES))
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
    check_requests(spec, make_workload(**workload))
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


def _per(per_rank: list[dict], key: str, denom: str) -> float:
    n = sum(g[denom] for g in per_rank)
    return sum(g["comm_calls"].get(key, 0) for g in per_rank) / n if n else float("nan")


def summarize(runs: list[dict]) -> pd.DataFrame:
    """One row per (mode, concurrency) run, all *measured*: requests, TTFT (time to first token, from
    arrival), TPOT (time per output token) and ITL (inter-token latency) p50/p95/p99, TTFT p50 for short and
    long prompts, ``tps_p5``/``tps_p50``/``tps_p95`` (decode tokens per second of one request, each the
    percentile it names: higher is better, so the slow tail is ``tps_p5``; :mod:`labkit.experiments.
    serving_metrics`), ``throughput_tok_s`` (every generated
    token / the slowest instance's wall time), ``prefill_s``/``decode_s`` (compute time summed over serving
    instances: every replica, or rank 0 of the TP group), ``prefill_fraction``, ``comm_s`` (TP: time inside
    collectives on rank 0), and the collectives counted per forward pass (TP; compare
    :func:`labkit.theory.serving.collectives_per_forward`): ``decode_all_reduce_per_step``,
    ``decode_all_gather_per_step``, ``prefill_all_reduce_per_prompt``."""
    rows = []
    for run_ in runs:
        mode = run_["mode"]
        per_rank = run_["per_rank"] if mode == "replicas" else run_["per_rank"][:1]
        recs = pd.DataFrame([r for g in per_rank for r in g["records"]])
        ok = recs[recs["status"] == "ok"]
        wall = max(g["wall_s"] for g in run_["per_rank"])
        pre = sum(g["prefill_s"] for g in per_rank)
        dec = sum(g["decode_s"] for g in per_rank)
        lat = latency_columns(ok)
        rows.append({
            "mode": mode, "concurrency": run_["concurrency"], "requests": len(recs), "ok": len(ok),
            **{k: v for k, v in lat.items() if k.startswith(("ttft", "tpot", "itl", "tps"))},
            "ttft_p50_short_s": pct(ok.loc[ok["kind"] == "short", "ttft_s"], 50),
            "ttft_p50_long_s": pct(ok.loc[ok["kind"] == "long", "ttft_s"], 50),
            "e2e_p50_s": pct(ok["e2e_s"], 50), "throughput_tok_s": ok["new_tokens"].sum() / wall,
            "wall_s": wall, "prefill_s": pre, "decode_s": dec, "prefill_fraction": pre / (pre + dec),
            "comm_s": sum(g["comm_s"] for g in per_rank),
            "decode_all_reduce_per_step": _per(per_rank, "decode_all_reduce", "steps"),
            "decode_all_gather_per_step": _per(per_rank, "decode_all_gather", "steps"),
            "prefill_all_reduce_per_prompt": _per(per_rank, "prefill_all_reduce", "prefills"),
            "source": "measured"})
    return pd.DataFrame(rows)


def error_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per experiment, *measured* counts: ``requests`` (distinct rids), ``attempts``, how many attempts ended
    ``ok``, ``cancelled`` (by the client: :data:`CLIENT_OUTCOMES`, not a failure), with each server error of
    :data:`ERROR_TYPES`, or ``preempted`` (stopped by the server and queued again, as a hot swap's
    ``drain="requeue"`` does: :data:`RETRIED_OUTCOMES`, not a failure); ``error_rate`` = attempts that
    failed with a server error / attempts the client did not cancel (NaN when the client cancelled every
    attempt); ``retried_ok`` (requests that failed first and
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
                     **{t: int(counts.get(t, 0)) for t in RETRIED_OUTCOMES},
                     "error_rate": float(failed.sum() / wanted.sum()) if wanted.any() else float("nan"),
                     "retried_ok": int(((last["status"] == "ok") & last["rid"].isin(first_bad)).sum()),
                     "failed_final": int(last["status"].isin(ERROR_TYPES).sum()), "source": "measured"})
    return pd.DataFrame(rows)
