"""A ZeRO *unit*: parameters gathered and sharded together, laid out in one flat buffer.

The unit's parameters become views of one flat buffer [padded], padded to a multiple of the group size n;
rank r owns the shard [r·k, (r+1)·k) with k = padded/n. The optimizer updates that shard [k] (or, at stage 3,
the module's parameters, which are then views into it). What the buffer holds between uses depends on the
ZeRO stage (Rajbhandari et al. 2020):

* stage 1 (P_os): full parameters and a full flat gradient [padded] (the module's ``.grad`` are views of it);
  the gradient is reduce-scattered once per step and each rank keeps the average of its shard;
* stage 2 (P_os+g): full parameters; each backward's gradients are reduce-scattered at once and dropped,
  only the shard's gradient [k] is kept (and accumulated);
* stage 3 (P_os+g+p): only the shard [k] is kept; the flat buffer's storage is freed, and
  :meth:`_Unit.gather` all-gathers it back before each use. Between uses every module parameter is a 1-D view
  of its part of this rank's shard, and its ``.grad`` the same part of the shard's gradient (possibly empty):
  FSDP1's ``use_orig_params=True`` form. With mixed precision (FSDP2's ``MixedPrecisionPolicy``) the shard
  stays in the parameters' own dtype (the fp32 master weights), the flat buffer the forward and backward use is
  in ``param_dtype``, and gradients are reduce-scattered in ``reduce_dtype``.

Only parameters with ``requires_grad=True`` enter a unit: a frozen parameter is never in a shard, a
reduction or the optimizer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)  # the tensor keeps its shape; its storage holds 0 bytes


def _is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())  # contents undefined until written


def divide_factors(n: int, dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divisors of a gradient sum over n ranks: fp16 divides by about sqrt(n) before and after the
    sum against overflow, other dtypes only after (FSDP2's ``_get_gradient_divide_factors``)."""
    if dtype != torch.float16:
        return 1.0, float(n)
    pre = 1
    while n % pre == 0 and n / pre > pre:
        pre *= 2
    return float(pre), n / pre


