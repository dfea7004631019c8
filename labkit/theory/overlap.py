"""Fine-grained overlap: a collective split into chunks, each overlapped with the compute that consumes (or
produces) it, and what the chunk count buys and costs. Pure Python, no torch.

The model (a two-stage flow shop of ``c`` identical jobs: Johnson 1954, "Optimal two- and three-stage production
schedules", Naval Research Logistics Quarterly 1(1); the same pipeline formula as a GPipe bubble):

* all-gather then matmul ("collective matmul", Wang et al. 2023, "Overlap communication with dependent
  computation via decomposition in large deep learning models", ASPLOS; torch's micro-pipelined / async TP):
  the gathered input of S bytes is fetched in ``c`` chunks of S/c; chunk i's matmul (C/c seconds) runs while
  chunk i+1 is in flight. One chunk's transfer takes ``t = alpha + beta * S / c`` (a fixed per-chunk latency
  ``alpha`` and an inverse bandwidth ``beta``), so::

      makespan(c) = t + (c - 1) * max(t, C / c) + C / c

* matmul then reduce-scatter (the row-parallel counterpart): chunk i's partial output is reduce-scattered
  while chunk i+1 is computed: the same formula with the stages swapped (a two-stage flow shop of identical
  jobs has the same makespan in either order).

``c = 1`` is the plain, serial version: ``alpha + beta S + C``. More chunks hide more of the transfer (only
the first chunk's transfer, or the last one's reduction, stays exposed) until the per-chunk latency ``alpha``
dominates: with many chunks the pipeline becomes bound by ``c * alpha`` and the makespan grows again. The
hidden fraction is ``1 - exposed / (c * t)`` with ``exposed = makespan - C``.
"""

from __future__ import annotations

import math

from labkit.checks import positive_int

#: the largest chunk count :func:`best_chunks` searches (beyond it per-chunk latency always loses here)
MAX_CHUNKS = 4096
KINDS = ("allgather_matmul", "matmul_reducescatter")


