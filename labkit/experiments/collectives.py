"""Measure collectives for real: a sweep over ops and message sizes with algbw/busbw, its table, flags and
alpha-beta fit, recorded GPU sweeps; and :func:`measure`, which runs the sweep and the experiments of
:mod:`labkit.experiments.collective_patterns` (AllReduce = ReduceScatter + AllGather, re-partition bytes,
compute/communication overlap) in one launch.

Run side: the ``*_rank`` functions run inside ranks started by :func:`labkit.launch` (``launch(fn, n, ...)``);
the plain functions (:func:`sweep`, :func:`measure`) launch them and return pandas DataFrames / dicts. The
sizes, op names and sweep plans are checked before any launch by :mod:`labkit.theory.collectives`; the
formulas (busbw factors, alpha-beta) live in :mod:`labkit.theory.costmodel`.

Timing rules (every measured number here follows them): ``warmup`` untimed calls first; before each timed
repeat a barrier (device synchronised first); the device synchronised again before the clock is read (CUDA
events on a GPU); ``repeats`` timed repeats reported as min / median / max. A repeat's time is the slowest
rank's (the collective is done when its last rank is done). Every result is checked against the values it
must hold (``wrong`` = elements that differ, as in nccl-tests' ``#wrong``), and a row whose time does not
grow with its size, or whose bandwidth is beyond physics, is flagged (``flag``), never silently plotted.

Sizes follow nccl-tests: ``bytes`` is S, the whole buffer (all_gather: the gathered output;
reduce_scatter: the full input; all_to_all: the whole send buffer); ``count`` = S / element size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from labkit.checks import check_choice, positive_int
from labkit.paths import data_dir
from labkit.runtime import records
from labkit.theory.collectives import format_size, plan, size_range
from labkit.theory.costmodel import FACTOR_TEXT, OPS, algbw_gbps, bandwidth_ladder, bus_factor, fit_alpha_beta

#: relative tolerance of the value check per dtype (small integers are exact in every dtype; the tolerance
#: only matters for sums above 256 in bfloat16 / 2048 in float16, i.e. very large world sizes)
CHECK_RTOL = {"float32": 0.0, "float64": 0.0, "bfloat16": 1e-2, "float16": 1e-3}
TIMINGS = ("synchronised", "unsynchronised")
#: flags a row can carry
FLAG_FLAT = "time not growing with size"
FLAG_FAST = "faster than any link"


# ------------------------------------------------------------------------------------------------------
# inside a rank: buffers, the ops, their expected values
# ------------------------------------------------------------------------------------------------------
def torch_dtype(dtype: str):
    """The torch dtype of a sweep dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, dtype)


def _pattern(count: int, offset: int, dtype: str, device):
    """Small integers ``(i % 8) + offset``: exact in every dtype for sums up to 256 (bfloat16)."""
    import torch

    return (torch.arange(count, device=device) % 8 + offset).to(torch_dtype(dtype))


