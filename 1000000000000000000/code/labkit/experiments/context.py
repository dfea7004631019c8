"""Context parallelism, measured: the rank functions that tests, benchmarks and chapter 07 launch, and the
tables that read their results (measured beside :mod:`labkit.theory.context`'s predictions).

* :func:`cp_parity_rank` — every CP attention case, and whole-model cases, against full-sequence attention;
* :func:`cp_profile_rank` — bytes saved and sent, counted work, kernel CPU time and the timeline per config;
* :func:`block_costs` — the cost of one full and one masked diagonal block, in this process.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_divides, positive_int
from labkit.experiments.common import GLOO_FACTORS, window
from labkit.parallel.context import (
    apply_context_parallel,
    context_parallel_attention,
    count_work,
    shard_positions,
    shard_sequence,
)
from labkit.parallel.context.blocks import _attend, _attend_backward, _new_out_lse
from labkit.runtime import timeline as tl
from labkit.runtime.commlog import CommLog
from labkit.runtime.measure import SavedActivations
from labkit.runtime.probes import socket_bytes_written
from labkit.theory.context import (
    METHODS,
    check_context_parallel,
    predicted_blocks,
    predicted_comm_bytes,
    predicted_saved_bytes,
)


# ------------------------------------------------------------------------------------------------------
# parity (launch(labkit.experiments.context.cp_parity_rank, world_size, ...))
# ------------------------------------------------------------------------------------------------------
def all_cases(methods=METHODS) -> list[dict]:
    """Every (method, causal, load_balance) combination, as dicts for :func:`cp_parity_rank`."""
    return [{"method": m, "causal": c, "load_balance": lb} for m in methods for c in (True, False)
            for lb in (False, True)]


def _qkv(seed: int, batch: int, n_heads: int, seq_len: int, head_dim: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n_heads, seq_len, head_dim, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(4)]


def cp_parity_rank(ctx, cases: list[dict] | None = None, *, batch: int = 2, n_heads: int = 4, seq_len: int = 32,
                   head_dim: int = 8, seed: int = 0, model_cases: list[dict] = (),
                   spec: str = "lab-tiny-llama") -> dict:
    """Rank function: CP attention vs full-sequence ``F.scaled_dot_product_attention``, forward and backward.

    Every rank draws the same full q, k, v and output gradient (fp32, from ``seed``), computes the reference
    with sdpa + autograd, runs each case of ``cases`` (dicts with method, causal, load_balance; default
    :func:`all_cases`) on its shard and compares out, dq, dk, dv with the reference rows
    (``labkit.models.TOLERANCES[torch.float32]``: rtol 1e-4, atol 1e-5).

    ``model_cases`` (dicts with method, load_balance): the whole ``spec`` transformer with CP attention,
    loss and weight gradients (summed over ranks) vs the single-process model on the full sequence.

    Returns ``{"attention": [row per case], "model": [row per model case]}``; each row has the case, ``cp``,
    ``max_abs_err`` per tensor and ``ok`` (every tensor within tolerance).
    """
    import torch.nn.functional as F

    from labkit.models import TOLERANCES

    tol = TOLERANCES[torch.float32]
    cp, r = ctx.world_size, ctx.rank
    q, k, v, dout = (t.to(ctx.device) for t in _qkv(seed, batch, n_heads, seq_len, head_dim))
    refs = {}
    for causal in (True, False):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        out.backward(dout)
        refs[causal] = {"out": out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    rows = []
    for case in cases if cases is not None else all_cases():
        lb, causal = case["load_balance"], case["causal"]
        sh = [shard_sequence(t, cp, r, lb).clone() for t in (q, k, v, dout)]
        ql, kl, vl = (t.requires_grad_() for t in sh[:3])
        out = context_parallel_attention(ql, kl, vl, method=case["method"], causal=causal, load_balance=lb)
        out.backward(sh[3])
        got = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        ref = {n: shard_sequence(t, cp, r, lb) for n, t in refs[causal].items()}
        err = {n: float((got[n] - ref[n]).abs().max()) for n in got}
        ok = all(torch.allclose(got[n], ref[n], **tol) for n in got)
        rows.append({**case, "cp": cp, "rank": r, **{f"err_{n}": e for n, e in err.items()}, "ok": ok})
    model_rows = [_model_parity(ctx, spec, mc["method"], mc["load_balance"], seed, tol) for mc in model_cases]
    return {"attention": rows, "model": model_rows}


def _model_parity(ctx, spec_name, method, load_balance, seed, tol) -> dict:
    from labkit.models import SyntheticLM, build_model, lm_loss
    from labkit.theory.spec import get_spec

    spec = get_spec(spec_name)
    cp, r = ctx.world_size, ctx.rank
    seq_len = 4 * cp * 2
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, 2))
    ref_model = build_model(spec, seed, device=ctx.device)
    ref_logits = ref_model(tokens)
    lm_loss(ref_logits, targets).backward()
    model = apply_context_parallel(build_model(spec, seed, device=ctx.device), method, load_balance=load_balance)
    pos = shard_positions(seq_len, cp, r, load_balance).to(ctx.device)
    logits = model(tokens[:, pos], positions=pos)
    # the global mean loss = sum over every rank's tokens / all tokens
    loss_part = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, pos].reshape(-1),
                                                  reduction="sum") / targets.numel()
    loss_part.backward()
    err_grad, ok = 0.0, True
    for p, pr in zip(model.parameters(), ref_model.parameters()):
        dist.all_reduce(p.grad)  # weights are replicated over the CP group: sum their gradients
        err_grad = max(err_grad, float((p.grad - pr.grad).abs().max()))
        ok &= torch.allclose(p.grad, pr.grad, **tol)
    loss = loss_part.detach().clone()
    dist.all_reduce(loss)
    ref_loss = lm_loss(ref_logits, targets).detach()
    logits, ref_logits = logits.detach(), ref_logits.detach()
    err_logits = float((logits - ref_logits[:, pos]).abs().max())
    ok &= torch.allclose(logits, ref_logits[:, pos], **tol) and torch.allclose(loss, ref_loss, **tol)
    return {"spec": spec_name, "method": method, "load_balance": load_balance, "cp": cp, "rank": r,
            "err_logits": err_logits, "err_loss": float((loss - ref_loss).abs()), "err_grad": err_grad, "ok": ok}


# ------------------------------------------------------------------------------------------------------
# profile (launch(labkit.experiments.context.cp_profile_rank, world_size, configs, ...))
# ------------------------------------------------------------------------------------------------------
def _profile_once(q, k, v, dout, method, causal, lb, group, timeline=None, log=None) -> int:
    """One forward + backward of CP attention; returns the bytes saved for backward."""
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    with log.tagged("forward") if log else contextlib.nullcontext():
        # no module to attribute to: every saved storage of the attention call counts once
        with SavedActivations(torch.nn.Module(), layers=[], keep_items=False) as saved:
            out = context_parallel_attention(ql, kl, vl, method=method, causal=causal, load_balance=lb,
                                             group=group, timeline=timeline)
    with log.tagged("backward") if log else contextlib.nullcontext():
        out.backward(dout)
    return saved.total_bytes


def cp_profile_rank(ctx, configs: list[dict], *, batch: int = 1, n_heads: int = 4, seq_len: int = 1024,
                    head_dim: int = 32, causal: bool = True, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Rank function: measure CP attention (forward + backward) for each config.

    ``configs``: dicts with ``method``, ``load_balance`` and optionally ``cp`` (a divisor of world_size,
    default world_size; with cp < world_size the ranks form world_size/cp independent CP groups of
    consecutive ranks, all running at once). On CPU torch runs on one thread for the whole profile (restored
    afterwards), so a thread's CPU time is all of its compute and ranks do not compete with their own threads.

    Per config and rank, measured: ``saved_bytes`` (storages autograd saves for the attention's backward,
    bytes, :class:`labkit.runtime.measure.SavedActivations`),
    ``score_entries`` (attention scores the forward kernel computed,
    :func:`labkit.parallel.context.count_work`: a count),
    ``fwd_bytes_model`` / ``bwd_bytes_model`` (a model of the bytes this rank sends: the buffers
    :class:`labkit.runtime.commlog.CommLog` saw the code issue x the ring factor), ``gloo_model_bytes`` (the same
    buffers x the factors of gloo's algorithms, :data:`labkit.experiments.common.GLOO_FACTORS`),
    ``socket_bytes`` (measured: what this process wrote during that forward + backward,
    :func:`labkit.runtime.probes.socket_bytes_written`, gloo's socket sends; None on CUDA or without
    /proc/self/io),
    ``kernel_cpu_ns`` (per repeat: CPU time inside the forward and backward block kernels,
    ``count_work``; None on a GPU, where kernels run asynchronously), ``compute_ns`` (per repeat: the
    rank's attention compute events, wall ns), ``cpu_ns`` (per repeat: CPU time of the rank's thread over
    the whole iteration, ``time.thread_time_ns``, communication bookkeeping included), ``iter_ns`` (per
    repeat, barrier to end of backward) and ``window_ns`` (start, end of the timed repeats on the timeline's
    clock), plus the events in ``ctx.timeline`` (``stage`` = ring step). One warm-up iteration precedes the
    timed ones.

    Raises ValueError (before any collective) for a cp that does not divide world_size or a configuration
    :func:`labkit.theory.context.check_context_parallel` rejects.
    """
    for cfg in configs:  # every rank validates every config before the first collective
        c = cfg.get("cp", ctx.world_size)
        check_divides("cp", c, "world_size", ctx.world_size)
        check_context_parallel(seq_len, c, load_balance=cfg["load_balance"], method=cfg["method"],
                               n_heads=n_heads)
    groups = {}
    for cfg in configs:  # every rank creates the same groups in the same order
        c = cfg.get("cp", ctx.world_size)
        if c not in groups:
            groups[c] = dist.new_subgroups(group_size=c)[0]
    full = [t.to(ctx.device) for t in _qkv(seed, batch, n_heads, seq_len, head_dim)]
    threads = torch.get_num_threads()
    if not ctx.is_cuda:
        torch.set_num_threads(1)
    rows = []
    try:
        for i, cfg in enumerate(configs):
            rows.append(_profile_config(ctx, i, cfg, groups, full, causal, repeats))
    finally:
        torch.set_num_threads(threads)
    return rows


