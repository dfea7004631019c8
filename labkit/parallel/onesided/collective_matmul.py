"""Collective matmul: the all-gather before a column-parallel matmul, and the reduce-scatter after a row-parallel
one, split into chunks that overlap with the matmul of the chunk before (Wang et al. 2023, "Overlap
communication with dependent computation via decomposition in large deep learning models", ASPLOS; torch's
micro-pipelined "async TP": ``torch.distributed._symmetric_memory``'s ``fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``). The plain version of each sits beside it; the predicted makespan and hidden
fraction per chunk count are :func:`labkit.theory.overlap.chunked_overlap`.

Shapes (Megatron-LM with sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2): n ranks of the TP group,
N tokens (b x s), H hidden, F the layer's output width, c chunks.

* all-gather + matmul (column-parallel, e.g. the QKV or MLP-up projection): each rank holds the sequence shard
  x [N/n, H] and the weight column block w [H, F/n]; the output is y [N, F/n] = all_gather(x) @ w.
* matmul + reduce-scatter (row-parallel, e.g. the attention-out or MLP-down projection): each rank holds the
  full-sequence activation block x [N, H/n] and w [H/n, F]; the output is its sequence shard
  y [N/n, F] = reduce_scatter(x @ w).

``ctx`` (optional; anything with ``timeline.add(...)`` and ``now_ns()``, e.g. a RankContext) gets one event
per chunk: ``mm[i]`` (compute) and ``ag[i]`` / ``rs[i]`` (comm, from the call's issue to its completion as
the backend's future reports it), so the overlap can be read per chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor


def _check_chunks(n_chunks: int, rows: int, what: str) -> int:
    if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
        raise ValueError(f"n_chunks={n_chunks!r} must be an int >= 1")
    if rows % n_chunks:
        raise ValueError(f"n_chunks={n_chunks} must divide the {rows} rows of {what}; choose a divisor of {rows}")
    return n_chunks


class _Stamps:
    """Issue and completion times of asynchronous collectives, each a comm event on ``ctx.timeline``: the
    completion as the backend's future reports it, or (a backend whose work has no future, e.g. gloo's
    reduce-scatter) when :meth:`wait` returns."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.open = {}  # id(work) -> (name, t0, nbytes) for works without a future

    def issue(self, work, name: str, nbytes: int) -> None:
        if self.ctx is None:
            return
        t0 = self.ctx.now_ns()
        try:
            fut = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            self.open[id(work)] = (name, t0, nbytes)
            return
        fut.then(lambda _f: self.ctx.timeline.add(name, "comm", t0, max(t0, self.ctx.now_ns()), nbytes=nbytes))

    def wait(self, work) -> None:
        work.wait()
        if self.ctx is not None and id(work) in self.open:
            name, t0, nbytes = self.open.pop(id(work))
            self.ctx.timeline.add(name, "comm", t0, self.ctx.now_ns(), nbytes=nbytes)

    def compute(self, name: str, t0: int) -> None:
        if self.ctx is not None:
            self.ctx.timeline.add(name, "compute", t0, self.ctx.now_ns())

    def now(self) -> int:
        return self.ctx.now_ns() if self.ctx is not None else 0


def allgather_matmul(x: torch.Tensor, w: torch.Tensor, group=None, *, ctx=None) -> torch.Tensor:
    """The plain version: all-gather x [N/n, H] into [N, H], then one matmul with w [H, F/n] -> [N, F/n]."""
    n = dist.get_world_size(group)
    st = _Stamps(ctx)
    full = x.new_empty((n * x.shape[0], x.shape[1]))  # [N, H]
    work = all_gather_tensor(full, x.contiguous(), group=group, async_op=True)
    st.issue(work, "ag", full.numel() * full.element_size())
    st.wait(work)
    t0 = st.now()
    y = full @ w  # [N, F/n]
    st.compute("mm", t0)
    return y


