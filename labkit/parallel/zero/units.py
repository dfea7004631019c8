"""A ZeRO *unit*: parameters gathered and sharded together, laid out in one flat buffer.

The unit's parameters become views of one flat buffer [padded], padded to a multiple of the group size n;
rank r owns the shard [r·k, (r+1)·k) with k = padded/n. The optimizer updates that shard [k]. What the
buffer holds between uses depends on the ZeRO stage (Rajbhandari et al. 2020):

* stage 1 (P_os): full parameters and a full flat gradient [padded]; the gradient is reduce-scattered once
  per step and each rank keeps the average of its shard;
* stage 2 (P_os+g): full parameters; each backward's gradients are reduce-scattered at once and dropped,
  only the shard's gradient [k] is kept (and accumulated);
* stage 3 (P_os+g+p): only the shard [k] is kept; the flat buffer's storage is freed, and
  :meth:`_Unit.gather` all-gathers it back before each use.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)  # the tensor keeps its shape; its storage holds 0 bytes


def _is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


class _Unit:
    """One group of parameters gathered and sharded together, with its flat buffers."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], n: int, rank: int, stage: int):
        self.name = name
        self.names = [q for q, _ in named_params]
        self.params = [p for _, p in named_params]
        p0 = self.params[0]
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // n) * n
        self.k = self.padded // n
        self.n, self.rank, self.stage = n, rank, stage
        self.group = None  # set by the wrapper
        self.flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)  # [padded] = [n·k]
        off = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[off:off + p.numel()]  # [p.numel]
                view.copy_(p.detach().reshape(-1))  # [p.numel] <- p.shape, flattened
                p.data = view.view_as(p)  # p.shape, a view of the flat buffer
                off += p.numel()
        own = self.flat[rank * self.k:(rank + 1) * self.k]  # [k] = [padded/n]: this rank's shard
        # the optimizer's parameter: a view of the flat buffer (stages 1-2, updated in place, then all-gathered)
        # or a tensor of its own (stage 3, the only copy this rank keeps)
        self.shard = nn.Parameter(own.detach().clone() if stage == 3 else own.detach())  # [k]
        self.flat_grad = torch.zeros_like(self.flat) if stage == 1 else None  # [padded] (stage 1 only)
        self.ready = 0
        self.pending = []  # (work, output [k], input [padded]) of reduce-scatters in flight
        self.launched = False
        if stage == 3:
            _free(self.flat)

    # -- gradients -----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.stage == 1:
            self.flat_grad.zero_()  # [padded]
            off = 0
            for p in self.params:
                p.grad = self.flat_grad[off:off + p.numel()].view_as(p)  # p.shape, a view of flat_grad
                off += p.numel()
            self.shard.grad = self.flat_grad[self.rank * self.k:(self.rank + 1) * self.k]  # [k], a view
        else:
            for p in self.params:
                p.grad = None
            self.shard.grad = torch.zeros_like(self.shard)  # [k]
        self.ready, self.launched = 0, False

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients packed into a new padded flat tensor (missing gradients count as zero)."""
        out = torch.zeros(self.padded, dtype=self.flat.dtype, device=self.flat.device)  # [padded]
        off = 0
        for p in self.params:
            if p.grad is not None:
                out[off:off + p.numel()].copy_(p.grad.reshape(-1))  # [p.numel] <- p.shape, flattened
            off += p.numel()
        return out

    def reduce_scatter(self, ctx, async_op: bool) -> None:
        """Reduce-scatter this unit's gradients (stage 2/3: then drop the full-size gradients).
        ``ctx``: anything with ``track_async`` (the rank's context) to put an asynchronous call on the
        timeline, or None."""
        full = self.flat_grad if self.stage == 1 else self.flat_grads()  # [padded] = [n·k]
        out = torch.empty(self.k, dtype=full.dtype, device=full.device)  # [k]
        work = reduce_scatter_tensor(out, full, group=self.group, async_op=async_op)  # [k] <- sum of [n·k]
        if async_op and ctx is not None:
            work = ctx.track_async(work, "reduce_scatter", full.numel() * full.element_size())
        self.pending.append((work, out, full))
        if self.stage >= 2:
            for p in self.params:
                p.grad = None
        self.launched = True

    def finish_reduce(self) -> None:
        """Wait for this unit's reduce-scatters and add the averaged shard into the optimizer's gradient."""
        with torch.no_grad():
            for work, out, _full in self.pending:
                if work is not None:
                    work.wait()
                out.div_(self.n)  # [k]: the sum over ranks -> the average
                if self.stage == 1:
                    self.shard.grad.copy_(out)  # [k]
                else:
                    self.shard.grad.add_(out)  # [k], accumulated over micro-batches
        self.pending = []
        self.ready, self.launched = 0, False

    # -- parameters ----------------------------------------------------------------------------------
    def gather(self) -> bool:
        """Materialise the full parameters (stage 3: all-gather into the flat buffer). True if it gathered."""
        if not _is_freed(self.flat):
            return False
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        all_gather_tensor(self.flat, self.shard.detach(), group=self.group)  # [n·k] <- [k] from each rank
        return True

    def reshard(self) -> None:
        if self.stage == 3 and not _is_freed(self.flat):
            _free(self.flat)

    def all_gather_update(self) -> None:
        """Stages 1-2: after the optimizer updated this rank's slice in place, fetch everyone's slices."""
        all_gather_tensor(self.flat, self.shard.detach().clone(), group=self.group)  # [n·k] <- [k] each
