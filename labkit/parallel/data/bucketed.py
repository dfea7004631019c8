"""Bucketed, overlapped data parallelism: gradients are packed into buckets (reverse parameter order,
which is roughly the order backward produces them); a bucket's ``all_reduce`` is launched asynchronously
from a gradient hook the moment its last gradient is ready, so communication overlaps the rest of backward
(Li et al. 2020, "PyTorch Distributed", Sec. 3.2 and 4.2: bucketing and overlap).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import positive_int
from labkit.parallel.data.naive import DataParallelNaive, broadcast_parameters

#: DDP's default bucket size (``bucket_cap_mb=25``), in bytes
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
#: DDP's cap for the first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): a small first bucket
#: lets the first all-reduce start as soon as the output layer's gradients exist
DEFAULT_FIRST_BUCKET_BYTES = 2**20


class _Bucket:
    """Parameters whose gradients are all-reduced together, through one flat buffer [numel]."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        p0 = params[0]
        self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)  # [numel]
        self.ready = 0
        self.work = None


def assign_buckets(params: list[nn.Parameter], bucket_cap_bytes: int, first_cap_bytes: int) -> list[_Bucket]:
    """Buckets in reverse parameter order; a bucket closes once it holds at least its cap (DDP's rule in
    ``compute_bucket_assignment_by_size``), the first one at ``first_cap_bytes``."""
    buckets: list[_Bucket] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= (bucket_cap_bytes if buckets else first_cap_bytes):
            buckets.append(_Bucket(cur))
            cur, size = [], 0
    if cur:
        buckets.append(_Bucket(cur))
    return buckets


class DataParallelBucket(nn.Module):
    """Bucketed, overlapped gradient all-reduce launched from gradient hooks.

    Parameters are grouped into buckets in reverse registration order (roughly the order backward produces
    their gradients); a bucket closes as soon as it holds at least ``bucket_cap_bytes`` (DDP's rule in
    ``compute_bucket_assignment_by_size``), the first one at ``first_bucket_cap_bytes`` (default: DDP's
    1 MiB, or ``bucket_cap_bytes`` if smaller). When a bucket's last gradient has been accumulated
    (``register_post_accumulate_grad_hook``), its gradients are copied into the bucket buffer, divided by
    n, and an asynchronous ``all_reduce`` is launched; buckets are launched strictly in index order so
    every rank issues the same sequence of collectives (as DDP's reducer does). :meth:`finish_grad_sync`
    waits and copies the averages back. Communication of early buckets overlaps the remaining backward.

    Raises ValueError for a non-positive bucket_cap_bytes.
    """

    def __init__(self, module: nn.Module, ctx=None, group=None, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_cap_bytes: int | None = None):
        super().__init__()
        positive_int("bucket_cap_bytes", bucket_cap_bytes)
        first_cap = min(DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes) if first_bucket_cap_bytes is None else \
            positive_int("first_bucket_cap_bytes", first_bucket_cap_bytes)
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(params, bucket_cap_bytes, first_cap)
        self._bucket_of = {}
        for i, b in enumerate(self.buckets):
            for p in b.params:
                self._bucket_of[p] = i
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def forward(self, *args, **kwargs):
        self._pending = self.require_sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)  # tokens (b, T) -> logits (b, T, V); b: this rank's (micro-)batch

    no_sync = DataParallelNaive.no_sync

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._pending:
            return
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
        every bucket, and write the averaged gradients back into ``.grad``."""
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
