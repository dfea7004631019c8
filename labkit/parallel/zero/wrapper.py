"""ZeRO stages 1, 2 and 3 written from scratch: :class:`ZeroDataParallel` wraps a model whose parameters it
re-lays out into :class:`~labkit.parallel.zero.units._Unit` flat buffers, and drives their collectives.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
removes the redundancy of replicated data parallelism one model state at a time:

* stage 1 (P_os) — each rank keeps the optimizer state of 1/n of the parameters. Gradients are
  reduce-scattered (each rank receives the average of its shard), each rank updates its shard, and the
  updated shards are all-gathered back into the full parameters. Same bytes as an all-reduce.
* stage 2 (P_os+g) — also the gradients: each unit's gradients are reduce-scattered as soon as backward has
  produced them, and the full-size gradients are freed; only the 1/n shard is kept (and accumulated).
* stage 3 (P_os+g+p) — also the parameters: each rank stores 1/n of every unit; a unit is all-gathered
  just before its forward, freed after it, all-gathered again just before its backward, and freed after
  its gradients are reduce-scattered: ~1.5x the communication of DDP (Sec. 7.2.2).

A *unit* is what is gathered at once: each transformer layer (``module.layers[i]``), plus a *root* unit with
every other parameter (embeddings, final norm, output head). Like FSDP2's root module, the root unit stays
gathered from the start of forward until its gradients are reduced (its parameters are used first and last).
The optimizer (the lab's AdamW, element-wise) updates the flat shards, so its arithmetic per element is the
same as the single-process reference.

In a plain training loop (``docs/use-in-your-loop.md``): the gradient sync runs at the end of every backward
by itself; stages 1-2 all-gather the updated shards before the next forward (or at
:meth:`ZeroDataParallel.after_optimizer_step`, which the lab's loop calls); ``zero_grad`` of the wrapper or of
the optimizer, either ``set_to_none``, works at every stage.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from labkit.checks import check_choice
from labkit.parallel.data.naive import broadcast_parameters, module_device, queue_after_backward
from labkit.parallel.zero.fsdp2 import BACKEND_DEVICE, check_fsdp_devices
from labkit.parallel.zero.guards import cast_floating, check_ignored, optimizer_guard
from labkit.parallel.zero.units import _Unit


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1, 2 or 3 from scratch (module docstring). Follows the wrapper protocol of
    :mod:`labkit.runtime.training`.

    Args:
        module: the full model, identical on every rank of ``group`` (it is re-laid-out in place: its
            trainable parameters become views of per-unit flat buffers), kept as ``.module``.
        stage: 1, 2 or 3.
        ctx: keyword-only, as the rest: the RankContext (timeline events for asynchronous reduce-scatters),
            or None.
        group: the data-parallel process group (default: the world).
        unit_modules: the modules gathered one at a time (default: ``module.layers`` when present); the
            parameters outside them form the root unit.
        mp_policy: stage 3 only: ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or anything with its fields
            ``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``), applied as FSDP2 does:
            parameters all-gathered and used in ``param_dtype``, gradients reduce-scattered in
            ``reduce_dtype`` (default ``param_dtype``), the shards — the optimizer's fp32 master weights — and
            their gradients in the parameters' own dtype; floating inputs of each unit cast to
            ``param_dtype`` (``cast_forward_inputs``), the root's output to ``output_dtype`` when set; frozen
            parameters are used in ``param_dtype`` as well (kept whole; ``full_state_dict`` gives their own
            dtype).

        ignored_params: keyword-only: parameters of ``module`` kept whole and replicated on every rank,
            outside every unit (FSDP2's ``fully_shard(..., ignored_params=...)`` name): never sharded or
            gathered. Unlike FSDP2, which leaves their gradients to the caller, a trainable ignored parameter's
            gradient is averaged over the group (one all-reduce each, blocking, at the end of the gradient sync)
            so the replicas stay equal; they are not cast by ``mp_policy``.

    Parameters with ``requires_grad=False`` (decided at construction) stay whole on every rank, outside
    every unit: never in a shard, a reduction or the optimizer.

    Build the optimizer after wrapping, as with torch's FSDP: ``AdamW(model.parameters())`` works at every
    stage — :meth:`named_parameters` yields one set: this rank's flat shard of every unit (``shards.<i>``, like
    FSDP1's flat parameters), then the parameters kept whole (frozen and ignored ones, ``module.<name>``).
    :meth:`optim_parameters` is the shards alone. At stage 3 the optimizer may instead be built over
    ``model.module.parameters()`` (each a view of its part of the shard, so param groups work). An optimizer
    holding the module's sharded parameters at stages 1-2, or both forms at stage 3, raises ValueError at its
    first ``step()``.

    Gradients: the sync runs at the end of each backward (stage 1: not inside ``no_sync()``), whichever
    forward built the graph. The optimizer's gradients are the shards' ``.grad``; at stage 3 each module
    parameter's ``.grad`` is, after the sync, the **local shard** of its gradient: a 1-D view of its part of
    this rank's shard gradient (possibly empty), the parameter itself the matching 1-D view of the shard
    (FSDP1's ``use_orig_params=True`` form). Clip with :meth:`clip_grad_norm_` (global norm over the group,
    as ``FullyShardedDataParallel.clip_grad_norm_``); :meth:`full_grads` returns the full averaged gradients.

    Stage 1 supports ``no_sync()`` for accumulation; stages 2 and 3 reduce-scatter every micro-batch (their
    point is not to hold full-size gradients). Raises ValueError for a bad stage, a mixed-precision policy
    below stage 3 or parameters on the wrong device.
    """

    def __init__(self, module: nn.Module, stage: int, *, ctx=None, group=None, unit_modules=None,
                 mp_policy=None, ignored_params=None):
        super().__init__()
        check_choice("stage", stage, (1, 2, 3))
        ignored = check_ignored(module, ignored_params)
        param_dtype = getattr(mp_policy, "param_dtype", None)
        reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
        if (param_dtype or reduce_dtype) and stage != 3:
            raise ValueError(f"mp_policy={mp_policy!r} needs stage=3 (got stage={stage}): mixed precision is "
                             "implemented for the hand-written FSDP only")
        backend = dist.get_backend(group)
        check_fsdp_devices(module, BACKEND_DEVICE.get(backend, module_device(module).type), backend,
                           what=f"ZeRO-{stage}")
        self.module, self.stage, self.ctx, self.group = module, stage, ctx, group
        self.mp_policy = mp_policy
        self._input_dtype = param_dtype if getattr(mp_policy, "cast_forward_inputs", True) else None
        self._output_dtype = getattr(mp_policy, "output_dtype", None)
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        broadcast_parameters(module, group)
        if unit_modules is None:
            unit_modules = list(module.layers) if isinstance(getattr(module, "layers", None), nn.ModuleList) else []
        owner = {}
        for i, m in enumerate(unit_modules):
            for p in m.parameters():
                owner.setdefault(p, i)
        per_unit: list[list] = [[] for _ in unit_modules]
        root = []
        self._replicated = []  # (name, parameter): trainable ignored parameters, whole, gradients all-reduced
        for q, p in module.named_parameters():
            if p in ignored:
                if p.requires_grad:
                    self._replicated.append((q, p))
            elif p.requires_grad:  # a frozen parameter stays whole on every rank, outside every unit
                (per_unit[owner[p]] if p in owner else root).append((q, p))
        self.units: list[_Unit] = []  # (root first, then the layers in order)
        self.root = None
        dtypes = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        if root:
            self.root = _Unit("root", root, self.n, self.rank, stage, **dtypes)
            self.units.append(self.root)
        self._layer_units = []
        for i, params in enumerate(per_unit):
            if params:
                u = _Unit(f"unit{i}", params, self.n, self.rank, stage, **dtypes)
                self.units.append(u)
                self._layer_units.append((unit_modules[i], u))
        for u in self.units:
            u.group = group
        # mixed precision: frozen parameters are used in param_dtype too (FSDP2 casts every parameter it
        # manages); they never change, so one cast now equals FSDP2's cast at each all-gather. Their own-dtype
        # values are kept for full_state_dict.
        self._frozen_master = {}
        if param_dtype is not None:
            for q, p in module.named_parameters():
                if not p.requires_grad and p not in ignored and p.is_floating_point() and p.dtype != param_dtype:
                    self._frozen_master[q] = p.data
                    p.data = p.data.to(param_dtype)  # p.shape, in param_dtype
        # registered, so ``self.parameters()`` (and labkit.runtime.measure) see what this rank keeps: the shards
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self._unit_of = {p: u for u in self.units for p in u.params}
        self.require_sync = True
        self._pending = False
        if stage != 1:
            self.no_sync = None  # the wrapper protocol: this wrapper cannot defer gradient synchronisation
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for u in self.units for p in u.params]
        self._handles += [p.register_post_accumulate_grad_hook(self._on_replicated_grad) for _, p in self._replicated]
        self._handles.append(module.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._root_post_forward))
        if stage == 3:
            for m, u in self._layer_units:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward(u), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._post_forward(u)))
        self._checked = weakref.WeakSet()
        self._handles.append(register_optimizer_step_pre_hook(optimizer_guard(self)))
        self.zero_grad()

    # -- protocol ------------------------------------------------------------------------------------
    def optim_parameters(self) -> list[nn.Parameter]:
        """This rank's flat shard of every unit (without the parameters kept whole: :meth:`parameters` has both)."""
        return [u.shard for u in self.units]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """One set, as torch's FSDP: ``shards.<i>`` (this rank's flat shard of each unit, root first), then every
        parameter of the module kept whole (frozen or ignored), named ``module.<name>``; never the module's
        sharded parameters (views into the shards). So ``torch.optim.AdamW(model.parameters())`` holds what
        this rank updates. ``recurse`` is accepted for torch's signature (the set is the same)."""
        pre = f"{prefix}." if prefix else ""
        seen = set()
        for i, u in enumerate(self.units):
            seen.add(u.shard)
            yield f"{pre}shards.{i}", u.shard
        sharded = set(self._unit_of)
        for q, p in self.module.named_parameters(remove_duplicate=remove_duplicate):
            if p in sharded or (remove_duplicate and p in seen):
                continue
            seen.add(p)
            yield f"{pre}module.{q}", p

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # tokens (b, T) -> logits (b, T, V); b: this rank's (micro-)batch

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 1 only (``None`` on stages 2-3): forward + backward inside accumulate full gradients
        locally, without reduce-scatter."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, as ``torch.optim.Optimizer.zero_grad``: with ``set_to_none`` (the default) every
        ``.grad`` (module parameters and shards) is None afterwards and stage 1 frees its flat gradient; else
        they are zeros. The optimizer's own ``zero_grad`` (over the shards), either way, works as well."""
        for u in self.units:
            u.zero_grad(set_to_none)
        for _, p in self._replicated:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def finish_grad_sync(self) -> None:
        """Finish the gradient sync of the last backward if it has not finished yet (it runs by itself at the
        end of backward): stage 1 reduce-scatters every unit (blocking); stages 2-3 launch any unit whose
        gradients never all arrived and wait for the reduce-scatters their hooks started."""
        if not self._pending:
            return
        if self.stage == 1:
            for u in self.units:
                u.reduce_scatter(self.ctx, async_op=False)
        else:
            for u in self.units:
                if not u.launched:
                    self._launch(u)
        for u in self.units:
            u.finish_reduce()
        for _, p in self._replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)  # p.shape: the sum over the group ...
                p.grad.div_(self.n)  # ... -> the average, equal on every rank
        self._pending = False

    def after_optimizer_step(self) -> None:
        """Stages 1-2: all-gather the updated shards into the full parameters (done before the next forward
        if not called). Stage 3: nothing."""
        if self.stage < 3:
            for u in self.units:
                u.all_gather_update()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (CPU; stage 3: the fp32 master shards gathered one unit at a time); collective."""
        if self.stage < 3 and any(u.stale() for u in self.units):
            self.after_optimizer_step()
        out = {}
        with torch.no_grad():
            for u in self.units:
                full = u.full_tensors() if self.stage == 3 else u.views
                for q, t in zip(u.names, full):
                    out[q] = t.detach().cpu().clone()  # p.shape: the full parameter
        out.update({q: t.detach().cpu().clone() for q, t in self._frozen_master.items()})
        sd = self.module.state_dict()  # references only: freed storages are not read
        return {k: out[k] if k in out else v.detach().cpu().clone() for k, v in sd.items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The optimizer's gradients as full averaged tensors (CPU, the shards' dtype, zeros where none),
        keyed like ``module.named_parameters()`` (trainable ones); collective on the group."""
        out = {}
        with torch.no_grad():
            for u in self.units:
                for q, t in zip(u.names, u.full_tensors(grads=True)):
                    out[q] = t.cpu().clone()  # p.shape
            for q, p in self._replicated:
                out[q] = (torch.zeros_like(p) if p.grad is None else p.grad).detach().cpu().clone()  # p.shape
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients to a global norm ``max_norm`` over every trainable parameter, as
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (coefficient max_norm / (norm + 1e-6),
        clamped at 1); the norm is summed over the group (one all-reduce), so every rank gets the same one.
        Returns the total norm (before clipping). Collective. Raises ValueError for a non-positive norm_type."""
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type={norm_type!r} must be > 0 (or inf)")
        grads = [u.shard.grad.detach() for u in self.units if u.shard.grad is not None]  # [k] each
        whole = [p.grad.detach() for _, p in self._replicated if p.grad is not None]  # p.shape, equal on all ranks
        dev = self.units[0].shard.device if self.units else torch.device("cpu")
        if math.isinf(norm_type):
            local = torch.zeros((), device=dev)  # scalar
            if grads or whole:
                local = torch.stack([g.abs().max() for g in grads + whole]).max()  # scalar: the largest |g| here
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)  # scalar
            total = local
        else:
            local = torch.zeros((), dtype=torch.float32, device=dev)  # scalar
            for g in grads:
                local = local + (g.float().abs() ** norm_type).sum()
            for g in whole:  # replicated: each rank adds 1/n of it, so the sum over ranks counts it once
                local = local + (g.float().abs() ** norm_type).sum() / self.n
            dist.all_reduce(local, group=self.group)  # scalar: sum over ranks of |g|^p
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads + whole:
            g.mul_(coef.to(g.dtype))  # [k] or p.shape
        return total

    def close(self) -> None:
        """Remove every hook (gradient, forward, the optimizer check)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ---------------------------------------------------------------------------------------
    def _check_optimizer(self, optimizer) -> None:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        mine = [q for u in self.units for q, p in zip(u.names, u.params) if id(p) in held]
        shards = any(id(u.shard) in held for u in self.units)
        if mine and (self.stage < 3 or shards):
            what = ("both the flat shards and the module's parameters (views into them)" if shards
                    else f"the module's parameter {mine[0]!r}, which this wrapper shards")
            fix = ("model.parameters() or model.module.parameters(), not both" if shards and self.stage == 3
                   else "model.parameters() (this rank's flat shards and what stays whole)")
            raise ValueError(f"ZeroDataParallel(stage={self.stage}): the optimizer holds {what}; build it over "
                             f"{fix}")

    def _on_replicated_grad(self, _p: torch.Tensor) -> None:
        if self.stage == 1 and not self.require_sync:
            return
        if not self._pending:
            self._pending = True
            queue_after_backward(self.finish_grad_sync)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.stage == 1 and not self.require_sync:
            return
        if not self._pending:
            self._pending = True
            queue_after_backward(self.finish_grad_sync)
        if self.stage >= 2:
            u = self._unit_of[p]
            u.ready += 1
            if u.ready == len(u.params):
                self._launch(u)

    def _launch(self, u: _Unit) -> None:
        u.reduce_scatter(self.ctx, async_op=True)
        u.reshard()  # stage 3: the unit's backward is done, drop the gathered parameters

    def _root_pre_forward(self, _module, args, kwargs):
        if self.stage < 3:
            if any(u.stale() for u in self.units):
                self.after_optimizer_step()  # the optimizer stepped: all-gather before using the parameters
            if self.stage == 1 and torch.is_grad_enabled():
                for u in self.units:
                    u.prepare_grads(new_window=True)
        elif self.root is not None:
            self.root.gather()  # root flat [n·k] <- [k] from each rank; kept until its backward is done
        if self._input_dtype is not None:
            return cast_floating(args, self._input_dtype), cast_floating(kwargs, self._input_dtype)
        return None

    def _root_post_forward(self, _module, _args, output):
        if self.stage == 3 and not torch.is_grad_enabled():  # no backward will come: back to the shards
            for u in self.units:
                u.reshard()
                u.use_sharded_views()
        if self._output_dtype is not None:
            return cast_floating(output, self._output_dtype)
        return None

    def _pre_forward(self, u: _Unit):
        def hook(_module, args, kwargs):
            u.gather()  # flat [n·k] <- [k] from each rank, before this unit's forward
            if self._input_dtype is not None:
                return cast_floating(args, self._input_dtype), cast_floating(kwargs, self._input_dtype)
            return None

        return hook

    def _post_forward(self, u: _Unit):
        def hook(_module, _args, output):
            if torch.is_grad_enabled():
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:  # the unit's output, e.g. (b, T, H)
                        t.register_hook(lambda grad: (u.gather(), None)[1])  # gather before this unit's backward
                        break
                u.reshard()  # flat: storage freed, only the shard [k] stays
            else:
                u.reshard()
                u.use_sharded_views()

        return hook