def make_buffers(op: str, count: int, rank: int, world_size: int, dtype: str, device) -> tuple:
    """``(input, output)`` tensors for one op with its check pattern filled in (1-D, ``count`` = S/elem).

    all_reduce and broadcast work in place (output is input). Input values (``i`` the element index,
    ``r`` the rank, ``n`` the world size, ``c = count/n``): all_reduce, reduce_scatter, all_gather, send_recv
    ``(i % 8) + r``; broadcast ``(i % 8) + 1`` on rank 0, -1 elsewhere; all_to_all chunk ``d`` (for rank
    ``d``) holds ``r * n + d``."""
    import torch

    n, td = world_size, torch_dtype(dtype)
    if op == "all_reduce":
        x = _pattern(count, rank, dtype, device)
        return x, x
    if op == "broadcast":
        x = _pattern(count, 1, dtype, device) if rank == 0 else torch.full((count,), -1, dtype=td,
                                                                            device=device)
        return x, x
    if op == "all_gather":
        return _pattern(count // n, rank, dtype, device), torch.empty(count, dtype=td, device=device)
    if op == "reduce_scatter":
        return _pattern(count, rank, dtype, device), torch.empty(count // n, dtype=td, device=device)
    if op == "all_to_all":
        x = (rank * n + torch.arange(n, device=device)).repeat_interleave(count // n).to(td)
        return x, torch.empty(count, dtype=td, device=device)
    if op == "send_recv":
        return _pattern(count, rank, dtype, device), torch.empty(count, dtype=td, device=device)
    raise ValueError(f"op={op!r} is not valid; choose one of: {', '.join(OPS)}")


def expected_output(op: str, count: int, rank: int, world_size: int, dtype: str, device="cpu"):
    """What ``output`` must hold on ``rank`` after one call of ``op`` on buffers from :func:`make_buffers`
    (computed independently of the collective, in float64, then cast to ``dtype``)."""
    import torch

    n = world_size
    i = torch.arange(count, dtype=torch.float64, device=device)
    if op == "all_reduce":
        out = n * (i % 8) + n * (n - 1) / 2
    elif op == "broadcast":
        out = i % 8 + 1
    elif op == "all_gather":
        c = count // n
        out = (i % c) % 8 + torch.div(i, c, rounding_mode="floor")
    elif op == "reduce_scatter":
        c = count // n
        out = n * ((i[:c] + rank * c) % 8) + n * (n - 1) / 2
    elif op == "all_to_all":
        c = count // n
        out = torch.div(i, c, rounding_mode="floor") * n + rank
    elif op == "send_recv":
        out = i % 8 + (rank - 1) % n
    else:
        raise ValueError(f"op={op!r} is not valid; choose one of: {', '.join(OPS)}")
    return out.to(torch_dtype(dtype))


def count_wrong(out, expected, dtype: str) -> int:
    """Elements of ``out`` that differ from ``expected`` beyond the dtype's tolerance (:data:`CHECK_RTOL`)."""
    import torch

    if out.shape != expected.shape:
        return max(out.numel(), expected.numel())
    ok = torch.isclose(out.double(), expected.to(out.device).double(), rtol=CHECK_RTOL[dtype], atol=0.0)
    return int((~ok).sum().item())


def run_op(op: str, x, out, rank: int, world_size: int, async_op: bool = False):
    """Issue one collective on buffers from :func:`make_buffers`; returns the work handle(s) when
    ``async_op`` (a list for send_recv), else None after the op completed on the host."""
    import torch.distributed as dist

    from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor

    n = world_size
    if op == "all_reduce":
        return dist.all_reduce(x, async_op=async_op)
    if op == "broadcast":
        return dist.broadcast(x, src=0, async_op=async_op)
    if op == "all_gather":
        return all_gather_tensor(out, x, async_op=async_op)
    if op == "reduce_scatter":
        return reduce_scatter_tensor(out, x, async_op=async_op)
    if op == "all_to_all":
        return dist.all_to_all_single(out, x, async_op=async_op)
    if op == "send_recv":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n),
                                        dist.P2POp(dist.irecv, out, (rank - 1) % n)])
        if async_op:
            return works
        for w in works:
            w.wait()
        return None
    raise ValueError(f"op={op!r} is not valid; choose one of: {', '.join(OPS)}")


def _wait(work) -> None:
    for w in work if isinstance(work, list) else [work]:
        if w is not None:
            w.wait()


class Clock:
    """Times a region on this rank: host ``perf_counter_ns`` on CPU; CUDA events on a GPU, read after the end
    event completed, so asynchronous kernels are inside the region."""

    def __init__(self, ctx):
        self.cuda = ctx.is_cuda
        if self.cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter_ns()

    def stop(self) -> float:
        """Seconds since :meth:`start`, after the device finished the region's work."""
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return (time.perf_counter_ns() - self._t0) / 1e9


