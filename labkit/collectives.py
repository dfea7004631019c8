"""Measure collectives for real: a sweep over ops and message sizes with algbw/busbw, the alpha-beta fit of
the sweep, AllReduce = ReduceScatter + AllGather, compute/communication overlap, and the bytes a
re-partition (all-to-all) moves beside a reduce-scatter.

Run side: the ``*_rank`` functions run inside ranks started by :func:`labkit.launch` (``launch(fn, n, ...)``);
the plain functions (:func:`sweep`, :func:`ar_vs_rs_ag`, :func:`overlap`, :func:`repartition_bytes`) launch
them and return pandas DataFrames / dicts; :func:`measure` runs several of them in one launch. The formulas
(busbw factors, alpha-beta) live in :mod:`labkit.theory.costmodel` and are re-exported here.

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

import re
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from labkit.checks import check_choice, positive_int
from labkit.paths import data_dir
from labkit.runtime import records
from labkit.runtime.probes import cpu_cores, socket_bytes_written  # noqa: F401 - re-exported
from labkit.theory.costmodel import (  # noqa: F401 - re-exported: the sweep's formulas
    FACTOR_TEXT,
    OPS,
    SPLIT_OPS,
    AlphaBeta,
    algbw_gbps,
    bandwidth_ladder,
    bus_factor,
    busbw_gbps,
    check_world_size,
    fit_alpha_beta,
)

#: dtype name -> bytes per element
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
#: relative tolerance of the value check per dtype (small integers are exact in every dtype; the tolerance
#: only matters for sums above 256 in bfloat16 / 2048 in float16, i.e. very large world sizes)
CHECK_RTOL = {"float32": 0.0, "float64": 0.0, "bfloat16": 1e-2, "float16": 1e-3}
TIMINGS = ("synchronised", "unsynchronised")
#: flags a row can carry
FLAG_FLAT = "time not growing with size"
FLAG_FAST = "faster than any link"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# ------------------------------------------------------------------------------------------------------
# sizes and validation (no torch)
# ------------------------------------------------------------------------------------------------------
def parse_size(text: str | int, name: str = "size") -> int:
    """``"64M"`` -> 67108864. Suffixes K, M, G (also KB/KiB...) are powers of 1024, as in nccl-tests.

    Raises ValueError (naming ``name``) for anything else or a size < 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        return positive_int(name, text)
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{name}={text!r} is not a size; write bytes with an optional K, M or G suffix "
                         "(powers of 1024), e.g. 1024, 4K, 64M, 1G")
    return positive_int(name, int(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: int) -> str:
    """1024 -> ``'1K'``, 67108864 -> ``'64M'`` (powers of 1024), else the plain number of bytes."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def parse_ops(text: str | Iterable[str]) -> list[str]:
    """``"all_reduce,all_gather"`` or a list -> validated op names (``"all"`` = every op). ValueError names
    the valid ops."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    if items == ["all"]:
        return list(OPS)
    if not items:
        raise ValueError(f"ops={text!r} is empty; choose from: {', '.join(OPS)}")
    for op in items:
        check_choice("op", op, OPS)
    return items


def element_size(dtype: str) -> int:
    """Bytes per element of a sweep dtype. ValueError names the valid dtypes."""
    check_choice("dtype", dtype, DTYPES)
    return DTYPES[dtype]


def check_size(op: str, nbytes: int, world_size: int, dtype: str = "float32") -> int:
    """Validate one (op, S) pair; return ``count`` (elements). Raises ValueError when the op is unknown,
    S < 1, S is not whole elements, the world is too small for the op, or S is not divisible as the op
    requires (all_gather, reduce_scatter, all_to_all split S into ``world_size`` equal chunks)."""
    check_choice("op", op, OPS)
    nbytes = positive_int("bytes", nbytes)
    n = check_world_size(op, world_size)
    esize = element_size(dtype)
    if nbytes % esize:
        raise ValueError(f"bytes={nbytes} is not a whole number of {dtype} elements ({esize} bytes each); "
                         f"use a multiple of {esize}")
    count = nbytes // esize
    if op in SPLIT_OPS and count % n:
        raise ValueError(f"{op} splits its buffer into world_size={n} equal chunks, but bytes={nbytes} is "
                         f"{count} {dtype} elements, not divisible by {n}; use a multiple of {n * esize} "
                         "bytes")
    return count


def size_range(min_size: int | str, max_size: int | str, factor: int = 2) -> list[int]:
    """Sizes ``min, min*factor, ...`` up to ``max`` (bytes), like nccl-tests ``-b/-e/-f``. ValueError when
    min > max, a size < 1 or factor < 2."""
    lo, hi = parse_size(min_size, "min_size"), parse_size(max_size, "max_size")
    factor = positive_int("factor", factor, minimum=2)
    if lo > hi:
        raise ValueError(f"min_size={lo} is larger than max_size={hi}; give min_size <= max_size")
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def align_size(op: str, nbytes: int, world_size: int, dtype: str = "float32") -> int:
    """Round S down to the nearest size ``op`` accepts (whole elements, a multiple of ``world_size`` elements
    for the split ops), at least one valid size; what nccl-tests does with ``-b/-e`` sizes."""
    esize = element_size(dtype)
    unit = esize * (world_size if op in SPLIT_OPS else 1)
    return max(unit, nbytes // unit * unit)


def plan(ops: Sequence[str], sizes: Sequence[int], world_size: int, dtype: str = "float32",
         *, align: bool = False) -> list[tuple[str, int, int]]:
    """The (op, bytes, count) cases of a sweep, validated before anything is launched.

    ``align=True`` rounds each size down to one the op accepts (for generated ranges); with ``align=False``
    a size the op cannot take raises ValueError (for sizes the user typed)."""
    ops = parse_ops(ops)
    if not sizes:
        raise ValueError("sizes is empty; give at least one size in bytes")
    cases = []
    for op in ops:
        seen = set()
        for s in sizes:
            s = parse_size(s)
            if align:
                s = align_size(op, s, world_size, dtype)
            if s in seen:
                continue
            seen.add(s)
            cases.append((op, s, check_size(op, s, world_size, dtype)))
    return cases


def check_chapter(*, world_size: int, ops, min_size, max_size, factor: int, warmup: int, repeats: int,
                  ar_size, repartition_size, overlap_size, n_matmuls: int = 32, matmul_size: int = 256,
                  backend: str = "auto") -> dict:
    """Validate chapter 02's parameters before anything is launched (the chapter's first code cell) and
    return the sizes its experiments will use.

    The sweep's range is kept as given (each size rounded down per op to one it accepts, as nccl-tests does
    with ``-b/-e``); ``ar_size``, ``repartition_size`` and ``overlap_size`` are rounded down the same way to
    the nearest size their ops accept on ``world_size`` ranks (reduce_scatter: a multiple of world_size
    elements; the re-partition: of world_size² elements), and ``notes`` says which were rounded.

    Returns ``{"ar_size": bytes, "repartition_size": bytes, "overlap_size": bytes, "sweep_sizes": {op:
    [bytes, ...]}, "notes": [str, ...]}``.

    Raises:
        ValueError: world_size < 2 (a collective needs a peer), an unknown op, a bad size or range, a range
            that gives fewer than 2 sizes for some op (the alpha-beta fit needs at least 2), factor < 2,
            warmup < 0, repeats < 1, n_matmuls or matmul_size < 1, or a backend the machine cannot run
            (:func:`labkit.runtime.launcher.resolve_backend`) — each naming the value and what would be valid.
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError(f"chapter 02 needs world_size >= 2: a collective moves data between ranks, and with one "
                         f"rank nothing crosses a link; got world_size={world_size}")
    op_list = parse_ops(ops)
    sizes = size_range(min_size, max_size, factor)
    positive_int("warmup", warmup, minimum=0)
    positive_int("repeats", repeats)
    positive_int("n_matmuls", n_matmuls)
    positive_int("matmul_size", matmul_size)
    sweep_sizes = {}
    for op, nbytes, _ in plan(op_list, sizes, world_size, align=True):
        sweep_sizes.setdefault(op, []).append(nbytes)
    for op, got in sweep_sizes.items():
        if len(got) < 2:
            raise ValueError(f"min_size={min_size!r}, max_size={max_size!r}, factor={factor} give {op} only "
                             f"{len(got)} size ({got[0]} bytes on {world_size} ranks); the alpha-beta fit needs at "
                             f"least 2: raise max_size to at least {format_size(got[0] * factor)}")
    notes, out = [], {}
    for name, value, op, unit_elems in (("ar_size", ar_size, "reduce_scatter", world_size),
                                        ("repartition_size", repartition_size, "all_to_all",
                                         world_size * world_size),
                                        ("overlap_size", overlap_size, "all_reduce", 1)):
        nbytes = parse_size(value, name)
        unit = unit_elems * DTYPES["float32"]
        if nbytes < unit:
            raise ValueError(f"{name}={value!r} is smaller than one {op} unit on {world_size} ranks ({unit} "
                             f"bytes of float32); use at least {unit}")
        out[name] = nbytes // unit * unit
        if out[name] != nbytes:
            notes.append(f"{name}={value!r} ({nbytes} bytes) rounded down to {out[name]} bytes: {op} on "
                         f"{world_size} ranks needs a multiple of {unit} bytes")
    check_size("reduce_scatter", out["ar_size"], world_size)
    check_size("reduce_scatter", out["repartition_size"], world_size)
    check_size("all_to_all", out["repartition_size"] // world_size, world_size)
    resolve_backend(backend, world_size)
    return {**out, "sweep_sizes": sweep_sizes, "notes": notes}


# ------------------------------------------------------------------------------------------------------
# inside a rank: buffers, the ops, their expected values
# ------------------------------------------------------------------------------------------------------
def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def _pattern(count: int, offset: int, dtype: str, device):
    """Small integers ``(i % 8) + offset``: exact in every dtype for sums up to 256 (bfloat16)."""
    import torch

    return (torch.arange(count, device=device) % 8 + offset).to(_torch_dtype(dtype))


def make_buffers(op: str, count: int, rank: int, world_size: int, dtype: str, device) -> tuple:
    """``(input, output)`` tensors for one op with its check pattern filled in (1-D, ``count`` = S/elem).

    all_reduce and broadcast work in place (output is input). Input values (``i`` the element index,
    ``r`` the rank, ``n`` the world size, ``c = count/n``): all_reduce, reduce_scatter, all_gather, send_recv
    ``(i % 8) + r``; broadcast ``(i % 8) + 1`` on rank 0, -1 elsewhere; all_to_all chunk ``d`` (for rank
    ``d``) holds ``r * n + d``."""
    import torch

    n, td = world_size, _torch_dtype(dtype)
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
    return out.to(_torch_dtype(dtype))


def count_wrong(out, expected, dtype: str) -> int:
    """Elements of ``out`` that differ from ``expected`` beyond the dtype's tolerance (:data:`CHECK_RTOL`)."""
    import torch

    if out.shape != expected.shape:
        return max(out.numel(), expected.numel())
    ok = torch.isclose(out.double(), expected.to(out.device).double(), rtol=CHECK_RTOL[dtype], atol=0.0)
    return int((~ok).sum().item())


def _reduce_scatter(out, x, async_op=False):
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, async_op=async_op)


def _all_gather(out, x, async_op=False):
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, async_op=async_op)