def allgather_matmul_chunked(x: torch.Tensor, w: torch.Tensor, n_chunks: int, group=None, *, ctx=None) -> torch.Tensor:
    """Collective matmul: x [N/n, H] split into ``n_chunks`` row chunks [N/(n c), H]; chunk i+1 is all-gathered
    while chunk i's gathered rows [n, N/(n c), H] are multiplied by w [H, F/n]. Returns y [N, F/n], row for row
    the plain version's (rank-major: rows r N/n .. (r+1) N/n come from rank r). Raises ValueError when
    ``n_chunks`` does not divide N/n."""
    n = dist.get_world_size(group)
    m, h = x.shape
    c = _check_chunks(n_chunks, m, "this rank's sequence shard x")
    k = m // c
    st = _Stamps(ctx)
    y = x.new_empty((n, m, w.shape[1]))  # [n, N/n, F/n]: rank-major rows of the output
    bufs = [x.new_empty((n * k, h)) for _ in range(min(c, 2))]  # [n k, H] each: double buffering

    def start(i):
        out = bufs[i % len(bufs)]
        work = all_gather_tensor(out, x[i * k:(i + 1) * k].contiguous(), group=group, async_op=True)
        st.issue(work, f"ag[{i}]", out.numel() * out.element_size())
        return work

    pending = start(0)
    for i in range(c):
        st.wait(pending)  # chunk i gathered: [n k, H]
        nxt = start(i + 1) if i + 1 < c else None  # chunk i+1 flies while chunk i is multiplied
        t0 = st.now()
        y[:, i * k:(i + 1) * k] = (bufs[i % len(bufs)] @ w).view(n, k, -1)  # [n k, F/n] -> [n, k, F/n]
        st.compute(f"mm[{i}]", t0)
        pending = nxt
    return y.view(n * m, -1)  # [N, F/n]


def matmul_reducescatter(x: torch.Tensor, w: torch.Tensor, group=None, *, ctx=None) -> torch.Tensor:
    """The plain version: one matmul x [N, H/n] @ w [H/n, F] -> partial [N, F], then reduce-scatter -> [N/n, F]."""
    n = dist.get_world_size(group)
    st = _Stamps(ctx)
    t0 = st.now()
    partial = x @ w  # [N, F]: this rank's partial sums
    st.compute("mm", t0)
    out = partial.new_empty((partial.shape[0] // n, partial.shape[1]))  # [N/n, F]
    work = reduce_scatter_tensor(out, partial, group=group, async_op=True)
    st.issue(work, "rs", partial.numel() * partial.element_size())
    st.wait(work)
    return out


def matmul_reducescatter_chunked(x: torch.Tensor, w: torch.Tensor, n_chunks: int, group=None, *,
                                 ctx=None) -> torch.Tensor:
    """Row-parallel collective matmul: the partial output's rows destined to each rank are cut into
    ``n_chunks`` chunks; chunk i ([n, N/(n c), H/n] rows of x, one slice per destination rank) is multiplied and
    its reduce-scatter started while chunk i+1 is multiplied. Returns this rank's [N/n, F], equal to the plain
    version's. Raises ValueError when N is not a multiple of n or ``n_chunks`` does not divide N/n."""
    n = dist.get_world_size(group)
    rows, _ = x.shape
    if rows % n:
        raise ValueError(f"x has {rows} rows, not a multiple of the group's {n} ranks")
    m = rows // n
    c = _check_chunks(n_chunks, m, "each rank's share of the output rows")
    k = m // c
    st = _Stamps(ctx)
    xs = x.view(n, m, -1)  # [n, N/n, H/n]: the rows each destination rank will own
    out = x.new_empty((m, w.shape[1]))  # [N/n, F]
    works = []
    for i in range(c):
        t0 = st.now()
        part = (xs[:, i * k:(i + 1) * k].reshape(n * k, -1) @ w).contiguous()  # [n k, F]: chunk i for every rank
        st.compute(f"mm[{i}]", t0)
        dst = out[i * k:(i + 1) * k]  # [k, F], contiguous rows of this rank's output
        work = reduce_scatter_tensor(dst, part, group=group, async_op=True)  # flies while chunk i+1 multiplies
        st.issue(work, f"rs[{i}]", part.numel() * part.element_size())
        works.append((work, part))  # keep part alive until its reduction completes
    for work, _ in works:
        st.wait(work)
    return out