def _profile_config(ctx, i, cfg, groups, full, causal, repeats) -> dict:
    method, lb = cfg["method"], cfg["load_balance"]
    c = cfg.get("cp", ctx.world_size)
    group = groups[c]
    gr = dist.get_rank(group)
    q, k, v, dout = (shard_sequence(t, c, gr, lb).contiguous() for t in full)

    args = (q, k, v, dout, method, causal, lb, group)
    _profile_once(*args)  # warm-up
    before = None if ctx.is_cuda else socket_bytes_written()
    with CommLog() as log, count_work() as work:
        saved_bytes = _profile_once(*args, log=log)
    after = socket_bytes_written() if before is not None else None
    gloo_model = sum(r["nbytes"] * GLOO_FACTORS[r["op"]](r["group_size"]) for r in log.records)
    comm = log.to_frame()
    sent = comm.groupby("tag")["bytes_per_rank"].sum() if len(comm) else {}
    compute_ns, iter_ns, cpu_ns, kernel_ns = [], [], [], []
    ctx.barrier()
    w0 = tl.now_ns()
    for _ in range(repeats):
        ctx.barrier()
        n0 = len(ctx.timeline.events)
        t0, c0 = tl.now_ns(), time.thread_time_ns()
        with count_work() as timed:
            _profile_once(*args, timeline=ctx.timeline)
        cpu_ns.append(time.thread_time_ns() - c0)
        iter_ns.append(tl.now_ns() - t0)
        kernel_ns.append(timed["kernel_cpu_ns"])
        ev = ctx.timeline.events[n0:]
        compute_ns.append(sum(e[4] - e[3] for e in ev if e[2] == "compute"))
    w1 = tl.now_ns()
    ctx.barrier()
    return {"config": i, "method": method, "load_balance": lb, "cp": c, "rank": ctx.rank, "cp_rank": gr,
            "causal": causal, "saved_bytes": saved_bytes, "score_entries": work["score_entries"],
            "fwd_bytes_model": int(sent.get("forward", 0)), "bwd_bytes_model": int(sent.get("backward", 0)),
            "gloo_model_bytes": float(gloo_model),
            "socket_bytes": None if after is None or before is None else after - before,
            "kernel_cpu_ns": None if ctx.is_cuda else kernel_ns, "compute_ns": compute_ns, "cpu_ns": cpu_ns,
            "iter_ns": iter_ns, "window_ns": (w0 - ctx.clock_offset_ns, w1 - ctx.clock_offset_ns)}


