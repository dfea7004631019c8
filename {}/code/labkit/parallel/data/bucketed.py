"""Bucketed, overlapped data parallelism: gradients are packed into buckets (reverse parameter order,
which is roughly the order backward produces them); a bucket's ``all_reduce`` is launched asynchronously
from a gradient hook the moment its last gradient is ready, so communication overlaps the rest of backward
(Li et al. 2020, "PyTorch Distributed", Sec. 3.2 and 4.2: bucketing and overlap).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import positive_float, positive_int
from labkit.parallel.data.naive import DataParallelNaive, broadcast_parameters, queue_after_backward

#: DDP's default bucket size, ``bucket_cap_mb=25`` (MiB)
DEFAULT_BUCKET_CAP_MB = 25.0
#: the same in bytes
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
#: DDP's cap for the first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): a small first bucket
#: lets the first all-reduce start as soon as the output layer's gradients exist
DEFAULT_FIRST_BUCKET_BYTES = 2**20


def bucket_cap(bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB, bucket_cap_bytes: int | None = None) -> int | None:
    """The bucket size in bytes from DDP's ``bucket_cap_mb`` (MiB, a float; None = one unbounded bucket) or
    the lab's ``bucket_cap_bytes`` (an int; it wins when given, and then ``bucket_cap_mb`` must be left at
    its default). Returns None for one bucket.

    Raises ValueError for a non-positive size, or for both given."""
    if bucket_cap_bytes is not None:
        if bucket_cap_mb is None or float(bucket_cap_mb) != DEFAULT_BUCKET_CAP_MB:
            raise ValueError(f"give one bucket size: bucket_cap_mb={bucket_cap_mb!r} or "
                             f"bucket_cap_bytes={bucket_cap_bytes!r}, not both")
        return positive_int("bucket_cap_bytes", bucket_cap_bytes)
    if bucket_cap_mb is None:
        return None
    return max(1, int(positive_float("bucket_cap_mb", bucket_cap_mb) * 2**20))


class _Bucket:
    """Parameters whose gradients are all-reduced together, through one flat buffer [numel]."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        p0 = params[0]
        self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)  # [numel]
        self.ready = 0
        self.work = None


def assign_buckets(params: list[nn.Parameter], bucket_cap_bytes: int | None,
                   first_cap_bytes: int | None) -> list[_Bucket]:
    """Buckets in reverse parameter order; a bucket closes once it holds at least its cap (DDP's rule in
    ``compute_bucket_assignment_by_size``), the first one at ``first_cap_bytes``. A cap of None never
    closes a bucket (None for both: one bucket with every parameter)."""
    buckets: list[_Bucket] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        cap = bucket_cap_bytes if buckets else first_cap_bytes
        if cap is not None and size >= cap:
            buckets.append(_Bucket(cur))
            cur, size = [], 0
    if cur:
        buckets.append(_Bucket(cur))
    return buckets


class DataParallelBucket(nn.Module):
    """Bucketed, overlapped gradient all-reduce launched from gradient hooks.

    Args:
        module: the full model (broadcast from the group's first rank at construction), kept as ``.module``.
        ctx: keyword-only, as every option: the rank's context (timeline events), or None.
        group: the data-parallel process group (default: the world).
        bucket_cap_mb: DDP's bucket size in MiB (float, default 25); None = one bucket holding every
            gradient (one all-reduce per step, launched when the last gradient is ready).
        bucket_cap_bytes: the same in bytes (an int); overrides ``bucket_cap_mb``.
        first_bucket_cap_bytes: the first bucket's cap (default: DDP's 1 MiB, or the bucket cap if smaller;
            unbounded with one bucket).

    Parameters are grouped into buckets in reverse registration order (roughly the order backward produces
    their gradients); a bucket closes as soon as it holds at least its cap (DDP's rule in
    ``compute_bucket_assignment_by_size``). When a bucket's last gradient has been accumulated
    (``register_post_accumulate_grad_hook``), its gradients are copied into the bucket buffer, divided by
    n, and an asynchronous ``all_reduce`` is launched; buckets are launched strictly in index order so
    every rank issues the same sequence of collectives (as DDP's reducer does). At the end of the backward
    (:func:`~labkit.parallel.data.naive.queue_after_backward`) the wrapper waits and copies the averages back
    into ``.grad`` — for any backward outside :meth:`no_sync`, whichever forward built the graph (the
    wrapper's or ``.module``'s). :meth:`finish_grad_sync` does the same if it has not happened yet (the lab's
    loop calls it). Parameters with ``requires_grad=False`` are in no bucket.

    Raises ValueError for a non-positive bucket size, or both sizes given.
    """

    def __init__(self, module: nn.Module, *, ctx=None, group=None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
                 bucket_cap_bytes: int | None = None, first_bucket_cap_bytes: int | None = None):
        super().__init__()
        cap = bucket_cap(bucket_cap_mb, bucket_cap_bytes)
        if first_bucket_cap_bytes is not None:
            first_cap = positive_int("first_bucket_cap_bytes", first_bucket_cap_bytes)
        else:
            first_cap = None if cap is None else min(DEFAULT_FIRST_BUCKET_BYTES, cap)
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(params, cap, first_cap)
        self._bucket_of = {}
        for i, b in enumerate(self.buckets):
            for p in b.params:
                self._bucket_of[p] = i
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # tokens (b, T) -> logits (b, T, V); b: this rank's (micro-)batch

    no_sync = DataParallelNaive.no_sync

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.require_sync:
            return
        if not self._pending:
            self._pending = True
            queue_after_backward(self.finish_grad_sync)
        b = self.buckets[self._bucket_of[p]]
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        with torch.no_grad():
            off = 0
            for p in b.params:
                n = p.numel()
                if p.grad is None:
                    b.buffer[off:off + n].zero_()  # [p.numel]: an unused parameter counts as zero
                else:
                    b.buffer[off:off + n].copy_(p.grad.reshape(-1))  # [p.numel] <- p.shape, flattened
                off += n
            b.buffer.div_(self.n)  # [numel]: divide before the sum, as DDP does
        work = dist.all_reduce(b.buffer, group=self.group, async_op=True)  # [numel], summed over the dp ranks
        nbytes = b.numel * b.buffer.element_size()
        b.work = work if self.ctx is None else self.ctx.track_async(work, "all_reduce", nbytes)

    def finish_grad_sync(self) -> None:
        """Launch any bucket whose gradients never all arrived (unused parameters count as zero), wait for
        every bucket, and write the averaged gradients back into ``.grad``; nothing if no backward outside
        ``no_sync`` ran since the last sync."""
        if not self._pending:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        with torch.no_grad():
            for b in self.buckets:
                b.work.wait()
                off = 0
                for p in b.params:
                    n = p.numel()
                    flat = b.buffer[off:off + n].view_as(p)  # [p.numel] -> p.shape, the average
                    if p.grad is None:
                        p.grad = flat.clone()
                    else:
                        p.grad.copy_(flat)
                    off += n
                b.ready, b.work = 0, None
        self._next = 0
        self._pending = False

    def close(self) -> None:
        """Remove the gradient hooks (the module can then be wrapped again)."""
        for h in self._handles:
            h.remove()
        self._handles = []
