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