def block_costs(*, batch: int, n_heads: int, block_len: int, head_dim: int, repeats: int = 5) -> dict:
    """Measured in this process, on one torch thread: CPU time of one block of ``block_len`` queries against
    ``block_len`` keys through the CP forward and backward kernels (:mod:`labkit.parallel.context.blocks`),
    unmasked (``full_ms``) and with the causal mask (``diagonal_ms``), the minimum over ``repeats`` (the least
    disturbed). fp32, random data.

    Returns ``{"full_ms", "diagonal_ms", "diagonal_over_full"}`` (measured). Raises ValueError for sizes < 1."""
    for name, v in (("batch", batch), ("n_heads", n_heads), ("block_len", block_len), ("head_dim", head_dim),
                    ("repeats", repeats)):
        positive_int(name, v)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, n_heads, block_len, head_dim, generator=g) for _ in range(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    best = {}
    try:
        for label, q_ids in (("full", [1]), ("diagonal", [0])):
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                with count_work() as work:
                    out, lse = _new_out_lse(q)
                    _attend(q, k, v, q_ids, [0], True, out, lse)
                    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
                    _attend_backward(q, k, v, dout, lse, (dout * out).sum(-1), q_ids, [0], True, dq, dk, dv)
                times.append(work["kernel_cpu_ns"] / 1e6)
            best[label] = min(times[1:])
    finally:
        torch.set_num_threads(threads)
    return {"full_ms": best["full"], "diagonal_ms": best["diagonal"],
            "diagonal_over_full": best["diagonal"] / best["full"]}


# ------------------------------------------------------------------------------------------------------
# tables of what ran (measured beside predicted)
# ------------------------------------------------------------------------------------------------------
def profile_table(result, *, batch: int, n_heads: int, seq_len: int, head_dim: int, element_size: int = 4):
    """One row per (config, rank) of a :func:`cp_profile_rank` launch, measured beside predicted:

    ``blocks`` (score entries the kernel computed / (B·heads·(T/cp)²): counted, the same on every run) beside
    ``predicted_blocks`` (:func:`~labkit.theory.context.predicted_blocks`); ``kernel_cpu_ms`` (CPU time inside
    the block kernels, forward + backward, the minimum over repeats: the least disturbed, measured; NaN on a
    GPU); ``compute_ms`` (wall time of the compute events, median over repeats, measured); ``cpu_ms`` (thread
    CPU time of the whole iteration, minimum over repeats, measured); ``compute_share`` (this rank's
    ``kernel_cpu_ms`` / its group's mean, measured; on a GPU ``compute_ms`` instead) beside
    ``predicted_share`` (predicted blocks / mean); ``saved_bytes`` (measured) beside ``predicted_saved_bytes``;
    bytes sent per rank, forward + backward: ``sent_bytes_model`` (a model: the buffers the code issued, counted
    by CommLog, x the ring factor) beside ``predicted_sent_bytes``
    (:func:`~labkit.theory.context.predicted_comm_bytes`) — equal when the code issues the formula's buffers, a
    check of the calls, not of the wire —, ``gloo_model_bytes`` (those buffers x gloo's algorithms' factors),
    ``socket_bytes`` (measured: what the process wrote to gloo's sockets; NaN where not measurable) and
    ``socket_over_gloo_model`` (measured / gloo model; NaN without communication)."""
    rows = [row for rank_rows in result for row in rank_rows]
    df = pd.DataFrame(rows)
    df["kernel_cpu_ms"] = df["kernel_cpu_ns"].map(lambda xs: min(xs) / 1e6 if xs else float("nan"))
    df["compute_ms"] = df["compute_ns"].map(lambda xs: statistics.median(xs) / 1e6)
    df["cpu_ms"] = df["cpu_ns"].map(lambda xs: min(xs) / 1e6)
    df["iter_ms"] = df["iter_ns"].map(lambda xs: statistics.median(xs) / 1e6)
    df["group"] = df["rank"] // df["cp"]
    work = df["kernel_cpu_ms"].where(df["kernel_cpu_ms"].notna(), df["compute_ms"])
    df["compute_share"] = work / work.groupby([df["config"], df["group"]]).transform("mean")
    df["blocks"] = df["score_entries"] / (batch * n_heads * (seq_len // df["cp"]) ** 2)
    pred_share, pred_blocks, pred_saved, pred_sent = [], [], [], []
    for row in df.itertuples():
        blocks = predicted_blocks(row.cp, load_balance=row.load_balance, causal=row.causal, method=row.method)
        pred_blocks.append(blocks[row.cp_rank])
        pred_share.append(blocks[row.cp_rank] / (sum(blocks) / len(blocks)))
        shape = {"batch": batch, "n_heads": n_heads, "seq_len": seq_len, "head_dim": head_dim,
                 "element_size": element_size}
        pred_saved.append(predicted_saved_bytes(row.method, row.cp, **shape))
        pb = predicted_comm_bytes(row.method, row.cp, **shape)
        pred_sent.append(pb["forward"] + pb["backward"])
    df["predicted_share"] = pred_share
    df["predicted_blocks"] = pred_blocks
    df["predicted_saved_bytes"] = pred_saved
    df["sent_bytes_model"] = df["fwd_bytes_model"] + df["bwd_bytes_model"]
    df["predicted_sent_bytes"] = pred_sent
    df["socket_bytes"] = df["socket_bytes"].astype("float64")  # None (not measurable) -> NaN
    df["socket_over_gloo_model"] = (df["socket_bytes"] / df["gloo_model_bytes"]).where(df["gloo_model_bytes"] > 0)
    cols = ["config", "method", "load_balance", "cp", "rank", "blocks", "predicted_blocks", "kernel_cpu_ms",
            "compute_ms", "cpu_ms", "compute_share", "predicted_share", "iter_ms", "saved_bytes",
            "predicted_saved_bytes", "fwd_bytes_model", "bwd_bytes_model", "sent_bytes_model", "predicted_sent_bytes",
            "gloo_model_bytes", "socket_bytes", "socket_over_gloo_model"]
    return df[cols]


def config_timeline(result, config: int):
    """The events of one config of a :func:`cp_profile_rank` launch (a slice of ``result.timeline``)."""
    rows = [row for rank_rows in result for row in rank_rows if row["config"] == config]
    start = min(r["window_ns"][0] for r in rows)
    end = max(r["window_ns"][1] for r in rows)
    return window(result.timeline, (start, end)).reset_index(drop=True)


# ------------------------------------------------------------------------------------------------------
# emulated: the same profile on a named cluster (chapter 07's causal imbalance at cp 4-8)
# ------------------------------------------------------------------------------------------------------
def emulated_config_table(result):
    """Per (config, rank) of a :func:`cp_profile_rank` launch run with ``emulate=...``, on the emulated clock
    (deterministic): ``compute_ms`` (the rank's attention compute events inside the config's timed window,
    summed, divided by the repeats), ``window_ms`` (the config's timed window on that rank / repeats: the step as
    the cluster would run it, waits included) and ``label`` (``emulated (<profile>)``). Raises ValueError for a
    launch that was not emulated."""
    em = getattr(result, "emulation", None)
    if em is None:
        raise ValueError("emulated_config_table() needs a launch made with emulate=...; this one was not emulated")
    frame = result.emulated
    comp = frame[(frame["kind"] == "compute") & (frame["stream"] == "compute")]
    rows = []
    for r in (row for rank_rows in result for row in rank_rows):
        a, b = (em.map_ns(r["rank"], t) for t in r["window_ns"])
        mine = comp[(comp["rank"] == r["rank"]) & (comp["start_ns"] >= a) & (comp["end_ns"] <= b)]
        n = len(r["iter_ns"])
        rows.append({"config": r["config"], "method": r["method"], "load_balance": r["load_balance"],
                     "cp": r["cp"], "rank": r["rank"],
                     "compute_ms": (mine["end_ns"] - mine["start_ns"]).sum() / 1e6 / n,
                     "window_ms": (b - a) / 1e6 / n, "label": em.label})
    return pd.DataFrame(rows)


def emulated_config_timeline(result, config: int):
    """The emulated timeline (``result.emulated``: compute re-timed, the replay's communication on its
    ``comm`` stream) of one config of an emulated :func:`cp_profile_rank` launch; ``attrs["label"]`` kept."""
    em = result.emulation
    rows = [row for rank_rows in result for row in rank_rows if row["config"] == config]
    start = min(em.map_ns(r["rank"], r["window_ns"][0]) for r in rows)
    end = max(em.map_ns(r["rank"], r["window_ns"][1]) for r in rows)
    frame = result.emulated
    out = frame[(frame["start_ns"] >= start) & (frame["end_ns"] <= end)].reset_index(drop=True)
    out.attrs["label"] = em.label
    return out


def cp_step_rank(ctx, configs: list[dict], *, batch: int = 1, n_heads: int = 4, seq_len: int = 1024,
                 head_dim: int = 32, causal: bool = True, seed: int = 0) -> list[dict]:
    """Rank function for an emulated run: one forward + backward of CP attention per config (``method``,
    ``load_balance``; cp = world_size), between barriers, with its events on ``ctx.timeline`` — no warm-up,
    CommLog or kernel timers (an emulated run charges operations, not this machine's time). Rows as
    :func:`cp_profile_rank`'s for :func:`emulated_config_table` (``window_ns``, ``iter_ns``). Raises ValueError
    (before any collective) for a configuration :func:`labkit.theory.context.check_context_parallel` rejects."""
    for cfg in configs:
        check_context_parallel(seq_len, ctx.world_size, load_balance=cfg["load_balance"], method=cfg["method"],
                               n_heads=n_heads)
    full = [t.to(ctx.device) for t in _qkv(seed, batch, n_heads, seq_len, head_dim)]
    rows = []
    for i, cfg in enumerate(configs):
        lb = cfg["load_balance"]
        q, k, v, dout = (shard_sequence(t, ctx.world_size, ctx.rank, lb).contiguous() for t in full)
        ctx.barrier()
        w0 = tl.now_ns()
        _profile_once(q, k, v, dout, cfg["method"], causal, lb, None, timeline=ctx.timeline)
        w1 = tl.now_ns()
        ctx.barrier()
        rows.append({"config": i, "method": cfg["method"], "load_balance": lb, "cp": ctx.world_size,
                     "rank": ctx.rank, "iter_ns": [w1 - w0],
                     "window_ns": (w0 - ctx.clock_offset_ns, w1 - ctx.clock_offset_ns)})
    return rows
