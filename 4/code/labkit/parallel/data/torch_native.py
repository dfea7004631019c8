"""torch's data parallelism: ``torch.nn.parallel.DistributedDataParallel`` (the C++ reducer doing what
:class:`~labkit.parallel.data.DataParallelBucket` does by hand), with an optional comm hook that logs each
bucket's all-reduce.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
import torch.nn as nn

from labkit.parallel.data.bucketed import DEFAULT_BUCKET_CAP_MB, bucket_cap
from labkit.parallel.data.naive import module_device


class _HookState:
    def __init__(self, ctx, group):
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)


def logged_allreduce_hook(state: _HookState, bucket):  # no return annotation: DDP checks it literally
    """DDP comm hook equivalent to DDP's default (divide by n, then all-reduce the bucket), issued as
    ``dist.all_reduce`` so a :class:`~labkit.runtime.commlog.CommLog` counts it, and recorded on the timeline from
    issue to completion (``register_comm_hook``, torch.distributed.algorithms.ddp_comm_hooks)."""
    buf = bucket.buffer()  # [bucket numel]: DDP's flat gradient bucket
    buf.div_(state.n)  # [bucket numel]
    work = dist.all_reduce(buf, group=state.group, async_op=True)  # [bucket numel], summed over the dp ranks
    if state.ctx is not None:
        state.ctx.track_async(work, "all_reduce", buf.numel() * buf.element_size())
    return work.get_future().then(lambda fut: fut.value()[0])


def torch_ddp(module: nn.Module, *, ctx=None, group=None, bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
              bucket_cap_bytes: int | None = None, log_comm: bool = True) -> nn.Module:
    """``DistributedDataParallel`` around ``module`` (on its device; CPU under gloo), options keyword-only.

    ``bucket_cap_mb`` (MiB, float; default 25 as DDP) or ``bucket_cap_bytes`` (int) sets DDP's bucket size;
    ``bucket_cap_mb=None`` asks for one bucket (DDP has no such value — its None means 25 MiB — so the cap
    passed is the model's gradient bytes, and an explicit cap makes DDP's first bucket the same size). With
    ``log_comm`` a comm hook (:func:`logged_allreduce_hook`) makes its all-reduces visible to CommLog and the
    timeline; without it DDP's own C++ hook runs (use that for speed comparisons).

    Unlike the lab's wrappers, DDP prepares its reducer in *its* forward: a forward through ``ddp.module``
    followed by backward synchronises nothing (torch's behaviour, kept). Raises ValueError for a non-positive
    bucket size or both sizes given."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cap = bucket_cap(bucket_cap_mb, bucket_cap_bytes)
    if cap is None:
        cap = max(1, sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad))
    device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
    # buffers (RoPE tables) are identical on every rank: sync them once at construction, not every forward
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    ddp = DDP(module, device_ids=device_ids, process_group=group, bucket_cap_mb=cap / 2**20, **no_buffer_sync)
    if log_comm:
        ddp.register_comm_hook(_HookState(ctx, group), logged_allreduce_hook)
    return ddp
