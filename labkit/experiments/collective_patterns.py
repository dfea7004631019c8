"""Three patterns the strategies are built from, measured: AllReduce = ReduceScatter + AllGather (the ZeRO /
FSDP identity), compute/communication overlap (DDP's bucketed all-reduce during backward), and the bytes a
re-partition (all-to-all, DeepSpeed-Ulysses) moves beside a reduce-scatter (Megatron sequence parallelism).

Each experiment is a rank function (``*_rank``), a ``_prepare`` that validates its inputs before any rank
starts, and a ``_finish`` that tabulates every rank's result; :func:`measure` runs several of them, and
:mod:`labkit.experiments.collectives`' sweep, in one launch. The plain functions (:func:`ar_vs_rs_ag`,
:func:`overlap`, :func:`repartition_bytes`) launch one. The timing rules are those of
:mod:`labkit.experiments.collectives`; the predicted ring bytes come from :mod:`labkit.theory.collectives`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import pandas as pd

from labkit.checks import positive_int
from labkit.experiments.collectives import SWEEP, Clock, count_wrong, run_experiments, torch_dtype
from labkit.runtime.probes import socket_bytes_written
from labkit.theory.collectives import (
    ar_vs_rs_ag_bytes,
    check_size,
    element_size,
    parse_size,
    repartition_bytes_per_rank,
)


# ------------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------------
def _stats(times: Sequence[float]) -> dict:
    t = sorted(times)
    return {"time_s": statistics.median(t), "time_min_s": t[0], "time_max_s": t[-1], "repeats": len(t)}


def _slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _timed(ctx, clock: Clock, fn, before=None) -> float:
    """[before()], barrier, start, fn(), device synchronised, stop -> seconds."""
    if before is not None:
        before()
    ctx.barrier()
    clock.start()
    fn()
    return clock.stop()


# ------------------------------------------------------------------------------------------------------
# AllReduce = ReduceScatter + AllGather
# ------------------------------------------------------------------------------------------------------
def ar_vs_rs_ag_rank(ctx, nbytes: int, dtype: str = "float32", warmup: int = 2, repeats: int = 5,
                     seed: int = 0) -> dict:
    """Inside a rank: all-reduce a tensor of S = ``nbytes`` two ways — ``all_reduce`` and ``reduce_scatter``
    then ``all_gather`` — on the same data (small random integers, seeded per rank, so every sum is exact).

    Returns ``equal`` (the two results bitwise equal), ``max_abs_diff``, ``wrong`` (elements that differ
    from the sum recomputed locally from every rank's seed), and per-repeat seconds ``all_reduce``,
    ``rs_ag`` (the two back to back), ``reduce_scatter``, ``all_gather``."""
    import torch

    from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor

    n, dev = ctx.world_size, ctx.device
    count = check_size("reduce_scatter", nbytes, n, dtype)
    td = torch_dtype(dtype)

    def data_of(rank):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return torch.randint(0, 8, (count,), generator=g).to(td)

    data = data_of(ctx.rank).to(dev)
    y = torch.empty_like(data)
    shard = torch.empty(count // n, dtype=td, device=dev)
    out = torch.empty_like(data)

    def ar():
        import torch.distributed as dist

        dist.all_reduce(y)

    def rs():
        reduce_scatter_tensor(shard, data)

    def ag():
        all_gather_tensor(out, shard)

    def rs_ag():
        rs()
        ag()

    def reset():
        y.copy_(data)

    for _ in range(warmup):
        reset()
        ar()
        rs_ag()
    reset()
    ar()
    rs_ag()
    ctx.sync()
    expected = sum(data_of(r).double() for r in range(n)).to(td)
    result = {"equal": bool(torch.equal(y, out)),
              "max_abs_diff": float((y.double() - out.double()).abs().max()),
              "wrong": count_wrong(out, expected, dtype) + count_wrong(y, expected, dtype),
              "all_reduce": [], "rs_ag": [], "reduce_scatter": [], "all_gather": []}
    clock = Clock(ctx)
    for _ in range(repeats):
        result["all_reduce"].append(_timed(ctx, clock, ar, before=reset))
        result["rs_ag"].append(_timed(ctx, clock, rs_ag))
        result["reduce_scatter"].append(_timed(ctx, clock, rs))
        result["all_gather"].append(_timed(ctx, clock, ag))
    return result


def ar_vs_rs_ag(nbytes: int | str = "1M", world_size: int = 2, *, dtype: str = "float32", warmup: int = 2,
                repeats: int = 5, backend: str = "auto", echo: bool = False) -> dict:
    """Launch :func:`ar_vs_rs_ag_rank` and tabulate it.

    Returns a dict: ``table`` (DataFrame, one row per method: ``all_reduce``, ``reduce_scatter + all_gather``,
    ``reduce_scatter``, ``all_gather`` with *measured* time_s/min/max (slowest rank per repeat) and the
    *predicted* bytes each rank sends in a ring, ``predicted_ring_bytes_per_rank`` = 2(n-1)/n S,
    (n-1)/n S + (n-1)/n S, (n-1)/n S, (n-1)/n S — Thakur et al. 2005 sec. 4), ``equal`` (bool, all ranks),
    ``max_abs_diff``, ``wrong``, ``backend``. Raises ValueError for sizes reduce_scatter cannot take
    (:func:`labkit.theory.collectives.check_size`)."""
    spec = {"nbytes": nbytes, "dtype": dtype, "warmup": warmup, "repeats": repeats}
    return measure(world_size, ar_vs_rs_ag=spec, backend=backend, echo=echo)["ar_vs_rs_ag"]


def _ar_prepare(world_size: int, nbytes="1M", dtype="float32", warmup=2, repeats=5) -> dict:
    nbytes = parse_size(nbytes, "nbytes")
    check_size("reduce_scatter", nbytes, world_size, dtype)
    return {"nbytes": nbytes, "dtype": dtype, "warmup": positive_int("warmup", warmup, minimum=0),
            "repeats": positive_int("repeats", repeats)}


def _ar_finish(per_rank: list, spec: dict, world_size: int, res) -> dict:
    n, nbytes = world_size, spec["nbytes"]
    predicted = ar_vs_rs_ag_bytes(nbytes, n)
    rows = []
    for key, label in (("all_reduce", "all_reduce"), ("rs_ag", "reduce_scatter + all_gather"),
                       ("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather")):
        rows.append({"method": label, "world_size": n, "bytes": nbytes,
                     **_stats(_slowest([r[key] for r in per_rank])), "predicted_ring_bytes_per_rank": predicted[label]})
    return {"table": pd.DataFrame(rows), "equal": all(r["equal"] for r in per_rank),
            "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
            "wrong": sum(r["wrong"] for r in per_rank), "backend": res.backend}


# ------------------------------------------------------------------------------------------------------
# overlap: compute while an asynchronous all-reduce runs
# ------------------------------------------------------------------------------------------------------
def _compute(a, n_matmuls: int):
    c = a
    for _ in range(n_matmuls):
        c = (a @ c) * 1e-3
    return c


def overlap_rank(ctx, nbytes: int = 4 << 20, matmul_size: int = 256, n_matmuls: int = 8, steps: int = 4,
                 warmup: int = 1) -> dict:
    """Inside a rank: ``steps`` serialised steps (compute, then a blocking all_reduce of ``nbytes``) followed
    by ``steps`` overlapped steps (issue ``all_reduce(async_op=True)``, compute, ``wait()``), each step after
    a barrier, recorded in ``ctx.timeline``: events ``matmul`` (kind compute) and ``all_reduce`` (kind comm;
    in overlapped steps from issue to the end of ``wait()``), tagged with their step.

    Compute is ``n_matmuls`` float32 matmuls of ``matmul_size`` x ``matmul_size``. On a GPU the compute
    event is timed with CUDA events on the compute stream (a device synchronize would wait for the NCCL
    stream too and hide nothing); on CPU the host clock brackets it.

    Returns ``{"serial_steps": [...], "overlap_steps": [...], "nbytes": nbytes}``."""
    import torch
    import torch.distributed as dist

    from labkit.runtime.timeline import now_ns

    dev = ctx.device
    buf = torch.ones(nbytes // 4, device=dev)
    a = torch.randn(matmul_size, matmul_size, device=dev) / matmul_size**0.5
    for _ in range(warmup):
        _compute(a, n_matmuls)
        dist.all_reduce(buf)
    ctx.sync()
    serial = list(range(steps))
    for s in serial:
        ctx.barrier()
        with ctx.timer("matmul", "compute", step=s):
            _compute(a, n_matmuls)
        with ctx.timer("all_reduce", "comm", step=s, nbytes=nbytes):
            dist.all_reduce(buf)
    overlapped = list(range(steps, 2 * steps))
    for s in overlapped:
        ctx.barrier()
        if ctx.is_cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            anchor_ns = now_ns()
            e0.record()
            work = dist.all_reduce(buf, async_op=True)
            e1.record()
            _compute(a, n_matmuls)
            e2.record()
            work.wait()
            ctx.sync()
            t_end = now_ns()
            c0 = anchor_ns + int(e0.elapsed_time(e1) * 1e6)
            c1 = anchor_ns + int(e0.elapsed_time(e2) * 1e6)
            ctx.timeline.add("matmul", "compute", c0, c1, step=s)
            ctx.timeline.add("all_reduce", "comm", anchor_ns, max(t_end, c1), step=s, nbytes=nbytes)
        else:
            t0 = now_ns()
            work = dist.all_reduce(buf, async_op=True)
            with ctx.timer("matmul", "compute", step=s):
                _compute(a, n_matmuls)
            work.wait()
            ctx.timeline.add("all_reduce", "comm", t0, now_ns(), step=s, nbytes=nbytes)
    return {"serial_steps": serial, "overlap_steps": overlapped, "nbytes": nbytes}


def overlap_summary(timeline: pd.DataFrame, serial_steps: Sequence[int],
                    overlap_steps: Sequence[int]) -> pd.DataFrame:
    """From the timeline of :func:`overlap_rank`: one row per mode (``serialised``, ``overlapped``) with the
    median over (rank, step) of ``compute_s``, ``comm_s`` (the comm event: in overlapped steps it runs from
    issue to the end of ``wait()``), ``step_s`` (first event start to last event end), ``exposed_comm_s``
    (comm time during which the rank computes nothing, :func:`labkit.runtime.timeline.exposed_ns`), and
    ``hidden_fraction`` = 1 - exposed (overlapped) / comm (serialised): the share of the communication's own
    time that compute covered. All measured."""
    from labkit.runtime.timeline import exposed_ns

    out = []
    for mode, steps in (("serialised", serial_steps), ("overlapped", overlap_steps)):
        per = []
        for _, g in timeline[timeline["step"].isin(list(steps))].groupby(["rank", "step"]):
            comp = g.loc[g["kind"] == "compute", "end_ns"] - g.loc[g["kind"] == "compute", "start_ns"]
            comm = g.loc[g["kind"] == "comm", "end_ns"] - g.loc[g["kind"] == "comm", "start_ns"]
            ex = exposed_ns(g)
            per.append({"compute_s": comp.sum() / 1e9, "comm_s": comm.sum() / 1e9,
                        "step_s": (g["end_ns"].max() - g["start_ns"].min()) / 1e9,
                        "exposed_comm_s": float(ex["exposed_ns"].sum()) / 1e9})
        p = pd.DataFrame(per)
        out.append({"mode": mode, **{c: float(p[c].median()) for c in p.columns}})
    df = pd.DataFrame(out)
    comm_alone = df.loc[df["mode"] == "serialised", "comm_s"].iloc[0]
    df["hidden_fraction"] = 1.0 - df["exposed_comm_s"] / comm_alone if comm_alone > 0 else float("nan")
    return df


def overlap(world_size: int = 2, nbytes: int | str = "4M", *, matmul_size: int = 256, n_matmuls: int = 8,
            steps: int = 4, backend: str = "auto", echo: bool = False) -> dict:
    """Launch :func:`overlap_rank`; returns ``{"summary": overlap_summary(...), "timeline": DataFrame,
    "backend": str}``. Raises ValueError for nbytes not a positive multiple of 4 or world_size < 2."""
    spec = {"nbytes": nbytes, "matmul_size": matmul_size, "n_matmuls": n_matmuls, "steps": steps}
    return measure(world_size, overlap=spec, backend=backend, echo=echo)["overlap"]


def _overlap_prepare(world_size: int, nbytes="4M", matmul_size=256, n_matmuls=8, steps=4) -> dict:
    nbytes = parse_size(nbytes, "nbytes")
    check_size("all_reduce", nbytes, world_size, "float32")
    return {"nbytes": nbytes, "matmul_size": positive_int("matmul_size", matmul_size),
            "n_matmuls": positive_int("n_matmuls", n_matmuls), "steps": positive_int("steps", steps)}


def _overlap_finish(per_rank: list, spec: dict, world_size: int, res) -> dict:
    tl = res.timeline[res.timeline["name"].isin(["matmul", "all_reduce"])].reset_index(drop=True)
    r0 = per_rank[0]
    return {"summary": overlap_summary(tl, r0["serial_steps"], r0["overlap_steps"]), "timeline": tl,
            "backend": res.backend}


# ------------------------------------------------------------------------------------------------------
# re-partition (all-to-all) vs reduce-scatter: bytes moved
# ------------------------------------------------------------------------------------------------------
def repartition_rank(ctx, nbytes: int, dtype: str = "float32") -> dict:
    """Inside a rank: for an activation of M = ``nbytes`` in total,

    * re-partition: each rank holds M/n and ``all_to_all_single`` re-shards it (the "distributed transpose":
      sequence-sharded to head-sharded, as in DeepSpeed-Ulysses, Jacobs et al. 2023, sec. 3.1);
    * reduce-scatter: each rank holds a full M-sized partial sum and ``reduce_scatter`` leaves it M/n of the
      total (Megatron sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2).

    Measures the bytes each sends: the growth of ``wchar`` (/proc/self/io) over the call, between barriers,
    on gloo (socket writes); None on NCCL (NVLink/IB traffic is not a system call). Returns
    ``{"all_to_all": bytes|None, "reduce_scatter": bytes|None}`` for this rank."""
    import torch

    n, dev = ctx.world_size, ctx.device
    check_size("reduce_scatter", nbytes, n, dtype)
    check_size("all_to_all", nbytes // n, n, dtype)
    td = torch_dtype(dtype)
    esize = element_size(dtype)
    local = torch.ones(nbytes // esize // n, dtype=td, device=dev)
    moved = torch.empty_like(local)
    full = torch.ones(nbytes // esize, dtype=td, device=dev)
    shard = torch.empty_like(local)
    import torch.distributed as dist

    from labkit.parallel.comm import reduce_scatter_tensor

    calls = {"all_to_all": lambda: dist.all_to_all_single(moved, local),
             "reduce_scatter": lambda: reduce_scatter_tensor(shard, full)}
    out = {}
    for name, fn in calls.items():
        fn()  # warm-up: connections and buffers exist before counting
        ctx.barrier()
        before = socket_bytes_written() if not ctx.is_cuda else None
        fn()
        ctx.sync()
        after = socket_bytes_written() if before is not None else None
        out[name] = None if before is None or after is None else after - before
        ctx.barrier()
    return out


def repartition_bytes(world_size: int = 2, nbytes: int | str = "4M", *, dtype: str = "float32",
                      backend: str = "auto", echo: bool = False) -> pd.DataFrame:
    """Bytes each rank sends to re-partition an M-byte activation with all-to-all vs to reduce-scatter an
    M-byte partial sum: *measured* (mean over ranks of socket bytes written, gloo only; NaN on NCCL) beside
    the *predicted* ring counts, all-to-all (n-1)/n * M/n and reduce-scatter (n-1)/n * M (Thakur et al. 2005,
    sec. 4; nccl-tests doc/PERFORMANCE.md), whose ratio is n: 8x at TP8.

    Returns one row per op: op, world_size, M_bytes, measured_bytes_per_rank, predicted_bytes_per_rank,
    measured_over_predicted. Raises ValueError when M cannot be split into n shards of n chunks each."""
    spec = {"nbytes": nbytes, "dtype": dtype}
    return measure(world_size, repartition=spec, backend=backend, echo=echo)["repartition"]


def _repartition_prepare(world_size: int, nbytes="4M", dtype="float32") -> dict:
    nbytes = parse_size(nbytes, "nbytes")
    check_size("reduce_scatter", nbytes, world_size, dtype)
    check_size("all_to_all", nbytes // world_size, world_size, dtype)
    return {"nbytes": nbytes, "dtype": dtype}


def _repartition_finish(per_rank: list, spec: dict, world_size: int, res) -> pd.DataFrame:
    nbytes = spec["nbytes"]
    pred = repartition_bytes_per_rank(nbytes, world_size)
    rows = []
    for op in ("all_to_all", "reduce_scatter"):
        vals = [r[op] for r in per_rank]
        measured = float("nan") if any(v is None for v in vals) else statistics.mean(vals)
        rows.append({"op": op, "world_size": world_size, "M_bytes": nbytes,
                     "measured_bytes_per_rank": measured, "predicted_bytes_per_rank": pred[op],
                     "measured_over_predicted": measured / pred[op]})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------------
# several experiments, one launch
# ------------------------------------------------------------------------------------------------------
#: the experiments :func:`measure` runs, in this order
EXPERIMENTS = ("sweep", "ar_vs_rs_ag", "repartition", "overlap")


def _experiments() -> dict:
    return {"sweep": SWEEP, "ar_vs_rs_ag": (_ar_prepare, ar_vs_rs_ag_rank, _ar_finish),
            "repartition": (_repartition_prepare, repartition_rank, _repartition_finish),
            "overlap": (_overlap_prepare, overlap_rank, _overlap_finish)}


def measure(world_size: int = 2, *, sweep: dict | None = None, ar_vs_rs_ag: dict | None = None,
            repartition: dict | None = None, overlap: dict | None = None, backend: str = "auto",
            timeout_s: float = 300.0, echo: bool = False) -> dict:
    """Run chapter 2's experiments in **one** launch (a launch costs seconds: spawn, import torch,
    rendezvous), in the order sweep, ar_vs_rs_ag, repartition, overlap.

    Each argument is None (skip) or a dict of that experiment's keyword arguments, as taken by
    :func:`labkit.experiments.collectives.sweep` (ops, sizes, min_size, max_size, factor, dtype, warmup, repeats,
    iters, timings, verify), :func:`ar_vs_rs_ag` (nbytes, dtype, warmup, repeats), :func:`repartition_bytes`
    (nbytes, dtype) and :func:`overlap` (nbytes, matmul_size, n_matmuls, steps). Every spec is validated before
    any rank starts.

    Returns a dict with one entry per experiment run, each what the single function returns.

    Raises:
        ValueError: world_size < 2, no experiment, an unknown keyword, or an experiment's own bad input.
        labkit.LaunchError: a rank failed or the run timed out.
    """
    world_size = positive_int("world_size", world_size)  # each experiment says how many ranks its ops need
    specs = {"sweep": sweep, "ar_vs_rs_ag": ar_vs_rs_ag, "repartition": repartition, "overlap": overlap}
    specs = {k: v for k, v in specs.items() if v is not None}
    if not specs:
        raise ValueError(f"measure() got no experiment; give at least one of: {', '.join(EXPERIMENTS)}")
    return run_experiments(world_size, _experiments(), specs, backend=backend, timeout_s=timeout_s, echo=echo)
