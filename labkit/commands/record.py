"""``labkit record --out DIR``: measure this machine — a GEMM shape sweep, a streaming-kernel sweep, a collectives
sweep (every op, 1 KiB up to ``--max-size``) and a few DP / TP / PP training steps — and write the rows to
``DIR/recording.csv`` (:data:`labkit.experiments.record.COLUMNS`, each labelled ``measured (<machine>)``) with
``DIR/identity.json`` (and ``DIR/traces.json``: the traced training steps' operations). ``labkit calibrate DIR
--name NAME`` fits a profile on them (docs/calibration.md).

Runs from a checkout on a machine's own ``python3`` and ``torch`` with nothing else installed::

    PYTHONPATH=. python3 -m labkit.commands.record --out runs/recording-h200 --machine h200

(without pandas and cloudpickle the ranks are started by a small spawn runner instead of ``labkit.launch``; a
step run that needs what is missing is one row with ``seconds`` empty and the reason in ``note``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

NAME = "record"
HELP = "measure this machine (GEMMs, memory-bound kernels, collectives, DP/TP/PP steps) into DIR/recording.csv"
PARTS = ("gemm", "memory", "traces", "collectives", "steps")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text, name: str = "--max-size") -> int:
    """``"64M"``, ``"1G"``, ``"4096"`` -> bytes (binary units). Raises ValueError naming the value otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS or int(m.group(1)) < 1:
        raise ValueError(f"{name}={text!r} must be a size >= 1 such as 4096, 64K, 16M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="folder to write recording.csv and identity.json into")
    p.add_argument("--machine", default="this machine", help="the name in the label 'measured (<machine>)'")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: 2 on a CPU, the visible GPUs on a GPU machine, at most 8)")
    p.add_argument("--max-size", default=None,
                   help="largest collective S, e.g. 64M or 1G (default: 1G on a GPU, 64M on a CPU, within memory)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and sizes, collectives up to 1M (a minute)")
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts to record (default {','.join(PARTS)})")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each part may take (default 900)")


def _parts(text: str) -> list[str]:
    parts = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise ValueError(f"--only={text!r}: each part must be one of {', '.join(PARTS)}")
    return parts


def load_record_module():
    """:mod:`labkit.experiments.record`, imported without ``labkit/experiments/__init__.py`` where that cannot
    be imported (it imports pandas; a bare python3 + torch has none): the package is then a bare module whose
    path is the folder, so only ``record.py`` (torch and the standard library) is loaded."""
    try:
        from labkit.experiments import record
    except ImportError:
        import types

        sys.modules.pop("labkit.experiments", None)
        pkg = types.ModuleType("labkit.experiments")
        pkg.__path__ = [str(Path(__file__).resolve().parent.parent / "experiments")]
        sys.modules["labkit.experiments"] = pkg
        from labkit.experiments import record
    return record


class _BareContext:
    """The part of :class:`labkit.runtime.rank.RankContext` the recording's rank functions use."""

    def __init__(self, rank, world_size, device):
        from labkit.runtime.rank import RankContext

        self._ctx = RankContext(rank, world_size, rank, world_size, 0, "nccl" if device.type == "cuda" else "gloo",
                                device)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def track_async(self, work, name, nbytes=0):
        return work  # no CommLog here (it needs pandas): the caller waits on the work itself