class _Unit:
    """One group of parameters gathered and sharded together, with its flat buffers.

    ``param_dtype`` / ``reduce_dtype`` (stage 3 only): the dtype of the gathered parameters and of the
    gradient reduction (default: the parameters' own dtype; ``reduce_dtype`` defaults to ``param_dtype``)."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], n: int, rank: int, stage: int,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        self.name = name
        self.names = [q for q, _ in named_params]
        self.params = [p for _, p in named_params]
        p0 = self.params[0]
        self.dtype = p0.dtype  # the shard's (master weights') dtype
        self.param_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // n) * n
        self.k = self.padded // n
        self.n, self.rank, self.stage = n, rank, stage
        self.group = None  # set by the wrapper
        self.offsets = []
        master = torch.zeros(self.padded, dtype=self.dtype, device=p0.device)  # [padded] = [n·k]
        off = 0
        with torch.no_grad():
            for p in self.params:
                master[off:off + p.numel()].copy_(p.detach().reshape(-1))  # [p.numel] <- p.shape, flattened
                self.offsets.append(off)
                off += p.numel()
        lo, hi = rank * self.k, (rank + 1) * self.k
        if stage == 3:
            self.flat = torch.empty(self.padded, dtype=self.param_dtype, device=p0.device)  # [padded]
            self.shard = nn.Parameter(master[lo:hi].clone())  # [k]: the only copy this rank keeps
        else:
            self.flat = master  # [padded]: full parameters; the shard is a view, updated in place
            self.shard = nn.Parameter(master[lo:hi].detach())  # [k]
        # full-shape views of the flat buffer, and each parameter's part [a, b) of this rank's shard
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self.pieces = [(min(max(o, lo), hi) - lo, min(max(o + p.numel(), lo), hi) - lo)
                       for o, p in zip(self.offsets, self.params)]
        for p, v in zip(self.params, self.views):
            p.data = v  # p.shape, a view of the flat buffer
        self.flat_grad = torch.zeros_like(self.flat) if stage == 1 else None  # [padded] (stage 1 only)
        self.consumed = False  # stage 1: the flat gradient was reduced; the next forward starts afresh
        self.carry = None  # stage 1: the shard gradient kept over a new accumulation window
        self.synced_version = self.shard._version  # stages 1-2: the shard as last all-gathered
        self.ready = 0
        self.pending = []  # (work, output [k], input [padded]) of reduce-scatters in flight
        self.launched = False
        self.sharded_views = False
        if stage == 3:
            _free(self.flat)
            self.use_sharded_views()

    # -- the module parameters' form (stage 3) ---------------------------------------------------------
    def use_sharded_views(self) -> None:
        """Stage 3, between uses: each parameter a 1-D view of its part of the shard [b - a], its ``.grad``
        the same part of the shard's gradient (None while the shard has none)."""
        g = self.shard.grad
        for p, (a, b) in zip(self.params, self.pieces):
            p.grad = None
            p.data = self.shard.data[a:b]  # [b - a]: this rank's part of p, flattened (may be empty)
            p.grad = None if g is None else g[a:b]  # [b - a]
        self.sharded_views = True

    def _take_grads_from_views(self) -> None:
        """Stage 3: what was done to the module parameters' ``.grad`` between uses reaches the shard's gradient
        (an optimizer over the module's parameters zeroes those): a ``.grad`` set to None zeroes its part (all of
        them None: the shard's gradient is None), a new tensor is copied in. Views of a shard gradient that was
        itself reset (the optimizer over the shards) are stale and ignored."""
        g = self.shard.grad
        if g is None:
            return
        cleared = 0
        with torch.no_grad():
            for p, (a, b) in zip(self.params, self.pieces):
                if p.grad is None:
                    g[a:b].zero_()  # [b - a]
                    cleared += 1
                elif p.grad.data_ptr() != g[a:b].data_ptr() or p.grad.shape != (b - a,):
                    g[a:b].copy_(p.grad.reshape(-1))  # [b - a] <- a gradient assigned by the user
        if cleared == len(self.params):
            self.shard.grad = None

    def use_unsharded_views(self) -> None:
        """Stage 3, before a use: each parameter a full-shape view of the flat buffer, no ``.grad`` (the
        gradient so far is kept on the shard)."""
        if self.sharded_views:
            self._take_grads_from_views()
        for p, v in zip(self.params, self.views):
            p.grad = None
            p.data = v  # p.shape
        self.sharded_views = False

    # -- gradients -----------------------------------------------------------------------------------
    def own_grad_view(self) -> torch.Tensor:
        return self.flat_grad[self.rank * self.k:(self.rank + 1) * self.k]  # [k], a view of flat_grad

    def _is_grad_view(self, p, i) -> bool:
        g = p.grad
        return (g is not None and not _is_freed(self.flat_grad) and g.shape == p.shape
                and g.data_ptr() == self.flat_grad.data_ptr() + self.offsets[i] * g.element_size())

    def prepare_grads(self, new_window: bool) -> None:
        """Stage 1: make every ``.grad`` a view of the flat gradient. ``new_window`` (before a forward): if the
        buffer was reduced since, start from zero — carrying the shard's gradient over unless the optimizer or
        zero_grad reset it, as torch accumulates ``.grad`` until it is zeroed. A gradient that is not a view
        (made after ``.grad`` was set to None) is copied in."""
        fresh = _is_freed(self.flat_grad)
        if fresh:
            _alloc(self.flat_grad)  # [padded]
        with torch.no_grad():
            reset = fresh or (new_window and self.consumed)
            if new_window and self.consumed:
                g = self.shard.grad
                self.carry = None if g is None else g.detach().clone()  # [k]
                self.consumed = False
            foreign = {i: p.grad for i, p in enumerate(self.params)
                       if p.grad is not None and not self._is_grad_view(p, i)}
            if reset:
                self.flat_grad.zero_()  # [padded]
            for i, p in enumerate(self.params):
                if i in foreign:
                    self.views_grad(i).copy_(foreign[i])  # p.shape <- a gradient made outside the buffer
                elif p.grad is None and not reset:
                    self.views_grad(i).zero_()  # p.shape: no gradient yet
                if i in foreign or p.grad is None:
                    p.grad = self.views_grad(i)  # p.shape, a view of flat_grad

    def views_grad(self, i: int) -> torch.Tensor:
        o, p = self.offsets[i], self.params[i]
        return self.flat_grad[o:o + p.numel()].view_as(p)  # [p.numel] -> p.shape

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the unit's gradients: ``set_to_none`` (torch's default) leaves every ``.grad`` None (stage 1
        also frees the flat gradient); else zeros in place (stage 1: the module's ``.grad`` are views of the
        zeroed flat gradient, the shard's a view of its own part)."""
        self.carry, self.consumed = None, False
        if self.stage == 1:
            if set_to_none:
                for p in self.params:
                    p.grad = None
                self.shard.grad = None
                _free(self.flat_grad)
            else:
                if _is_freed(self.flat_grad):
                    _alloc(self.flat_grad)
                self.flat_grad.zero_()  # [padded]
                for i, p in enumerate(self.params):
                    p.grad = self.views_grad(i)  # p.shape, a view of flat_grad
                self.shard.grad = self.own_grad_view()  # [k], a view
        else:
            if not self.sharded_views:
                for p in self.params:
                    p.grad = None
            if set_to_none:
                self.shard.grad = None
            elif self.shard.grad is None:
                self.shard.grad = torch.zeros_like(self.shard)  # [k]
            else:
                self.shard.grad.detach().zero_()  # [k]
            if self.sharded_views:
                self.use_sharded_views()
        self.ready, self.launched = 0, False

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients packed into a new padded flat tensor in ``reduce_dtype`` (missing gradients
        count as zero)."""
        out = torch.zeros(self.padded, dtype=self.reduce_dtype, device=self.shard.device)  # [padded]
        for o, p in zip(self.offsets, self.params):
            if p.grad is not None:
                out[o:o + p.numel()].copy_(p.grad.reshape(-1))  # [p.numel] <- p.shape, flattened (and cast)
        return out

    def reduce_scatter(self, ctx, async_op: bool) -> None:
        """Reduce-scatter this unit's gradients (stage 2/3: then drop the full-size gradients).
        ``ctx``: anything with ``track_async`` (the rank's context) to put an asynchronous call on the
        timeline, or None."""
        if self.stage == 1:
            self.prepare_grads(new_window=False)
        full = self.flat_grad if self.stage == 1 else self.flat_grads()  # [padded] = [n·k]
        pre, _post = divide_factors(self.n, full.dtype)
        if pre != 1:
            full.div_(pre)  # [padded]: fp16 divides part of n before the sum
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
        """Wait for this unit's reduce-scatters and add the averaged shard into the optimizer's gradient
        (stage 1: write it, plus the carried gradient; stages 2-3: accumulate over micro-batches). Stage 3
        then exposes the gradient on the module's parameters (:meth:`use_sharded_views`)."""
        with torch.no_grad():
            for work, out, _full in self.pending:
                if work is not None:
                    work.wait()
                out.div_(divide_factors(self.n, out.dtype)[1])  # [k]: the sum over ranks -> the average
                if self.stage == 1:
                    own = self.own_grad_view()  # [k]
                    if self.shard.grad is None or self.shard.grad.data_ptr() != own.data_ptr():
                        self.shard.grad = own
                    own.copy_(out)  # [k]
                    if self.carry is not None:
                        own.add_(self.carry)  # [k]: the shard gradient from before this window
                        self.carry = None
                    self.consumed = True
                elif self.shard.grad is None:
                    self.shard.grad = out.to(self.dtype)  # [k]
                else:
                    self.shard.grad.add_(out.to(self.dtype))  # [k], accumulated over micro-batches
        self.pending = []
        self.ready, self.launched = 0, False
        if self.stage == 3:
            self.reshard()
            self.use_sharded_views()

    # -- parameters ----------------------------------------------------------------------------------
    def gather(self) -> bool:
        """Materialise the full parameters (stage 3: all-gather into the flat buffer, in ``param_dtype``).
        True if it gathered."""
        if self.sharded_views:
            self.use_unsharded_views()
        if not _is_freed(self.flat):
            return False
        _alloc(self.flat)  # [padded]
        all_gather_tensor(self.flat, self.shard.detach().to(self.param_dtype), group=self.group)  # [n·k] <- [k]
        return True

    def reshard(self) -> None:
        if self.stage == 3 and not _is_freed(self.flat):
            _free(self.flat)

    def stale(self) -> bool:
        """Stages 1-2: True if the shard changed (an optimizer step) since the last all-gather."""
        return self.shard._version != self.synced_version

    def all_gather_update(self) -> None:
        """Stages 1-2: after the optimizer updated this rank's slice in place, fetch everyone's slices."""
        all_gather_tensor(self.flat, self.shard.detach().clone(), group=self.group)  # [n·k] <- [k] each
        self.synced_version = self.shard._version

    def full_tensors(self, grads: bool = False) -> list[torch.Tensor]:
        """The unit's full parameters (or averaged gradients, zeros where none) in the shard's dtype, gathered
        from every rank's shard into a new buffer (collective on the group): p.shape each."""
        src = self.shard.detach() if not grads else (
            torch.zeros_like(self.shard) if self.shard.grad is None else self.shard.grad.detach())  # [k]
        buf = torch.empty(self.padded, dtype=src.dtype, device=src.device)  # [padded]
        all_gather_tensor(buf, src.contiguous(), group=self.group)  # [n·k] <- [k] from each rank
        return [buf[o:o + v.numel()].view(v.shape) for o, v in zip(self.offsets, self.views)]  # p.shape each
