"""Naive data parallelism: after the whole backward, one blocking ``all_reduce`` per gradient tensor.

Simple; every byte of communication is exposed (nothing computes while it runs). Also the helpers every
data-parallel wrapper starts with: :func:`broadcast_parameters`, :func:`module_device` and
:func:`queue_after_backward` (how a wrapper runs its gradient sync at the end of *any* backward, as DDP's
reducer does, so the loop needs no extra call and the sync does not depend on which forward built the graph).
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


def queue_after_backward(fn) -> None:
    """Run ``fn()`` once the running backward pass has finished (every gradient accumulated), from inside a
    gradient hook: ``torch.autograd.Variable._execution_engine.queue_callback``, the call DDP's reducer
    (``finalize_backward``) and FSDP2 (``_root_post_backward_final_callback``) use for the same purpose."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class DataParallelNaive(nn.Module):
    """All-reduce every gradient, one blocking call per parameter, after backward.

    ``module``: the full model (same weights on every rank; broadcast from the group's first rank at
    construction), kept as ``.module``. Keyword-only: ``ctx`` (the rank's context, or None), ``group`` (the
    data-parallel process group; default: the world).

    The sync runs by itself at the end of every backward that is not inside :meth:`no_sync` (gradient hooks
    queue it with :func:`queue_after_backward`), whichever forward built the graph — ``wrapper(x)`` or
    ``wrapper.module(x)`` — so a plain loop (forward, backward, ``optimizer.step()``) needs no extra call.
    :meth:`finish_grad_sync` is kept for the lab's loop (:func:`labkit.runtime.training.train_steps`) and for
    gradients that no hook saw (it is a no-op when the backward already synchronised). Parameters with
    ``requires_grad=False`` are never reduced.
    """

    def __init__(self, module: nn.Module, *, ctx=None, group=None):
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # tokens (b, T) -> logits (b, T, V); b: this rank's (micro-)batch

    @contextlib.contextmanager
    def no_sync(self):
        """A backward run inside this block accumulates gradients locally, without communication (put the
        forward and the backward of the accumulation micro-batches inside, as with DDP)."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def _on_grad(self, _p: torch.Tensor) -> None:
        if self.require_sync and not self._pending:
            self._pending = True
            queue_after_backward(self.finish_grad_sync)

    def finish_grad_sync(self) -> None:
        """Average gradients over the group (blocking all-reduce per tensor), if a backward outside
        ``no_sync`` produced gradients since the last sync; else nothing."""
        if not self._pending:
            return
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # p.shape: an unused parameter counts as zero
            dist.all_reduce(p.grad, group=self.group)  # p.shape, summed over the dp ranks
            p.grad.div_(self.n)  # p.shape, the average
        self._pending = False

    def close(self) -> None:
        """Remove the gradient hooks (the module can then be wrapped again)."""
        for h in self._handles:
            h.remove()
        self._handles = []