def run_op(op: str, x, out, rank: int, world_size: int, async_op: bool = False):
    """Issue one collective on buffers from :func:`make_buffers`; returns the work handle(s) when
    ``async_op`` (a list for send_recv), else None after the op completed on the host."""
    import torch.distributed as dist

    n = world_size
    if op == "all_reduce":
        return dist.all_reduce(x, async_op=async_op)
    if op == "broadcast":
        return dist.broadcast(x, src=0, async_op=async_op)
    if op == "all_gather":
        return _all_gather(out, x, async_op)
    if op == "reduce_scatter":
        return _reduce_scatter(out, x, async_op)
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


class _Clock:
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
    """Inside a rank: time every (op, bytes, count) case of :func:`plan`. Returns this rank's rows
    ``(op, bytes, count, repeat, time_s, wrong)``; :func:`summarize` turns all ranks' rows into the table.

    Per case: build buffers; ``warmup`` untimed calls; (``verify``) refill, one call, count wrong elements;
    then ``repeats`` x [barrier, start clock, ``iters`` calls, device synchronise, stop clock] and
    time_s = elapsed / iters. ``timing="unsynchronised"`` times the wrong way on purpose (issue with
    ``async_op=True`` and read the clock before waiting), to show what a missing synchronize looks like;
    those rows are for demonstration only.
    """
    check_choice("timing", timing, TIMINGS)
    rows = []
    clock = _Clock(ctx)
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
    return measure(world_size, sweep=spec, backend=backend, timeout_s=timeout_s, echo=echo)["sweep"]


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