def sweep_rank(ctx, cases: Sequence[tuple[str, int, int]], dtype: str = "float32", warmup: int = 5,
               repeats: int = 10, iters: int = 1, timing: str = "synchronised", verify: bool = True) -> list:
    """Inside a rank: time every (op, bytes, count) case of :func:`labkit.theory.collectives.plan`. Returns this
    rank's rows ``(op, bytes, count, repeat, time_s, wrong)``; :func:`summarize` turns all ranks' rows into the
    table.

    Per case: build buffers; ``warmup`` untimed calls; (``verify``) refill, one call, count wrong elements;
    then ``repeats`` x [barrier, start clock, ``iters`` calls, device synchronise, stop clock] and
    time_s = elapsed / iters. ``timing="unsynchronised"`` times the wrong way on purpose (issue with
    ``async_op=True`` and read the clock before waiting), to show what a missing synchronize looks like;
    those rows are for demonstration only.
    """
    check_choice("timing", timing, TIMINGS)
    rows = []
    clock = Clock(ctx)
    for op, nbytes, count in cases:
        x, out = make_buffers(op, count, ctx.rank, ctx.world_size, dtype, ctx.device)
        for _ in range(warmup):
            run_op(op, x, out, ctx.rank, ctx.world_size)
        wrong = 0
        if verify:
            x, out = make_buffers(op, count, ctx.rank, ctx.world_size, dtype, ctx.device)
            ctx.barrier()
            run_op(op, x, out, ctx.rank, ctx.world_size)
            ctx.sync()
            wrong = count_wrong(out, expected_output(op, count, ctx.rank, ctx.world_size, dtype, ctx.device),
                                dtype)
        for rep in range(repeats):
            ctx.barrier()
            if timing == "synchronised":
                clock.start()
                for _ in range(iters):
                    run_op(op, x, out, ctx.rank, ctx.world_size)
                t = clock.stop()
            else:  # the wrong way, on purpose: host clock read before the work completed
                t0 = time.perf_counter_ns()
                works = [run_op(op, x, out, ctx.rank, ctx.world_size, async_op=True) for _ in range(iters)]
                t = (time.perf_counter_ns() - t0) / 1e9
                for w in works:
                    _wait(w)
                ctx.sync()
            rows.append((op, nbytes, count, rep, t / iters, wrong))
    return rows


# ------------------------------------------------------------------------------------------------------
# the table (caller side)
# ------------------------------------------------------------------------------------------------------
RAW_COLUMNS = ["op", "bytes", "count", "repeat", "time_s", "wrong", "rank"]


def raw_frame(per_rank: Sequence[Sequence[tuple]]) -> pd.DataFrame:
    """All ranks' rows of :func:`sweep_rank` (``launch`` result) as one DataFrame with :data:`RAW_COLUMNS`."""
    frames = [pd.DataFrame(list(rows), columns=RAW_COLUMNS[:-1]).assign(rank=r)
              for r, rows in enumerate(per_rank)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RAW_COLUMNS)


def summarize(raw: pd.DataFrame, world_size: int, *, dtype: str = "float32", backend: str = "gloo",
              timing: str = "synchronised", max_plausible_gbps: float | None = None) -> pd.DataFrame:
    """One row per (op, bytes): the sweep table, every number *measured*.

    A repeat's time is the slowest rank's; ``time_s`` is the median over repeats (``time_min_s``,
    ``time_max_s`` beside it); ``algbw_gbps = bytes / time_s / 1e9``; ``busbw_gbps = algbw_gbps *
    bus_factor`` (nccl-tests doc/PERFORMANCE.md); ``wrong`` sums wrong elements over ranks; ``flag`` is
    empty or says why the row is not to be trusted (see :func:`flag_rows`).

    Columns: op, world_size, backend, dtype, timing, bytes, count, repeats, time_s, time_min_s, time_max_s,
    algbw_gbps, bus_factor, factor, busbw_gbps, wrong, flag.
    """
    per_rep = raw.groupby(["op", "bytes", "count", "repeat"], sort=False).agg(time_s=("time_s", "max"),
                                                                              wrong=("wrong", "sum"))
    rows = []
    for (op, nbytes, count), g in per_rep.groupby(level=["op", "bytes", "count"], sort=False):
        times = sorted(g["time_s"])
        med = statistics.median(times)
        f = bus_factor(op, world_size)
        alg = algbw_gbps(nbytes, med) if med > 0 else float("inf")  # a zero time reads as infinitely fast
        rows.append({"op": op, "world_size": world_size, "backend": backend, "dtype": dtype, "timing": timing,
                     "bytes": int(nbytes), "count": int(count), "repeats": len(times), "time_s": med,
                     "time_min_s": times[0], "time_max_s": times[-1], "algbw_gbps": alg, "bus_factor": f,
                     "factor": FACTOR_TEXT[op], "busbw_gbps": alg * f, "wrong": int(g["wrong"].iloc[0])})
    df = pd.DataFrame(rows)
    if len(df):
        df["flag"] = flag_rows(df, max_plausible_gbps=max_plausible_gbps)
    return df