def _nonneg(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    return float(value)


def chunked_overlap(*, nbytes: float, compute_s: float, alpha_s: float, beta_s_per_byte: float,
                    n_chunks: int, kind: str = "allgather_matmul") -> dict:
    """Predicted makespan and hidden fraction of a collective of ``nbytes`` split into ``n_chunks`` chunks,
    overlapped with ``compute_s`` seconds of compute that splits evenly with it (module docstring formula).

    Args:
        nbytes: S, bytes the collective moves in all (>= 0).
        compute_s: C, seconds of the matmul over the whole input (>= 0).
        alpha_s: per-chunk latency, seconds (>= 0): a collective call's fixed cost.
        beta_s_per_byte: seconds per byte of the collective (>= 0): 1 / its effective bandwidth.
        n_chunks: c >= 1.
        kind: one of :data:`KINDS` (the two give the same makespan; kept for labels).

    Returns a dict: ``n_chunks``, ``chunk_comm_s`` (t), ``chunk_compute_s`` (C/c), ``comm_s`` (c t, the
    transfers' total), ``compute_s``, ``serial_s`` (alpha + beta S + C: c = 1), ``makespan_s``, ``exposed_comm_s``
    (makespan - C), ``hidden_fraction`` (1 - exposed / (c t), in [0, 1]), ``speedup`` (serial / makespan),
    ``bound`` ("comm" when t > C/c, else "compute"), ``source`` = "predicted (two-stage pipeline)".

    Raises ValueError for a negative or non-finite number, n_chunks < 1 or an unknown kind."""
    s = _nonneg("nbytes", nbytes)
    comp = _nonneg("compute_s", compute_s)
    a = _nonneg("alpha_s", alpha_s)
    b = _nonneg("beta_s_per_byte", beta_s_per_byte)
    c = positive_int("n_chunks", n_chunks)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {', '.join(KINDS)}")
    t = a + b * s / c
    m = comp / c
    makespan = t + (c - 1) * max(t, m) + m
    exposed = max(0.0, makespan - comp)
    comm = c * t
    hidden = 1.0 - exposed / comm if comm > 0 else 1.0
    serial = a + b * s + comp
    return {"kind": kind, "n_chunks": c, "chunk_comm_s": t, "chunk_compute_s": m, "comm_s": comm,
            "compute_s": comp, "serial_s": serial, "makespan_s": makespan, "exposed_comm_s": exposed,
            "hidden_fraction": min(1.0, max(0.0, hidden)), "speedup": serial / makespan if makespan > 0 else 1.0,
            "bound": "comm" if t > m else "compute", "source": "predicted (two-stage pipeline)"}


def best_chunks(*, nbytes: float, compute_s: float, alpha_s: float, beta_s_per_byte: float,
                max_chunks: int = 256, kind: str = "allgather_matmul") -> dict:
    """The chunk count in 1..``max_chunks`` with the shortest :func:`chunked_overlap` makespan (the smallest
    such count on a tie), as that function's dict plus ``searched`` (max_chunks). O(max_chunks).

    Raises ValueError as :func:`chunked_overlap` does, and for max_chunks outside 1..:data:`MAX_CHUNKS`."""
    top = positive_int("max_chunks", max_chunks)
    if top > MAX_CHUNKS:
        raise ValueError(f"max_chunks={max_chunks} must be at most {MAX_CHUNKS}")
    best = None
    for c in range(1, top + 1):
        row = chunked_overlap(nbytes=nbytes, compute_s=compute_s, alpha_s=alpha_s, beta_s_per_byte=beta_s_per_byte,
                              n_chunks=c, kind=kind)
        if best is None or row["makespan_s"] < best["makespan_s"] * (1 - 1e-12):
            best = row
    return {**best, "searched": top}


def repartition_cost(*, batch: int, seq_len: int, hidden_size: int, tp: int, bytes_per_element: int = 2) -> dict:
    """Bytes and memory passes of re-partitioning head-sharded (TP) activations [B, S, H/tp] on each of ``tp``
    ranks into batch-sharded (DP) ones [B/tp, S, H], two ways:

    * **all-to-all**: pack the send buffer (one local permutation pass: [B, S, H/tp] -> [tp, B/tp, S, H/tp]),
      ``all_to_all_single`` into a receive buffer of the same size (the intermediate), unpack (a second pass:
      [tp, B/tp, S, H/tp] -> [B/tp, S, H]);
    * **one-sided puts to final addresses**: each rank writes its [B/tp, S, H/tp] block for rank j straight into
      columns ``r H/tp ...`` of rank j's output (a strided put): no pack, no unpack, no intermediate.

    Both move the same bytes between ranks: ``(tp - 1) / tp`` of each rank's activations (its own block stays).
    Returns per rank: ``local_bytes`` (B S H/tp x bytes), ``moved_bytes`` (what leaves the rank),
    ``alltoall_passes`` (2 local permutation passes: the pack and the unpack, each reading and writing the
    whole local tensor), ``alltoall_extra_bytes`` (send + receive staging buffers: 2 x local bytes),
    ``onesided_passes`` (0), ``onesided_extra_bytes`` (0), ``alltoall_memory_traffic_bytes`` (2 passes x
    read + write + the transfer's own read and write), ``onesided_memory_traffic_bytes`` (the transfer's read and
    write only). ``source`` = "predicted (counting)". Raises ValueError unless tp divides batch and hidden_size.
    """
    b, s, h = positive_int("batch", batch), positive_int("seq_len", seq_len), positive_int("hidden_size", hidden_size)
    p, e = positive_int("tp", tp), positive_int("bytes_per_element", bytes_per_element)
    if b % p or h % p:
        raise ValueError(f"tp={p} must divide batch={b} and hidden_size={h} (each rank gets B/tp rows and H/tp "
                         "columns); choose a batch that is a multiple of tp")
    local = b * s * (h // p) * e
    moved = local * (p - 1) // p
    return {"tp": p, "local_bytes": local, "moved_bytes": moved, "alltoall_passes": 2, "onesided_passes": 0,
            "alltoall_extra_bytes": 2 * local, "onesided_extra_bytes": 0,
            "alltoall_memory_traffic_bytes": 2 * 2 * local + 2 * local,
            "onesided_memory_traffic_bytes": 2 * local, "source": "predicted (counting)"}