def write_reference(df: pd.DataFrame, identity: dict, path: str | Path) -> Path:
    """Write a recorded sweep (format :data:`REFERENCE_FORMAT`: ``{"format", "identity", "rows"}``),
    atomically. Returns the path."""
    return records.write_reference_doc(to_rows(df), identity, path, REFERENCE_FORMAT)


def load_reference(path: str | Path | None = None) -> pd.DataFrame:
    """Recorded GPU sweeps: one file, or every ``*.json`` in data/reference/collectives/ (default).

    Returns the rows (:data:`ROW_FIELDS` plus ``source`` = file name and ``gpu``), labelled *recorded
    elsewhere*. When there is no file, an empty frame whose ``attrs["status"]`` is :data:`NO_REFERENCE`
    (never invented numbers). Raises ValueError for a file in another format."""
    files = [Path(path)] if path is not None else sorted(reference_dir().glob("*.json"))
    return records.load_reference_frames(files, REFERENCE_FORMAT, columns=list(ROW_FIELDS), no_reference=NO_REFERENCE)


# ------------------------------------------------------------------------------------------------------
# helpers for the experiments below
# ------------------------------------------------------------------------------------------------------
def _stats(times: Sequence[float]) -> dict:
    t = sorted(times)
    return {"time_s": statistics.median(t), "time_min_s": t[0], "time_max_s": t[-1], "repeats": len(t)}


