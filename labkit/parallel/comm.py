"""The collectives the strategies call, under one name on every torch version the lab supports (2.6+).

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single``; these wrappers call whichever exists, always as ``dist.<name>`` so that a
:class:`~labkit.runtime.commlog.CommLog` sees (and counts) the call. :func:`nbytes` is the byte count both that
log and the emulator's tracer give a collective's tensor arguments.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather equal shards into one flat tensor: output [n * k] <- input [k] from each of n ranks.

    Calls ``dist.all_gather_single`` where it exists (torch >= 2.13) and ``dist.all_gather_into_tensor``
    otherwise, so the lab runs on torch 2.6+ without deprecation warnings."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce a flat tensor over ranks and keep this rank's shard: output [k] <- input [n * k].

    ``dist.reduce_scatter_single`` on torch >= 2.13, ``dist.reduce_scatter_tensor`` before."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def nbytes(x) -> int:
    """Bytes of ``x``: a tensor's ``numel * element_size``, summed over a (nested) list or tuple of tensors;
    0 for anything else (None, a scalar, a group)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(y) for y in x)
    return 0