def plausible_gbps() -> float:
    """The fastest bandwidth in data/hardware.yaml (memory or link, GB/s): no collective's algbw or busbw
    can exceed it on any machine the lab knows."""
    return max(r["bandwidth_gbps"] for r in bandwidth_ladder())


def flag_rows(df: pd.DataFrame, *, size_ratio: int = 64, time_ratio: float = 1.5,
              min_bytes: int | None = None, max_plausible_gbps: float | None = None) -> pd.Series:
    """Why each row of a sweep table is not to be trusted ('' when it is).

    * :data:`FLAG_FLAT` — the row has at least ``min_bytes`` (default 4 MiB on gloo, 64 MiB on NCCL: below
      that a link's latency can legitimately hide the bytes) and its fastest repeat (``time_min_s``) is
      under ``time_ratio`` times the latency floor: the fastest repeat of any row of the same op with
      ``size_ratio`` times fewer bytes or less. 64x the data in under 1.5x the time means the clock did not
      wait for the data: the field bug where timings without synchronisation come out flat from 1 MB to
      8 GB. Fastest repeats are compared because load on a shared machine only adds time.
    * :data:`FLAG_FAST` — algbw or busbw above ``max_plausible_gbps`` (default :func:`plausible_gbps`,
      the fastest memory or link of data/hardware.yaml): the "1000x too fast" field bug.
    """
    ceiling = plausible_gbps() if max_plausible_gbps is None else max_plausible_gbps
    flags = pd.Series("", index=df.index, dtype=object)
    keys = [k for k in ("op", "world_size", "timing", "backend") if k in df.columns]
    for _, g in df.groupby(keys, sort=False):
        backend = g["backend"].iloc[0] if "backend" in g.columns else "gloo"
        lo = min_bytes if min_bytes is not None else (4 << 20 if backend == "gloo" else 64 << 20)
        t_min = g["time_min_s"] if "time_min_s" in g.columns else g["time_s"]
        for idx, row in g.iterrows():
            reasons = []
            smaller = g["bytes"] * size_ratio <= row["bytes"]
            if row["bytes"] >= lo and smaller.any() and t_min[idx] < time_ratio * t_min[smaller].min():
                reasons.append(FLAG_FLAT)
            if max(row["algbw_gbps"], row["busbw_gbps"]) > ceiling:
                reasons.append(FLAG_FAST)
            flags[idx] = "; ".join(reasons)
    return flags


