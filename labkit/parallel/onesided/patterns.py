"""Patterns one-sided communication expresses and a fixed collective does not, each beside its plain version.

* **Producer / consumer by tiles** (:func:`tiles_two_sided`, :func:`tiles_one_sided`): every rank computes
  y = x @ w [M, F] for its right neighbour, which multiplies it by its own w2. Two-sided, the whole y is sent
  after the last tile; one-sided, each tile is put into the neighbour's heap as soon as it is computed and a
  flag says how many have landed, so the consumer starts on tile 0 while tile 1 is computed (the pattern of
  NVSHMEM's ``putmem_signal`` inside a kernel; NVSHMEM docs, "Signal operations").
* **TP -> DP re-partition** (:func:`repartition_alltoall`, :func:`repartition_onesided`): activations in
  Megatron's [S, B, H] layout, sharded by heads (each rank holds [S, B, H/n], its heads' columns), become
  sharded by batch (each rank [S, B/n, H], every column). As an all-to-all it needs a pack pass (the strided
  [S, B/n, H/n] blocks copied into a contiguous send buffer), a receive buffer, and an unpack pass (each source's
  columns copied into place); one-sided, each rank writes each block straight to its final address in the
  owner's output: no pass and no intermediate buffer (:func:`labkit.theory.overlap.repartition_cost` counts
  both).

Every function returns ``(result, stats)``: ``stats`` counts what the run moved and copied, in bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _peers(group) -> tuple[int, int, int, int]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
    return n, r, glob((r + 1) % n), glob((r - 1) % n)


def _check_tiles(n_tiles: int, rows: int) -> int:
    if isinstance(n_tiles, bool) or not isinstance(n_tiles, int) or n_tiles < 1 or rows % n_tiles:
        raise ValueError(f"n_tiles={n_tiles!r} must be an int >= 1 that divides the {rows} rows of x")
    return n_tiles


def tiles_two_sided(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, n_tiles: int, group=None):
    """Plain: compute y = x [M, K] @ w [K, F] tile by tile, send all of y [M, F] to the right neighbour after
    the last tile, receive the left neighbour's, return (y_left @ w2 [F, G] -> [M, G], stats)."""
    n, _, right, left = _peers(group)
    t = _check_tiles(n_tiles, x.shape[0])
    k = x.shape[0] // t
    y = torch.cat([x[i * k:(i + 1) * k] @ w for i in range(t)])  # [M, F]
    got = torch.empty_like(y)  # [M, F]
    ops = [dist.P2POp(dist.isend, y, right, group), dist.P2POp(dist.irecv, got, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got @ w2, {"sent_bytes": y.numel() * y.element_size(), "messages": 1}  # [M, G]


def tiles_one_sided(heap, x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, n_tiles: int, *, flag: int = 0,
                    epoch: int = 1, ctx=None):
    """One-sided: tile i of y = x @ w ([M/t, F]) is put into the right neighbour's heap at row offset i and
    flag ``flag`` set to ``epoch * t + i + 1`` (counters only grow, so a heap reused for another ``epoch``
    never sees a stale flag); the left neighbour's tiles are consumed as they land; a barrier at the end (the heap
    may then be reused). ``heap`` holds at least
    M x F elements of x's dtype per rank. Returns (y_left @ w2 -> [M, G], stats)."""
    n, r = heap.world_size, heap.rank
    right_local = (r + 1) % n  # the heap's ranks are the group's
    t = _check_tiles(n_tiles, x.shape[0])
    k = x.shape[0] // t
    f = w.shape[1]
    esize = x.element_size()
    base = (epoch - 1) * t
    out = []
    produced = 0
    for i in range(t):  # produce tile i, then consume whatever has landed (on CPU: one process does both)
        t0 = ctx.now_ns() if ctx is not None else 0
        tile = x[i * k:(i + 1) * k] @ w  # [k, F]
        heap.put(right_local, tile, offset=i * k * f * esize)
        heap.signal(right_local, flag, base + i + 1)
        produced += 1
        if ctx is not None:
            ctx.timeline.add(f"tile[{i}]", "compute", t0, ctx.now_ns())
        while len(out) < produced and heap.flag(flag) >= base + len(out) + 1:
            j = len(out)
            out.append(heap.view(r, (k, f), x.dtype, offset=j * k * f * esize) @ w2)  # [k, G]
    while len(out) < t:
        j = len(out)
        heap.wait_until(flag, base + j + 1)
        out.append(heap.view(r, (k, f), x.dtype, offset=j * k * f * esize) @ w2)  # [k, G]
    heap.barrier()  # every tile read before any rank may reuse the heap
    return torch.cat(out), {"sent_bytes": x.shape[0] * f * esize, "messages": t}  # [M, G]


def repartition_alltoall(x: torch.Tensor, group=None):
    """TP -> DP with ``all_to_all_single``: x [S, B, H/n] (this rank's heads) -> [S, B/n, H] (its batch rows,
    every head), with a pack pass, a receive buffer and an unpack pass. Returns (out, stats)."""
    n = dist.get_world_size(group)
    s, b, hn = x.shape
    if b % n:
        raise ValueError(f"batch {b} must be a multiple of the group's {n} ranks")
    bn = b // n
    send = x.view(s, n, bn, hn).permute(1, 0, 2, 3).contiguous()  # pass 1 (pack): [n, S, B/n, H/n]
    recv = torch.empty_like(send)  # the intermediate: [n, S, B/n, H/n], block j from rank j
    dist.all_to_all_single(recv, send, group=group)
    out = recv.permute(1, 2, 0, 3).reshape(s, bn, n * hn)  # pass 2 (unpack): [S, B/n, H]
    local = x.numel() * x.element_size()
    return out, {"moved_bytes": local * (n - 1) // n, "passes": 2, "extra_bytes": 2 * local,
                 "copied_bytes": 2 * 2 * local}


def repartition_onesided(heap, x: torch.Tensor, *, epoch: int = 1, flag: int = 0):
    """TP -> DP with one-sided strided puts: rank r writes its block for rank j, x[:, j B/n:(j+1) B/n] ([S, B/n,
    H/n], a strided view: no pack), straight into columns r H/n .. (r+1) H/n of rank j's output [S, B/n, H] in
    j's heap; then signals j's flag ``flag + r``, and waits for every source's flag. Returns (a copy of this
    rank's output [S, B/n, H], stats). The heap needs S x B/n x H elements of x's dtype and ``flag + n`` flags."""
    n, r = heap.world_size, heap.rank
    s, b, hn = x.shape
    if b % n:
        raise ValueError(f"batch {b} must be a multiple of the group's {n} ranks")
    bn, h = b // n, hn * n
    shape = (s, bn, h)
    for j in range(n):
        heap.put_strided(j, x[:, j * bn:(j + 1) * bn], shape, (slice(None), slice(None), slice(r * hn, (r + 1) * hn)))
    heap.quiet()
    for j in range(n):
        heap.signal(j, flag + r, epoch)
    for src in range(n):
        heap.wait_until(flag + src, epoch)
    out = heap.view(r, shape, x.dtype).clone()  # [S, B/n, H]
    heap.barrier()  # every output read before any rank may reuse the heap
    local = x.numel() * x.element_size()
    return out, {"moved_bytes": local * (n - 1) // n, "passes": 0, "extra_bytes": 0, "copied_bytes": 0}
