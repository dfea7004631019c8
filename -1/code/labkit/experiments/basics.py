"""Small rank functions used by chapter 00, ``labkit doctor``, the foundation tests and torchrun examples.

Each is called by :func:`labkit.launch` as ``fn(ctx, ...)`` and returns plain data.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from labkit.runtime.commlog import all_gather_tensor, reduce_scatter_tensor


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


def straggler_steps(ctx, work_ms: float = 40.0, steps: int = 3, compute: str = "matmul") -> dict:
    """Chapter 00's straggler, with compute that lasts what it says: rank r computes for (r+1) x ``work_ms`` ms,
    then all-reduces 4 KiB, ``steps`` times (a barrier before each step).

    ``compute="matmul"``: 256 x 256 matmuls until (r+1) x ``work_ms`` ms of wall time have passed since the step
    began (real work, timed by the clock rather than calibrated, so the duration holds whatever the load);
    ``compute="sleep"``: ``time.sleep`` of that long — what an emulated run charges as exactly that much work on
    any hardware (docs/emulation.md). Events: compute "work" and comm "all_reduce", per step. Returns the rank,
    the matmuls it ran per step, and its measured compute per step (ns)."""
    from labkit.checks import check_choice

    check_choice("compute", compute, ("matmul", "sleep"))
    a = torch.randn(256, 256, device=ctx.device)
    budget_s = (ctx.rank + 1) * work_ms / 1e3
    reps, compute_ns = [], []
    for step in range(steps):
        ctx.barrier()
        with ctx.timer("work", "compute", step=step):
            t0 = time.perf_counter()
            k = 0
            if compute == "sleep":
                time.sleep(budget_s)
            else:
                while time.perf_counter() - t0 < budget_s:
                    a = torch.tanh(a @ a)
                    k += 1
            ctx.sync()
            compute_ns.append(int((time.perf_counter() - t0) * 1e9))
        reps.append(k)
        t = torch.ones(1024, device=ctx.device)
        with ctx.timer("all_reduce", "comm", step=step, nbytes=t.numel() * t.element_size()):
            dist.all_reduce(t)
    return {"rank": ctx.rank, "reps": reps, "compute_ns": compute_ns}
