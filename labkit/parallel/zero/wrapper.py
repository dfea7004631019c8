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
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_choice
from labkit.parallel.data.naive import broadcast_parameters, module_device
from labkit.parallel.zero.fsdp2 import BACKEND_DEVICE, check_fsdp_devices
from labkit.parallel.zero.units import _Unit


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1, 2 or 3 from scratch (module docstring). Follows the wrapper protocol of
    :mod:`labkit.runtime.training`.

    Args:
        module: the full model, identical on every rank of ``group`` (it is re-laid-out in place: its
            parameters become views of per-unit flat buffers).
        stage: 1, 2 or 3.
        ctx: the RankContext (timeline events for asynchronous reduce-scatters), or None.
        group: the data-parallel process group (default: the world).
        unit_modules: the modules gathered one at a time (default: ``module.layers`` when present); the
            parameters outside them form the root unit.

    Build the optimizer over :meth:`optim_parameters` (the shards), after wrapping. Stage 1 supports
    ``no_sync()`` for accumulation; stages 2 and 3 reduce-scatter every micro-batch (their point is not to
    hold full-size gradients). Raises ValueError for a bad stage or parameters on the wrong device.
    """

    def __init__(self, module: nn.Module, stage: int, ctx=None, group=None, unit_modules=None):
        super().__init__()
        check_choice("stage", stage, (1, 2, 3))
        backend = dist.get_backend(group)
        check_fsdp_devices(module, BACKEND_DEVICE.get(backend, module_device(module).type), backend,
                           what=f"ZeRO-{stage}")
        self.module, self.stage, self.ctx, self.group = module, stage, ctx, group
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
        for q, p in module.named_parameters():
            (per_unit[owner[p]] if p in owner else root).append((q, p))
        self.units: list[_Unit] = []  # (root first, then the layers in order)
        self.root = None
        if root:
            self.root = _Unit("root", root, self.n, self.rank, stage)
            self.units.append(self.root)
        self._layer_units = []
        for i, params in enumerate(per_unit):
            if params:
                u = _Unit(f"unit{i}", params, self.n, self.rank, stage)
                self.units.append(u)
                self._layer_units.append((unit_modules[i], u))
        for u in self.units:
            u.group = group
        # registered, so ``self.parameters()`` (and labkit.runtime.measure) see what this rank keeps: the shards
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self._unit_of = {p: u for u in self.units for p in u.params}
        self.require_sync = True
        self._pending = False
        if stage != 1:
            self.no_sync = None  # the wrapper protocol: this wrapper cannot defer gradient synchronisation
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for u in self.units for p in u.params if stage >= 2]
        if stage == 3:
            for m, u in self._layer_units:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward(u)))
                self._handles.append(m.register_forward_hook(self._post_forward(u)))
        self.zero_grad()

    # -- protocol ------------------------------------------------------------------------------------
    def optim_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer must own: this rank's flat shard of every unit."""
        return [u.shard for u in self.units]

    def forward(self, *args, **kwargs):
        self._pending = self.require_sync and torch.is_grad_enabled()
        if self.stage == 3 and self.root is not None:
            self.root.gather()  # root flat [n·k] <- [k] from each rank; kept until its backward is done
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
        """Reset gradients (stage 1: zero the flat gradient buffers the ``.grad`` views live in)."""
        for u in self.units:
            u.zero_grad()

    def finish_grad_sync(self) -> None:
        """After a backward: stage 1 reduce-scatters every unit (blocking); stages 2-3 launch any unit whose
        gradients never all arrived and wait for the reduce-scatters their hooks started."""
        if self.stage == 1:
            if not self._pending:
                return
            for u in self.units:
                u.reduce_scatter(self.ctx, async_op=False)
        else:
            for u in self.units:
                if not u.launched:
                    self._launch(u)
        for u in self.units:
            u.finish_reduce()
        self._pending = False

    def after_optimizer_step(self) -> None:
        """Stages 1-2: all-gather the updated shards into the full parameters. Stage 3: nothing."""
        if self.stage < 3:
            for u in self.units:
                u.all_gather_update()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (CPU), gathering stage-3 units one at a time; collective on the group."""
        out = {}
        with torch.no_grad():
            for u in self.units:
                gathered = u.gather()
                for q, p in zip(u.names, u.params):
                    out[q] = p.detach().cpu().clone()  # p.shape: the full parameter
                if gathered:
                    u.reshard()
        sd = self.module.state_dict()  # references only: freed storages are not read
        return {k: out[k] if k in out else v.detach().cpu().clone() for k, v in sd.items()}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ---------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        u = self._unit_of[p]
        u.ready += 1
        if u.ready == len(u.params):
            self._launch(u)

    def _launch(self, u: _Unit) -> None:
        u.reduce_scatter(self.ctx, async_op=True)
        u.reshard()  # stage 3: the unit's backward is done, drop the gathered parameters

    def _pre_forward(self, u: _Unit):
        def hook(_module, _args):
            u.gather()  # flat [n·k] <- [k] from each rank, before this unit's forward

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

        return hook
