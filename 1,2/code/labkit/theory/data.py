"""Replicated data parallelism, predicted: the bytes of the gradient all-reduce, and the batch split every
data-parallel run needs. Pure Python (no torch); the strategies are in :mod:`labkit.parallel.data`.

Communication per step (ring all-reduce, Patarasuk & Yuan 2009): each rank sends 2(n-1)/n · Ψ · bytes per
element, for Ψ parameters — :func:`predicted_allreduce_bytes`.
"""

from __future__ import annotations

from labkit.checks import check_divides, positive_int


def predicted_allreduce_bytes(n_params: int, world_size: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step to all-reduce Ψ = ``n_params`` gradients with the ring algorithm:
    2(n-1)/n · Ψ · bytes_per_element (Patarasuk & Yuan 2009; nccl-tests PERFORMANCE.md busbw factor;
    Rajbhandari et al. 2020, Sec. 7.1: "2Ψ" per step for DDP). Raises ValueError for n < 1."""
    n = positive_int("world_size", world_size)
    return 2 * (n - 1) / n * positive_int("n_params", n_params) * bytes_per_element


def check_batch(world_size: int, global_batch_size, n_microbatches=1, *, dp_name: str = "dp") -> int:
    """Validate a data-parallel batch split before any launch; returns the local batch size.

    ``world_size`` (= dp) ranks each take ``global_batch_size / dp`` sequences and cut them into
    ``n_microbatches`` equal micro-batches. Raises ValueError naming the value and valid choices when dp does
    not divide global_batch_size or n_microbatches does not divide the local batch."""
    n = positive_int("world_size", world_size)
    gbs = positive_int("global_batch_size", global_batch_size)
    m = positive_int("n_microbatches", n_microbatches)
    unit = n * m
    near = " or ".join(map(str, sorted({max(unit, gbs // unit * unit), -(-gbs // unit) * unit})))
    hint = (f"or choose global_batch_size as a multiple of {dp_name} x n_microbatches = {n} x {m} = {unit} "
            f"(e.g. {near})" if m > 1 else f"or choose global_batch_size as a multiple of {dp_name}={n} (e.g. {near})")
    check_divides(dp_name, n, "global_batch_size", gbs, hint=hint)
    local = gbs // n
    check_divides("n_microbatches", m, "local_batch_size", local,
                  hint=f"local_batch_size = global_batch_size / {dp_name} = {gbs} / {n}; {hint}")
    return local


def overlapped_step_s(forward_s: float, backward_s, comm_s, *, overlap: bool = True) -> dict:
    """Predicted seconds of one data-parallel step whose gradients are all-reduced in buckets.

    ``backward_s[j]`` is the backward compute that makes bucket j ready (buckets in launch order: the last
    layers' first), ``comm_s[j]`` bucket j's all-reduce. With ``overlap`` each bucket's all-reduce starts when
    it is ready and the previous one is done (one communication stream; Li et al. 2020, "PyTorch Distributed",
    Sec. 3.2.3): ready_j = sum(backward_s[:j+1]), end_j = max(ready_j, end_{j-1}) + comm_s[j], and the step
    is ``forward + max(backward, end_last)`` — max(compute, the communication that cannot hide). Without
    overlap (all-reduces after backward, as the naive variant): ``forward + backward + sum(comm_s)``.

    Returns ``{"step_s", "compute_s", "comm_s", "exposed_comm_s"}`` (all predicted). Raises ValueError for
    lists of different lengths or a negative time.
    """
    bwd, comm = [float(x) for x in backward_s], [float(x) for x in comm_s]
    if len(bwd) != len(comm):
        raise ValueError(f"backward_s has {len(bwd)} entries but comm_s has {len(comm)}; give one per bucket")
    if min([float(forward_s), *bwd, *comm], default=0.0) < 0:
        raise ValueError("forward_s, backward_s and comm_s must be >= 0 seconds")
    compute = float(forward_s) + sum(bwd)
    if overlap:
        ready = end = 0.0
        for b, c in zip(bwd, comm):
            ready += b
            end = max(ready, end) + c
        step = float(forward_s) + max(sum(bwd), end)
    else:
        step = compute + sum(comm)
    return {"step_s": step, "compute_s": compute, "comm_s": sum(comm), "exposed_comm_s": step - compute}