def sweep(ops: str | Sequence[str] = "all", sizes: Sequence[int | str] | None = None, world_size: int = 2, *,
          min_size: int | str = "1K", max_size: int | str = "4M", factor: int = 2, dtype: str = "float32",
          warmup: int = 3, repeats: int = 5, iters: int = 1, backend: str = "auto",
          timings: Sequence[str] = ("synchronised",), verify: bool = True, timeout_s: float = 300.0,
          echo: bool = False) -> pd.DataFrame:
    """Launch ``world_size`` ranks and time each op at each size: the sweep table (see :func:`summarize`).

    Args:
        ops: op names or ``"all"`` (:data:`OPS`).
        sizes: explicit sizes S in bytes (ints or ``"4K"`` strings; each must suit its op, else ValueError);
            default: ``size_range(min_size, max_size, factor)`` rounded down per op to a size it accepts.
        world_size: ranks (>= 2).
        dtype: one of :data:`DTYPES`.
        warmup, repeats, iters: untimed calls; timed repeats; calls per timed repeat.
        backend: ``auto`` (NCCL with a GPU per rank, else gloo), ``gloo`` or ``nccl``.
        timings: ``("synchronised",)``; add ``"unsynchronised"`` for demonstration rows timed wrongly.
        verify: check every op's values once per size (``wrong`` column).

    Returns:
        DataFrame, one row per (timing, op, bytes), every number measured (see :func:`summarize`).

    Raises:
        ValueError: unknown op/dtype/timing, bad sizes, world_size < 2 — before any rank starts.
        labkit.LaunchError: a rank failed or the run timed out.
    """
    spec = {"ops": ops, "sizes": sizes, "min_size": min_size, "max_size": max_size, "factor": factor,
            "dtype": dtype, "warmup": warmup, "repeats": repeats, "iters": iters, "timings": timings,
            "verify": verify}
    return run_experiments(world_size, {"sweep": SWEEP}, {"sweep": spec}, backend=backend, timeout_s=timeout_s,
                           echo=echo)["sweep"]


def _sweep_prepare(world_size: int, ops="all", sizes=None, min_size="1K", max_size="4M", factor=2,
                   dtype="float32", warmup=3, repeats=5, iters=1, timings=("synchronised",),
                   verify=True) -> dict:
    for t in timings:
        check_choice("timing", t, TIMINGS)
    explicit = sizes is not None
    cases = plan(ops, list(sizes) if explicit else size_range(min_size, max_size, factor), world_size, dtype,
                 align=not explicit)
    return {"cases": cases, "dtype": dtype, "warmup": positive_int("warmup", warmup, minimum=0),
            "repeats": positive_int("repeats", repeats), "iters": positive_int("iters", iters),
            "timings": tuple(timings), "verify": bool(verify)}


def _sweep_finish(per_rank: list, spec: dict, world_size: int, res) -> pd.DataFrame:
    frames = [summarize(raw_frame([r[i] for r in per_rank]), world_size, dtype=spec["dtype"],
                        backend=res.backend, timing=timing) for i, timing in enumerate(spec["timings"])]
    return pd.concat(frames, ignore_index=True)


def _sweep_all_rank(ctx, cases, dtype, warmup, repeats, iters, timings, verify):
    return [sweep_rank(ctx, cases, dtype, warmup, repeats, iters, timing=t, verify=verify) for t in timings]


FIT_COLUMNS = ["op", "world_size", "alpha_s", "beta_s_per_byte", "fit_algbw_gbps", "fit_busbw_gbps", "n_points",
               "rms_rel_residual"]


def fit_table(df: pd.DataFrame) -> pd.DataFrame:
    """alpha-beta fit (:func:`labkit.theory.costmodel.fit_alpha_beta`) per (op, world_size) of a sweep table,
    using only unflagged rows with ``wrong == 0``.

    Columns: op, world_size, alpha_s, beta_s_per_byte, fit_algbw_gbps (1/beta), fit_busbw_gbps,
    n_points, rms_rel_residual (:data:`FIT_COLUMNS`, also when no op could be fitted). Ops with fewer than 2
    usable sizes are left out."""
    rows = []
    good = df[(df.get("flag", "") == "") & (df["wrong"] == 0)]
    if "timing" in good.columns:
        good = good[good["timing"] == "synchronised"]
    for (op, n), g in good.groupby(["op", "world_size"], sort=False):
        if g["bytes"].nunique() < 2:
            continue
        fit = fit_alpha_beta(g["bytes"].tolist(), g["time_s"].tolist())
        rows.append({"op": op, "world_size": int(n), "alpha_s": fit.alpha_s,
                     "beta_s_per_byte": fit.beta_s_per_byte, "fit_algbw_gbps": fit.bandwidth_gbps,
                     "fit_busbw_gbps": fit.bandwidth_gbps * bus_factor(op, n), "n_points": fit.n_points,
                     "rms_rel_residual": fit.rms_rel_residual})
    return pd.DataFrame(rows, columns=FIT_COLUMNS)