def _spawn_entry(rank, world_size, port, fn_name, args, kwargs, queue):
    import torch
    import torch.distributed as dist

    fn = getattr(load_record_module(), fn_name)

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    device = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        queue.put((rank, "ok", fn(_BareContext(rank, world_size, device), *args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn_name: str, world_size: int, *args, timeout_s: float = 600.0, **kwargs) -> list:
    """``fn(ctx, *args, **kwargs)`` for the function ``fn_name`` of :mod:`labkit.experiments.record` on
    ``world_size`` spawned processes (torch.multiprocessing; the store on
    127.0.0.1), NCCL with one GPU per rank when there are enough, else gloo on CPU. Every rank is killed after
    ``timeout_s``; raises RuntimeError naming the rank that failed or the timeout."""
    import queue as queuelib

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpctx = mp.get_context("spawn")
    q = mpctx.Queue()
    procs = [mpctx.Process(target=_spawn_entry, args=(r, world_size, port, fn_name, args, kwargs, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"record: ranks timed out after {timeout_s:g} s")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except queuelib.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"record: rank {dead[0]} exited with status {procs[dead[0]].exitcode}") from None
                continue
            if status != "ok":
                raise RuntimeError(f"record: rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def record(out, *, machine: str = "this machine", world_size: int | None = None, max_size=None,
           quick: bool = False, parts=PARTS, timeout_s: float = 900.0, log=print) -> Path:
    """Measure and write ``out/recording.csv`` and ``out/identity.json``; returns the CSV's path. Raises
    ValueError for a bad argument (before anything runs) and RuntimeError when a part's ranks fail."""
    import torch

    rec = load_record_module()
    parts = _parts(",".join(parts) if not isinstance(parts, str) else parts)
    on_gpu = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if on_gpu else 0
    if world_size is None:
        world_size = min(8, n_gpus) if n_gpus > 1 else 2
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise ValueError(f"--world-size={world_size!r} must be an integer from 1 to 64")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"--timeout={timeout_s!r} must be a number of seconds > 0")
    max_size = rec.default_max_size(on_gpu, world_size, quick) if max_size is None else parse_bytes(max_size)
    room = rec.free_memory_bytes(on_gpu) // (4 * world_size)
    if max_size > room:
        raise ValueError(f"--max-size={max_size} bytes does not fit: {world_size} ranks x 4 buffers of it exceed the "
                         f"free memory; use at most {room} bytes (or leave it out: the default fits)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ident = rec.identity(machine)
    # the ranks' threads: launch gives each rank cores // world_size (labkit.runtime.rank.cpu_threads_per_rank)
    threads = max(1, (os.cpu_count() or 1) // world_size) if not on_gpu or n_gpus < world_size else 0
    kernel_ws = world_size if (not on_gpu or n_gpus >= world_size) else 1
    dtypes = ("float32", "bfloat16", "float16") if on_gpu else ("float32",)
    rows: list[dict] = []

    def part(name, fn, *args, ws=world_size, **kw):
        t0 = time.perf_counter()
        got = rec.run_ranks(fn, ws, *args, timeout_s=timeout_s, **kw)
        new = [r for per_rank in got for r in per_rank]
        rows.extend(new)
        log(f"record: {name}: {len(new)} rows in {time.perf_counter() - t0:.1f} s")

    if "gemm" in parts:
        part("gemm", rec.gemm_rank, rec.gemm_shapes(on_gpu, quick), dtypes, ws=kernel_ws)
    if "memory" in parts:
        mem_max = min(256 << 20, rec.free_memory_bytes(on_gpu) // (8 * kernel_ws)) if on_gpu else (64 << 20)
        part("memory", rec.memory_rank, rec.memory_sizes(mem_max, quick), ws=kernel_ws)
    if "traces" in parts:
        try:
            part("traces", rec.trace_rank, rec.TRACE_RUNS[::2] if quick else rec.TRACE_RUNS, ws=kernel_ws)
        except (ImportError, RuntimeError) as e:  # the tracer needs the lab's emulator (and its data files)
            log(f"record: traces: not run: {str(e).splitlines()[0][:160]}")
    if "collectives" in parts and world_size > 1:
        part("collectives", rec.collective_rank, rec.OPS, rec.collective_sizes(max_size, quick))
    if "steps" in parts and world_size == 2:
        for run in rec.STEP_RUNS:
            t0 = time.perf_counter()
            try:
                spans = [s for per in rec.run_ranks(rec.step_rank, 2, run, steps=3 if quick else 5,
                                                    timeout_s=timeout_s) for s in per]
                row = {"seconds": rec.step_seconds(spans)}
            except (ImportError, RuntimeError) as e:
                row = {"seconds": "", "note": f"not run: {str(e).splitlines()[0][:160]}"}
            dp, tp, pp = rec.STEP_RUNS[run]
            rows.append({"kind": "step", "op": run, "shape": f"dp{dp} tp{tp} pp{pp}", "dtype": "fp32", "bytes": "",
                         "flops": "", **row,
                         "note": row.get("note") or f"{rec.STATISTIC} step after the first; " + ", ".join(
                             f"{k}={v}" for k, v in rec.STEP_DEFAULTS.items())})
            log(f"record: step {run}: {row['seconds'] or row['note']} ({time.perf_counter() - t0:.1f} s)")
    traces = {f"{r['op']}|{r['shape']}": r.pop("trace") for r in rows if "trace" in r}
    rows = rec.finish_rows(rows, ident, world_size, threads)
    (out / "traces.json").write_text(json.dumps(traces) + "\n", encoding="utf-8")
    path = out / "recording.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=rec.COLUMNS)
        w.writeheader()
        w.writerows(rows)
    meta = {**ident, "world_size": world_size, "threads_per_rank": threads, "max_size": max_size, "quick": quick,
            "parts": parts, "format": "labkit-recording/1", "rows": len(rows)}
    (out / "identity.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    log(f"record: {len(rows)} rows, labelled measured ({machine}), in {path}")
    return path


def run(args) -> int:
    record(args.out, machine=args.machine, world_size=args.world_size, max_size=args.max_size, quick=args.quick,
           parts=args.only, timeout_s=args.timeout)
    return 0


def main(argv=None) -> int:
    """``python3 -m labkit.commands.record``: the same command without the rest of the CLI (bare python3 + torch)."""
    p = argparse.ArgumentParser(prog="labkit record", description=HELP)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"labkit record: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"labkit record: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
