"""Small rank functions used by chapter 00, ``labkit doctor`` and the foundation tests.

Each is called by :func:`labkit.launch` as ``fn(ctx, ...)`` and returns plain data.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from labkit.commlog import all_gather_tensor, reduce_scatter_tensor


def hello(ctx) -> dict:
    """Who am I: rank, world size, local rank, backend, device, process id, host, torch threads."""
    return {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "backend": ctx.backend,
            "device": str(ctx.device), "pid": os.getpid(), "host": socket.gethostname(),
            "threads": torch.get_num_threads()}


def probe_collectives(ctx) -> dict:
    """Run each collective once on a small tensor and check its values. Returns op -> "ok" or the error.

    ``send_recv`` on one rank is "skipped (needs 2 ranks)".
    Expected values: all_reduce(rank+1) = n(n+1)/2; all_gather gives [0..n-1]; reduce_scatter of ones
    gives n; broadcast from 0 gives 0 (+42); all_to_all sends i to rank i; send/recv a ring of ranks.
    """
    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    checks = {}

    def run(name, body):
        try:
            result = body()
            checks[name] = "ok" if result is True else "skipped (needs 2 ranks)" if result is None else "wrong values"
        except Exception as e:  # noqa: BLE001 - the probe reports what fails instead of failing
            checks[name] = f"{type(e).__name__}: {e}".splitlines()[0]

    def all_reduce():
        t = torch.tensor([r + 1.0], device=dev)
        dist.all_reduce(t)
        return t.item() == n * (n + 1) / 2

    def all_gather():
        out = torch.empty(n, device=dev)
        all_gather_tensor(out, torch.tensor([float(r)], device=dev))
        return out.tolist() == [float(i) for i in range(n)]

    def reduce_scatter():
        out = torch.empty(1, device=dev)
        reduce_scatter_tensor(out, torch.ones(n, device=dev))
        return out.item() == n

    def broadcast():
        t = torch.tensor([42.0 + r], device=dev)
        dist.broadcast(t, src=0)
        return t.item() == 42.0

    def all_to_all():
        out = torch.empty(n, device=dev)
        dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32, device=dev) + 100 * r)
        return out.tolist() == [float(r + 100 * i) for i in range(n)]

    def send_recv():
        if n == 1:
            return None  # nothing to send to
        buf = torch.empty(1, device=dev)
        reqs = [dist.isend(torch.tensor([float(r)], device=dev), (r + 1) % n), dist.irecv(buf, (r - 1) % n)]
        for w in reqs:  # wait on every handle
            w.wait()
        return buf.item() == (r - 1) % n

    for name, body in [("all_reduce", all_reduce), ("all_gather", all_gather), ("reduce_scatter", reduce_scatter),
                       ("broadcast", broadcast), ("all_to_all", all_to_all), ("send_recv", send_recv),
                       ("barrier", lambda: ctx.barrier() or True)]:
        run(name, body)
    return checks


def straggler_all_reduce(ctx, work_ms: float = 40.0, steps: int = 3) -> dict:
    """Rank r computes for about (r+1) x ``work_ms`` ms, then all-reduces a small tensor, ``steps`` times.

    A collective finishes only when the slowest rank arrives, so each rank's all_reduce lasts about
    (latest compute end) - (its own compute end) + the communication itself. Events go to ctx.timeline
    (compute "work", comm "all_reduce", per step). Returns measured compute_ns per step.
    """
    n = 256
    a = torch.randn(n, n, device=ctx.device)
    # calibrate: how many matmuls make work_ms on this rank
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(5):
        a = torch.tanh(a @ a)
    ctx.sync()
    per = max((time.perf_counter() - t0) / 5, 1e-6)
    reps = max(1, round((ctx.rank + 1) * work_ms / 1e3 / per))
    compute_ns = []
    for step in range(steps):
        ctx.barrier()
        with ctx.timer("work", "compute", step=step):
            t0 = time.perf_counter_ns()
            for _ in range(reps):
                a = torch.tanh(a @ a)
            ctx.sync()
            compute_ns.append(time.perf_counter_ns() - t0)
        t = torch.ones(1024, device=ctx.device)
        with ctx.timer("all_reduce", "comm", step=step, nbytes=t.numel() * t.element_size()):
            dist.all_reduce(t)
    return {"rank": ctx.rank, "reps": reps, "compute_ns": compute_ns}


def straggler_table(timeline) -> pd.DataFrame:  # noqa: F821 - pandas imported inside
    """Predicted vs measured collective wait from a :func:`straggler_all_reduce` timeline.

    Per (step, rank), times in ms from the step's earliest compute start: ``compute_end_ms`` (measured),
    ``arrival_ms`` (measured: when the rank entered all_reduce), ``predicted_wait_ms`` = last arrival of the
    step - this rank's arrival (a collective cannot finish before the last rank has entered it; the
    communication itself taken as free), ``measured_ms`` (the all_reduce event's duration) and
    ``gap_ms`` = measured - predicted (the collective's own cost plus scheduling noise; >= 0 up to timer
    jitter for any correct collective).
    """
    import pandas as pd

    df = timeline
    work = df[df["name"] == "work"].set_index(["step", "rank"])
    comm = df[df["name"] == "all_reduce"].set_index(["step", "rank"])
    out = pd.DataFrame(index=work.index)
    origin = work.groupby("step")["start_ns"].transform("min")
    out["compute_end_ms"] = (work["end_ns"] - origin) / 1e6
    out["arrival_ms"] = (comm["start_ns"] - origin) / 1e6
    last = comm.groupby("step")["start_ns"].transform("max")
    out["predicted_wait_ms"] = (last - comm["start_ns"]) / 1e6
    out["measured_ms"] = (comm["end_ns"] - comm["start_ns"]) / 1e6
    out["gap_ms"] = out["measured_ms"] - out["predicted_wait_ms"]
    return out.reset_index().sort_values(["step", "rank"]).reset_index(drop=True)


def check_getting_started(world_size: int, work_ms: float, steps: int, timeout_s: float) -> None:
    """Validate chapter 00's parameters before any launch. Raises ValueError naming the value and the fix:
    world_size >= 2 (section 4 makes rank 1 fail, and a collective needs a peer), work_ms > 0 (the
    straggler experiment needs unequal work), steps >= 1, timeout_s > 0."""
    from labkit.checks import positive_float, positive_int

    if positive_int("world_size", world_size) < 2:
        raise ValueError(f"world_size={world_size}: chapter 00 needs world_size >= 2 (a collective needs a peer, "
                         "and section 4 makes rank 1 fail)")
    positive_float("work_ms", work_ms)
    positive_int("steps", steps)
    positive_float("timeout_s", timeout_s)