def with_fit(df: pd.DataFrame, fits: pd.DataFrame) -> pd.DataFrame:
    """The sweep table plus ``predicted_time_s`` (alpha + beta S from ``fits``, *predicted*) and
    ``residual`` = (predicted - measured) / measured, for the rows whose op has a fit."""
    out = df.merge(fits[["op", "world_size", "alpha_s", "beta_s_per_byte"]], on=["op", "world_size"],
                   how="inner")
    out["predicted_time_s"] = out["alpha_s"] + out["beta_s_per_byte"] * out["bytes"]
    out["residual"] = (out["predicted_time_s"] - out["time_s"]) / out["time_s"]
    return out.drop(columns=["alpha_s", "beta_s_per_byte"])


def format_table(df: pd.DataFrame) -> str:
    """An nccl-tests-like text table, one block per (op, timing): size, count, type, time (us, median, min,
    max), algbw, busbw (GB/s) and the factor between them, #wrong, flag."""
    lines = []
    for (op, timing), g in df.groupby(["op", "timing"], sort=False):
        n = int(g["world_size"].iloc[0])
        lines.append(f"# {op}  world_size={n}  backend={g['backend'].iloc[0]}  dtype={g['dtype'].iloc[0]}  "
                     f"timing={timing}  (measured: median of {int(g['repeats'].iloc[0])} repeats, "
                     "slowest rank)")
        lines.append(f"# busbw = algbw x {FACTOR_TEXT[op]} = algbw x {bus_factor(op, n):.3f}")
        lines.append(f"#{'size':>9} {'count':>10} {'type':>8} {'time(us)':>10} {'min(us)':>9} {'max(us)':>9} "
                     f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}  flag")
        for r in g.itertuples(index=False):
            lines.append(f" {format_size(r.bytes):>9} {r.count:>10} {r.dtype:>8} {r.time_s * 1e6:>10.1f} "
                         f"{r.time_min_s * 1e6:>9.1f} {r.time_max_s * 1e6:>9.1f} {r.algbw_gbps:>11.3f} "
                         f"{r.busbw_gbps:>11.3f} {r.wrong:>6}  {r.flag}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


#: columns of ``--json`` rows / recorded reference rows
ROW_FIELDS = ["op", "world_size", "backend", "dtype", "timing", "bytes", "count", "repeats", "time_s",
              "time_min_s", "time_max_s", "algbw_gbps", "bus_factor", "factor", "busbw_gbps", "wrong", "flag"]


def to_rows(df: pd.DataFrame) -> list[dict]:
    """The sweep table as a list of plain dicts (JSON-ready) with :data:`ROW_FIELDS`."""
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in df[ROW_FIELDS].to_dict(orient="records")]


# ------------------------------------------------------------------------------------------------------
# recorded GPU runs (data/reference/collectives/)
# ------------------------------------------------------------------------------------------------------
REFERENCE_FORMAT = "labkit.collectives/v1"
NO_REFERENCE = ("No recorded GPU run in data/reference/collectives/: no GPU numbers are shown. "
                "Record one on a GPU node with `python benchmarks/record_gpu_collectives.py`.")


def reference_dir() -> Path:
    """The folder of recorded GPU sweeps, ``data/reference/collectives/`` (may not exist yet): where
    ``benchmarks/record_gpu_collectives.py`` writes and :func:`load_reference` reads."""
    return data_dir() / "reference" / "collectives"