def _slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _timed(ctx, clock: _Clock, fn, before=None) -> float:
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

    n, dev = ctx.world_size, ctx.device
    count = check_size("reduce_scatter", nbytes, n, dtype)
    td = _torch_dtype(dtype)

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
        _reduce_scatter(shard, data)

    def ag():
        _all_gather(out, shard)

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
    clock = _Clock(ctx)
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
    (:func:`check_size`)."""
    spec = {"nbytes": nbytes, "dtype": dtype, "warmup": warmup, "repeats": repeats}
    return measure(world_size, ar_vs_rs_ag=spec, backend=backend, echo=echo)["ar_vs_rs_ag"]


def _ar_prepare(world_size: int, nbytes="1M", dtype="float32", warmup=2, repeats=5) -> dict:
    nbytes = parse_size(nbytes, "nbytes")
    check_size("reduce_scatter", nbytes, world_size, dtype)
    return {"nbytes": nbytes, "dtype": dtype, "warmup": positive_int("warmup", warmup, minimum=0),
            "repeats": positive_int("repeats", repeats)}


def _ar_finish(per_rank: list, spec: dict, world_size: int, res) -> dict:
    n, f, nbytes = world_size, (world_size - 1) / world_size, spec["nbytes"]
    rows = []
    for key, label, moved in (("all_reduce", "all_reduce", 2 * f),
                              ("rs_ag", "reduce_scatter + all_gather", 2 * f),
                              ("reduce_scatter", "reduce_scatter", f), ("all_gather", "all_gather", f)):
        rows.append({"method": label, "world_size": n, "bytes": nbytes,
                     **_stats(_slowest([r[key] for r in per_rank])), "predicted_ring_bytes_per_rank": moved * nbytes})
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


#: hidden_fraction an overlapped run must reach when its compute outlasts its communication and every rank
#: has a core of its own (chapter 02's check). Observed on a shared 2-core machine with 2 ranks: >= 0.9.
MIN_HIDDEN_FRACTION = 0.2

#: an oversubscribed run's verdict blames the shared cores only when the hidden fraction is below this share
#: of the predicted bound (min(1, compute / comm)); closer to the bound there is nothing to explain.
CROWDED_SHORTFALL = 0.8


def overlap_verdict(summary: pd.DataFrame, *, world_size: int, backend: str = "gloo",
                    cores: int | None = None) -> dict:
    """What an :func:`overlap_summary` shows, as numbers and one sentence written from them.

    * ``hidden_fraction`` — measured: 1 − exposed comm (overlapped) / comm (serialised);
    * ``predicted_max_hidden_fraction`` — predicted upper bound ``min(1, compute_s / comm_s)`` from the
      serialised steps: an overlapped step can hide at most as much communication as it has compute to hide it
      behind (the ``max(compute, comm)`` model of an overlapped step, as in overlapping DDP's gradient
      all-reduce with backward: Li et al. 2020, "PyTorch Distributed", sec. 3.2.3);
    * ``compute_covers_comm`` — the serialised compute lasted at least as long as the communication, so
      overlap could hide all of it;
    * ``oversubscribed`` — gloo with more ranks than ``cores`` (default :func:`cpu_cores`): a rank's
      communication thread then waits for a core while the matmuls run, so less can hide (the sentence
      says so only when the run hid less than :data:`CROWDED_SHORTFALL` of the bound);
    * ``required_hidden_fraction`` — what the chapter's check asks for when ``compute_covers_comm``:
      :data:`MIN_HIDDEN_FRACTION`, or just more than 0 (overlapped exposes less than serialised) when
      oversubscribed; ``hides`` — the run met it; ``checked`` — whether a chapter should assert ``hides``:
      compute covers the communication and every rank has a core (oversubscribed, a run may hide nothing);
    * ``conclusion`` — the sentence.

    Raises ValueError when the summary lacks the ``serialised`` or ``overlapped`` row, or world_size < 1."""
    world_size = positive_int("world_size", world_size)
    s = summary.set_index("mode")
    if not {"serialised", "overlapped"} <= set(s.index):
        raise ValueError(f"summary has modes {sorted(s.index)}; expected serialised and overlapped "
                         "(from overlap_summary)")
    cores = cpu_cores() if cores is None else positive_int("cores", cores)
    comp, comm = float(s.loc["serialised", "compute_s"]), float(s.loc["serialised", "comm_s"])
    hidden = float(s.loc["overlapped", "hidden_fraction"])
    bound = min(1.0, comp / comm) if comm > 0 else float("nan")
    over = backend == "gloo" and world_size > cores
    required = 0.0 if over else MIN_HIDDEN_FRACTION
    out = {"hidden_fraction": hidden, "predicted_max_hidden_fraction": bound,
           "compute_covers_comm": comp >= comm, "oversubscribed": over, "required_hidden_fraction": required,
           "hides": hidden > required if over else hidden >= required,
           # the chapter asserts ``hides`` only where physics promises it: enough compute, a core per rank
           "checked": comp >= comm and not over,
           "serialised_exposed_ms": float(s.loc["serialised", "exposed_comm_s"]) * 1e3,
           "overlapped_exposed_ms": float(s.loc["overlapped", "exposed_comm_s"]) * 1e3}
    numbers = (f"compute {comp * 1e3:.1f} ms beside an all-reduce of {comm * 1e3:.1f} ms (serialised, measured); "
               f"exposed communication {out['serialised_exposed_ms']:.1f} ms serialised vs "
               f"{out['overlapped_exposed_ms']:.1f} ms overlapped: {hidden:.0%} hidden (measured; at most "
               f"{bound:.0%} can hide, predicted)")
    if out["hides"]:
        verdict = "In this run overlap hid communication: "
    elif not out["compute_covers_comm"]:
        verdict = ("In this run overlap could not hide much, as there was less compute than communication to hide "
                   "it behind: ")
    else:
        verdict = ("In this run overlap did NOT hide the communication, although the compute was long enough: "
                   "the all-reduce's worker thread competed with the matmul for the cores: ")
    # the crowding explanation only where the run fell short: well below what could hide (the bound)
    short_of_bound = bound == bound and hidden < CROWDED_SHORTFALL * bound
    if over and short_of_bound:
        crowd = (f" {world_size} ranks share {cores} cores, so each rank's communication thread waits for a core "
                 f"while the matmuls run: the likely reason less hid than the {bound:.0%} that could.")
    elif over:
        crowd = (f" {world_size} ranks share {cores} cores, yet in this run that did not keep the overlap from "
                 "hiding close to what it could.")
    else:
        crowd = ""
    out["conclusion"] = verdict + numbers + "." + crowd
    return out


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
    td = _torch_dtype(dtype)
    esize = element_size(dtype)
    local = torch.ones(nbytes // esize // n, dtype=td, device=dev)
    moved = torch.empty_like(local)
    full = torch.ones(nbytes // esize, dtype=td, device=dev)
    shard = torch.empty_like(local)
    import torch.distributed as dist

    calls = {"all_to_all": lambda: dist.all_to_all_single(moved, local),
             "reduce_scatter": lambda: _reduce_scatter(shard, full)}
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
    nbytes, f = spec["nbytes"], (world_size - 1) / world_size
    pred = {"all_to_all": f * nbytes / world_size, "reduce_scatter": f * nbytes}
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
#: experiment name -> (prepare(world_size, **spec) -> rank kwargs, rank function, finish(...) -> result)
EXPERIMENTS = {
    "sweep": (_sweep_prepare, _sweep_all_rank, _sweep_finish),
    "ar_vs_rs_ag": (_ar_prepare, ar_vs_rs_ag_rank, _ar_finish),
    "repartition": (_repartition_prepare, repartition_rank, _repartition_finish),
    "overlap": (_overlap_prepare, overlap_rank, _overlap_finish),
}


def _measure_rank(ctx, plan: dict) -> dict:
    """Inside a rank: run each planned experiment's rank function in turn."""
    return {name: EXPERIMENTS[name][1](ctx, **kwargs) for name, kwargs in plan.items()}


