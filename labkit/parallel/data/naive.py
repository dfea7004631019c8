"""Naive data parallelism: after the whole backward, one blocking ``all_reduce`` per gradient tensor.

Simple; every byte of communication is exposed (nothing computes while it runs). Also the two helpers
every data-parallel wrapper starts with: :func:`broadcast_parameters` and :func:`module_device`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Copy the group's first rank's parameters and buffers to every rank (as DDP does at construction),
    so replicas start identical even if the caller seeded differently."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)  # t: its own shape, same on every rank


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (CPU for a module without parameters)."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class DataParallelNaive(nn.Module):
    """All-reduce every gradient, one blocking call per parameter, after backward.

    ``module``: the full model (same weights on every rank; broadcast from the group's first rank at
    construction). ``group``: the data-parallel process group (default: the world). Call
    :meth:`finish_grad_sync` after each backward (:func:`labkit.runtime.training.train_steps` does); it
    averages gradients unless that backward's forward ran inside :meth:`no_sync`.
    """

    def __init__(self, module: nn.Module, ctx=None, group=None):
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)

    def forward(self, *args, **kwargs):
        self._pending = self.require_sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)  # tokens (b, T) -> logits (b, T, V); b: this rank's (micro-)batch

    @contextlib.contextmanager
    def no_sync(self):
        """Forward + backward inside this block accumulate gradients locally, without communication."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def finish_grad_sync(self) -> None:
        """Average gradients over the group (blocking all-reduce per tensor), if the last forward asked."""
        if not self._pending:
            return
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # p.shape: an unused parameter counts as zero
                dist.all_reduce(p.grad, group=self.group)  # p.shape, summed over the dp ranks
                p.grad.div_(self.n)  # p.shape, the average
        self._pending = False