def bad_reference_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a sweep table that must not become GPU reference numbers, each with ``why``: wrong values
    (``wrong != 0``), a synchronised row that :func:`flag_rows` flagged (flat, or beyond the hardware), or a row
    not measured on NCCL (a CPU number recorded as a GPU one). Rows timed ``unsynchronised`` on purpose may be
    flagged: that is what they show. Empty when every row may be recorded."""
    reasons = []
    for r in df.itertuples():
        why = []
        if r.timing == "synchronised" and isinstance(r.flag, str) and r.flag:
            why.append(f"flagged: {r.flag}")
        if r.wrong:
            why.append(f"{r.wrong} wrong values")
        if r.backend != "nccl":
            why.append(f"backend {r.backend}, not nccl")
        reasons.append("; ".join(why))
    out = df.assign(why=reasons)
    return out[out["why"] != ""]


def write_reference(df: pd.DataFrame, identity: dict, path: str | Path) -> Path:
    """Write a recorded sweep (format :data:`REFERENCE_FORMAT`: ``{"format", "identity", "rows"}``),
    atomically. Returns the path. Raises ValueError, writing nothing, when a row must not be recorded
    (:func:`bad_reference_rows`: wrong values, a flagged synchronised row, a row not measured on NCCL)."""
    bad = bad_reference_rows(df)
    if len(bad):
        raise ValueError(f"{len(bad)} row(s) must not be recorded as GPU reference numbers, nothing written: "
                         + "; ".join(f"{r.op} {r.bytes} B ({r.timing}): {r.why}" for r in bad.itertuples()))
    return records.write_reference_doc(to_rows(df), identity, path, REFERENCE_FORMAT)


def load_reference(path: str | Path | None = None) -> pd.DataFrame:
    """Recorded GPU sweeps: one file, or every ``*.json`` in data/reference/collectives/ (default).

    Returns the rows (:data:`ROW_FIELDS` plus ``source`` = file name and ``gpu``), labelled *recorded
    elsewhere*. When there is no file, an empty frame whose ``attrs["status"]`` is :data:`NO_REFERENCE`
    (never invented numbers). Raises ValueError for a file in another format."""
    files = [Path(path)] if path is not None else sorted(reference_dir().glob("*.json"))
    return records.load_reference_frames(files, REFERENCE_FORMAT, columns=list(ROW_FIELDS), no_reference=NO_REFERENCE)


# ------------------------------------------------------------------------------------------------------
# several experiments, one launch
# ------------------------------------------------------------------------------------------------------
def _run_planned_rank(ctx, plan: dict) -> dict:
    """Inside a rank: each planned experiment's rank function in turn (``plan``: name -> (rank function,
    its keyword arguments))."""
    return {name: fn(ctx, **kwargs) for name, (fn, kwargs) in plan.items()}


def run_experiments(world_size: int, experiments: dict, specs: dict, *, backend: str = "auto",
                    timeout_s: float = 300.0, echo: bool = False) -> dict:
    """Run several experiments in **one** launch (a launch costs seconds: spawn, import torch, rendezvous).

    ``experiments``: name -> (prepare(world_size, **spec) -> rank kwargs, rank function, finish(per-rank results,
    rank kwargs, world_size, every rank's result) -> result); ``specs``: name -> that experiment's keyword
    arguments, run in ``specs``' order. Every spec is prepared (validated) before any rank starts. Returns
    name -> the experiment's finished result. Raises ValueError for an unknown keyword (naming the
    experiment) or the experiment's own bad input; labkit.LaunchError when a rank fails or the run times out.
    """
    from labkit.runtime.launcher import launch

    plan = {}
    for name, spec in specs.items():
        prepare, rank_fn, _ = experiments[name]
        try:
            plan[name] = (rank_fn, prepare(world_size, **spec))
        except TypeError as e:
            raise ValueError(f"{name}={spec!r}: {e}") from None
    res = launch(_run_planned_rank, world_size, plan, backend=backend, timeout_s=timeout_s, echo=echo)
    return {name: experiments[name][2]([r[name] for r in res], plan[name][1], world_size, res) for name in plan}


#: the sweep as one of :func:`run_experiments`' experiments (prepare, rank function, finish)
SWEEP = (_sweep_prepare, _sweep_all_rank, _sweep_finish)