def measure(world_size: int = 2, *, sweep: dict | None = None, ar_vs_rs_ag: dict | None = None,
            repartition: dict | None = None, overlap: dict | None = None, backend: str = "auto",
            timeout_s: float = 300.0, echo: bool = False) -> dict:
    """Run several of this module's experiments in **one** launch (a launch costs seconds: spawn, import
    torch, rendezvous), in the order sweep, ar_vs_rs_ag, repartition, overlap.

    Each argument is None (skip) or a dict of that experiment's keyword arguments, as taken by
    :func:`sweep` (ops, sizes, min_size, max_size, factor, dtype, warmup, repeats, iters, timings, verify),
    :func:`ar_vs_rs_ag` (nbytes, dtype, warmup, repeats), :func:`repartition_bytes` (nbytes, dtype) and
    :func:`overlap` (nbytes, matmul_size, n_matmuls, steps). Every spec is validated before any rank starts.

    Returns a dict with one entry per experiment run, each what the single function returns.

    Raises:
        ValueError: world_size < 2, no experiment, an unknown keyword, or an experiment's own bad input.
        labkit.LaunchError: a rank failed or the run timed out.
    """
    from labkit.runtime.launcher import launch

    world_size = positive_int("world_size", world_size)  # each experiment says how many ranks its ops need
    specs = {"sweep": sweep, "ar_vs_rs_ag": ar_vs_rs_ag, "repartition": repartition, "overlap": overlap}
    specs = {k: v for k, v in specs.items() if v is not None}
    if not specs:
        raise ValueError(f"measure() got no experiment; give at least one of: {', '.join(EXPERIMENTS)}")
    plan = {}
    for name, spec in specs.items():
        try:
            plan[name] = EXPERIMENTS[name][0](world_size, **spec)
        except TypeError as e:
            raise ValueError(f"{name}={spec!r}: {e}") from None
    res = launch(_measure_rank, world_size, plan, backend=backend, timeout_s=timeout_s, echo=echo)
    return {name: EXPERIMENTS[name][2]([r[name] for r in res], plan[name], world_size, res) for name in plan}
