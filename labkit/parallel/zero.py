"""Sharded data parallelism: ZeRO stages 1, 2 and 3 written from scratch, and torch's FSDP2 beside them.

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
Each unit's parameters live in one flat buffer padded to a multiple of n; rank r owns elements
[r·k, (r+1)·k) with k = padded/n. The optimizer (the lab's AdamW, element-wise) updates the flat shards,
so its arithmetic per element is the same as the single-process reference.

:func:`fsdp2` applies ``torch.distributed.fsdp.fully_shard`` bottom-up (each layer, then the root) on a
DeviceMesh and builds the optimizer after sharding, after checking that the parameters are on the device
the process group's backend serves (:func:`check_fsdp_devices`).

Model-state bytes per rank are predicted by the lab's calculator (``labkit.theory.memory``, convention
"torch-fp32": fp32 parameters and gradients, AdamW's two fp32 moments and a float32 step counter per
optimizer tensor) and measured by ``labkit.runtime.measure`` (:func:`predicted_table`, :func:`memory_rank`).
Communication per step: :func:`predicted_comm_bytes`.
"""

from __future__ import annotations

import contextlib
import functools

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import check_choice, positive_int
from labkit.experiments.common import _runs, optimizer_step_bytes, run_experiments
from labkit.models import make_optimizer
from labkit.parallel import data as dp_data
from labkit.runtime.commlog import all_gather_tensor, reduce_scatter_tensor
from labkit.runtime.training import track_async, train_steps

STAGES = (0, 1, 2, 3)
VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
#: the backend each device type needs (the process group's collectives run on tensors of this device)
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


# ------------------------------------------------------------------------------------------------------
# theory
# ------------------------------------------------------------------------------------------------------
def predicted_comm_bytes(stage: int, world_size: int, n_params: int, *, root_params: int = 0,
                         n_microbatches: int = 1, bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by collective, with ring algorithms (nccl-tests factors:
    all-reduce 2(n-1)/n·S, all-gather / reduce-scatter (n-1)/n·S).

    * stage 0 (DDP): one all-reduce of Ψ per step (accumulation uses no_sync): 2(n-1)/n·Ψ.
    * stage 1: reduce-scatter Ψ once per step (no_sync too) + all-gather Ψ after the update — the same total
      (Rajbhandari et al. 2020, Sec. 7.2.1).
    * stage 2: reduce-scatter Ψ every micro-batch + all-gather Ψ once.
    * stage 3: per micro-batch, all-gather every unit for forward and every unit but the root again for
      backward, reduce-scatter Ψ: (n-1)/n·(3Ψ - Ψ_root) per micro-batch — 1.5x DDP when Ψ_root → 0
      (Sec. 7.2.2). FSDP2 keeps its root the same way, so the same formula applies.

    ``n_params`` = Ψ (padded sizes, if padding exists: :func:`padded_params`), ``root_params`` = Ψ_root.
    Returns {op: bytes} (float: the ring factors are fractions).

    Raises:
        ValueError: stage not in 0-3; world_size, n_params, n_microbatches or bytes_per_element not a
            positive integer; root_params negative or larger than n_params.
    """
    check_choice("stage", stage, STAGES)
    n = positive_int("world_size", world_size)
    m = positive_int("n_microbatches", n_microbatches)
    e = positive_int("bytes_per_element", bytes_per_element)
    psi = positive_int("n_params", n_params) * e
    root = positive_int("root_params", root_params, minimum=0) * e
    if root > psi:
        raise ValueError(f"root_params={root_params} exceeds n_params={n_params}: the root unit is part of the model")
    f = (n - 1) / n
    if stage == 0:
        return {"all_reduce": 2 * f * psi}
    if stage == 1:
        return {"reduce_scatter": f * psi, "all_gather": f * psi}
    if stage == 2:
        return {"reduce_scatter": m * f * psi, "all_gather": f * psi}
    return {"reduce_scatter": m * f * psi, "all_gather": m * f * (2 * psi - root)}


# ------------------------------------------------------------------------------------------------------
# from scratch
# ------------------------------------------------------------------------------------------------------
def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


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
        self.flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        off = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[off:off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                off += p.numel()
        own = self.flat[rank * self.k:(rank + 1) * self.k]
        # the optimizer's parameter: a view of the flat buffer (stages 1-2, updated in place, then all-gathered)
        # or a tensor of its own (stage 3, the only copy this rank keeps)
        self.shard = nn.Parameter(own.detach().clone() if stage == 3 else own.detach())
        self.flat_grad = torch.zeros_like(self.flat) if stage == 1 else None
        self.ready = 0
        self.pending = []  # (work, output) of reduce-scatters in flight
        self.launched = False
        if stage == 3:
            _free(self.flat)

    # -- gradients -----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.stage == 1:
            self.flat_grad.zero_()
            off = 0
            for p in self.params:
                p.grad = self.flat_grad[off:off + p.numel()].view_as(p)
                off += p.numel()
            self.shard.grad = self.flat_grad[self.rank * self.k:(self.rank + 1) * self.k]
        else:
            for p in self.params:
                p.grad = None
            self.shard.grad = torch.zeros_like(self.shard)
        self.ready, self.launched = 0, False

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients packed into a new padded flat tensor (missing gradients count as zero)."""
        out = torch.zeros(self.padded, dtype=self.flat.dtype, device=self.flat.device)
        off = 0
        for p in self.params:
            if p.grad is not None:
                out[off:off + p.numel()].copy_(p.grad.reshape(-1))
            off += p.numel()
        return out

    def reduce_scatter(self, ctx, async_op: bool) -> None:
        """Reduce-scatter this unit's gradients (stage 2/3: then drop the full-size gradients)."""
        full = self.flat_grad if self.stage == 1 else self.flat_grads()
        out = torch.empty(self.k, dtype=full.dtype, device=full.device)
        work = reduce_scatter_tensor(out, full, group=self.group, async_op=async_op)
        if async_op:
            work = track_async(ctx, work, "reduce_scatter", full.numel() * full.element_size())
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
                out.div_(self.n)
                if self.stage == 1:
                    self.shard.grad.copy_(out)
                else:
                    self.shard.grad.add_(out)
        self.pending = []
        self.ready, self.launched = 0, False

    # -- parameters ----------------------------------------------------------------------------------
    def gather(self) -> bool:
        """Materialise the full parameters (stage 3: all-gather into the flat buffer). True if it gathered."""
        if not _is_freed(self.flat):
            return False
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        all_gather_tensor(self.flat, self.shard.detach(), group=self.group)
        return True

    def reshard(self) -> None:
        if self.stage == 3 and not _is_freed(self.flat):
            _free(self.flat)

    def all_gather_update(self) -> None:
        """Stages 1-2: after the optimizer updated this rank's slice in place, fetch everyone's slices."""
        all_gather_tensor(self.flat, self.shard.detach().clone(), group=self.group)


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1, 2 or 3 from scratch (module docstring). Follows the harness wrapper protocol.

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
        check_fsdp_devices(module, BACKEND_DEVICE.get(backend, dp_data.module_device(module).type), backend,
                           what=f"ZeRO-{stage}")
        self.module, self.stage, self.ctx, self.group = module, stage, ctx, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        dp_data.broadcast_parameters(module, group)
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
            self.no_sync = None  # the harness protocol: this wrapper cannot defer gradient synchronisation
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
            self.root.gather()
        return self.module(*args, **kwargs)

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
                    out[q] = p.detach().cpu().clone()
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
            u.gather()

        return hook

    def _post_forward(self, u: _Unit):
        def hook(_module, _args, output):
            if torch.is_grad_enabled():
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda grad: (u.gather(), None)[1])  # gather before this unit's backward
                        break
            u.reshard()

        return hook


# ------------------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------------------
def check_fsdp_devices(module: nn.Module, device_type: str, backend: str, what: str = "FSDP2") -> None:
    """Raise ValueError unless the process group's backend serves ``device_type`` and every parameter and
    buffer of ``module`` is on that device type.

    The field case (pytorch/pytorch#132471): ``fully_shard`` with a gloo group on a machine with GPUs moves
    the parameters to CUDA and then runs gloo collectives on CUDA tensors — a segfault instead of an error.
    gloo runs on ``cpu`` tensors, nccl on ``cuda`` tensors (``BACKEND_DEVICE``).
    """
    expected = BACKEND_DEVICE.get(backend)
    if expected is not None and device_type != expected:
        raise ValueError(f"{what}: device_type={device_type!r} does not match backend={backend!r}, which runs on "
                         f"{expected!r} tensors; valid: " + ", ".join(f"{d!r} with {b!r}" for b, d in
                                                                  BACKEND_DEVICE.items()))
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            if t.device.type != device_type:
                raise ValueError(
                    f"{what}: {kind} {name!r} is on {t.device}, but the {backend!r} process group runs on "
                    f"{device_type!r} tensors; move the model first (model.to({device_type!r})) or use a "
                    f"backend for {t.device.type!r} (valid: " + ", ".join(f"{b!r} for {d!r}" for b, d in
                                                                         BACKEND_DEVICE.items()) + ")")


def fsdp2(module: nn.Module, ctx, *, lr: float = 1e-3, mesh=None, reshard_after_forward: bool | None = None,
          group=None):
    """Shard ``module`` with FSDP2: ``fully_shard`` on each of ``module.layers`` then on the root, on
    ``mesh`` (default: a 1-D mesh of the whole world on ``ctx.device.type``); then build the lab's AdamW
    over the sharded (DTensor) parameters. Returns (module, optimizer).

    ``reshard_after_forward`` None (default) leaves FSDP2's own choice: layers free their gathered
    parameters after forward, the root keeps them until backward (as the lab's ZeRO-3 does); True or False
    forces it on every unit, the root included.

    Raises ValueError (via :func:`check_fsdp_devices`) if the parameters are not on the device the
    backend serves, instead of letting gloo crash on CUDA tensors.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if group is not None:
        raise ValueError("fsdp2 takes a DeviceMesh (mesh=...), not a process group")
    device_type = mesh.device_type if mesh is not None else ctx.device.type
    backend = dist.get_backend(mesh.get_group() if mesh is not None else None)
    check_fsdp_devices(module, device_type, backend)
    if mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    layers = getattr(module, "layers", [])
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True if reshard_after_forward is None
                    else reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return module, make_optimizer(module.parameters(), lr)


# ------------------------------------------------------------------------------------------------------
# builders and rank functions
# ------------------------------------------------------------------------------------------------------
def build(variant: str, module: nn.Module, ctx, *, lr: float = 1e-3, group=None, mesh=None, **options):
    """Wrap ``module`` as ``variant`` (:data:`VARIANTS`: ddp = stage 0 via torch DDP, zero1/2/3 from
    scratch, fsdp2) and build the optimizer after sharding. Returns (wrapped, optimizer). Raises ValueError
    for an unknown variant or parameters on a device the group's backend does not serve."""
    check_choice("variant", variant, VARIANTS)
    if variant == "ddp":
        return dp_data.build("ddp", module, ctx, lr=lr, group=group, **options)
    if variant == "fsdp2":
        return fsdp2(module, ctx, lr=lr, mesh=mesh, **options)
    z = ZeroDataParallel(module, int(variant[-1]), ctx, group, **options)
    return z, make_optimizer(z.optim_parameters(), lr)


#: variant -> builder ``fn(module, ctx, **options) -> (wrapped, optimizer)`` for run_experiments
WRAPPERS = {v: functools.partial(build, v) for v in VARIANTS}


def run_rank(ctx, runs: list[dict] | None = None, **kwargs) -> list[dict]:
    """Rank function: :func:`labkit.parallel.harness.run_experiments` over :data:`VARIANTS` (default: one
    run of each). Keyword arguments are run_experiments' (model, steps, global_batch_size, seq_len, ...)."""
    runs = [{"variant": v} for v in VARIANTS] if runs is None else runs
    return run_experiments(ctx, WRAPPERS, runs, **kwargs)


#: the ZeRO stage each variant implements (FSDP2 = full sharding = stage 3)
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}


def memory_rank(ctx, degrees=None, variants=VARIANTS, *, model: str = "lab-tiny-llama", seq_len: int = 32,
                global_batch_size: int = 8, seed: int = 0) -> list[dict]:
    """Rank function: measured model-state bytes per rank for each variant at each sharding degree d.

    For each d in ``degrees`` (default: every divisor of the world size) the world is cut into blocks of d
    consecutive ranks; each block trains its own replica group (``dist.new_group``; FSDP2: the ``shard``
    dimension of a (world/d, d) DeviceMesh). After one optimizer step (AdamW creates its state lazily),
    ``labkit.runtime.measure.model_state_bytes`` reads the live tensors. Returns one dict per (d, variant) with
    ``degree``, ``variant``, ``stage``, and measured ``parameters``, ``gradients``, ``optimizer`` (bytes,
    this rank; ``optimizer`` includes AdamW's step counters, also given alone as ``optimizer_steps``: one per
    parameter tensor for DDP and FSDP2, one per unit for the lab's flat ZeRO). Raises ValueError if a degree
    does not divide the world size, or for an unknown variant.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.checks import check_divides, divisors
    from labkit.models import SyntheticLM, build_model
    from labkit.runtime.measure import model_state_bytes
    from labkit.theory.spec import get_spec

    n = ctx.world_size
    degrees = divisors(n) if degrees is None else list(degrees)
    for d in degrees:
        check_divides("degree", d, "world_size", n)
    for v in variants:
        check_choice("variant", v, VARIANTS)
    spec = get_spec(model)
    data = SyntheticLM(spec.vocab_size, seq_len)
    rows = []
    for d in degrees:
        groups = [dist.new_group(list(range(i, i + d))) for i in range(0, n, d)]
        group = groups[ctx.rank // d]
        mesh = (init_device_mesh(ctx.device.type, (n,)) if d == n else
                init_device_mesh(ctx.device.type, (n // d, d), mesh_dim_names=("replicate", "shard"))["shard"])
        for v in variants:
            module = build_model(spec, seed, device=ctx.device)
            opts = {"mesh": mesh} if v == "fsdp2" else {"group": group}
            if v == "ddp":
                opts["log_comm"] = False
            wrapped, opt = build(v, module, ctx, **opts)
            train_steps(ctx, wrapped, opt, data, steps=1, global_batch_size=global_batch_size,
                                dp_rank=dist.get_rank(group), dp=d, dp_group=group, record=False)
            rows.append({"degree": d, "variant": v, "stage": STAGE_OF[v], **model_state_bytes(wrapped, opt),
                         "optimizer_steps": optimizer_step_bytes(opt)})
            if hasattr(wrapped, "close"):
                wrapped.close()
    return rows


def check_chapter(*, world_size, model: str = "lab-tiny-llama", global_batch_size=8, steps=3, seq_len=32) -> dict:
    """Chapter 04's parameters, all checked before any launch (the chapter's first cell after its parameters).

    world_size >= 2 (with one rank nothing is sharded: every stage holds the same bytes and sends nothing);
    a known ``model`` small enough for the machine; ``steps`` >= 1; world_size divides ``global_batch_size``
    (then so does every degree the memory sweep uses, each a divisor of world_size); ``seq_len`` within the
    model's ``max_seq_len``. Returns the checked values. Raises ValueError naming the value and the fix.
    """
    from labkit.theory.spec import get_spec

    n = check_world_size("04", world_size, why="with one rank nothing is sharded, so every stage holds "
                                 "the same bytes and sends none")
    spec = get_spec(model)
    steps = positive_int("steps", steps)
    local = dp_data.check_batch(n, global_batch_size, dp_name="world_size")
    seq_len = spec.check_seq_len(seq_len)
    check_fits_in_memory(spec, n, copies=2, what="chapter 04")
    return {"world_size": n, "model": spec.name, "global_batch_size": global_batch_size, "local_batch_size": local,
            "steps": steps, "seq_len": seq_len}


def chapter_rank(ctx, runs: list[dict] | None = None, *, degrees=None, memory_variants=VARIANTS, **kwargs) -> dict:
    """Rank function for chapter 04, one launch: the variants trained side by side (:func:`run_rank` with
    ``runs`` and ``kwargs``) and model-state bytes per degree (:func:`memory_rank`, with the same ``model``,
    ``seq_len``, ``global_batch_size`` and ``seed`` as the training runs).
    Returns {"runs": [...], "memory": [...]}."""
    out = {"runs": run_rank(ctx, runs, **kwargs)}
    same = {k: kwargs[k] for k in ("model", "seq_len", "global_batch_size", "seed") if k in kwargs}
    out["memory"] = memory_rank(ctx, degrees, memory_variants, **same)
    return out


def root_params(spec) -> int:
    """Parameters of the root unit (everything outside the layers): embeddings, final norm, output head."""
    return spec.embedding_params() + spec.norm_params() + spec.head_params()


def predicted_table(model: str, degrees, variants=VARIANTS, *, rank: int = 0) -> pd.DataFrame:
    """Predicted model-state bytes per rank for each (degree, variant), from the lab's calculator:
    ``labkit.theory.memory.train_memory`` with ``ParallelConfig(dp=degree, zero=stage)`` and convention "torch-fp32"
    (Rajbhandari et al. 2020, Figure 1, with 4 + 4 + 8 bytes per parameter and AdamW's 4-byte step counter
    per parameter tensor). Columns ``degree``, ``variant``, ``stage``, ``parameters``, ``gradients``,
    ``optimizer``, ``optimizer_steps`` (the step counters inside ``optimizer``), ``model_states``; and the
    same four for this implementation's layout on ``rank`` (of its group, ``rank % degree``) from
    :func:`layout_bytes`, prefixed ``layout_`` (equal to the calculator's when d divides every size; else
    they differ by the padding / uneven rows, and ZeRO's step counters are one per unit).
    Raises ValueError for an unknown model or variant."""
    from labkit.theory import memory
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    train = memory.TrainConfig(convention="torch-fp32", seq_len=min(32, spec.max_seq_len))
    steps = memory.get_convention("torch-fp32").step_bytes * len(memory.param_tensors(spec))
    rows = []
    for d in degrees:
        for v in variants:
            check_choice("variant", v, VARIANTS)
            est = memory.train_memory(spec, memory.ParallelConfig(dp=d, zero=STAGE_OF[v]), train, headroom=0.0,
                                      workspace_bytes=0)
            b = {k: est.categories[k] for k in ("parameters", "gradients", "optimizer")}
            lay = layout_bytes(spec, d, v, rank % d)
            rows.append({"degree": d, "variant": v, "stage": STAGE_OF[v], **b, "optimizer_steps": steps,
                         "model_states": sum(b.values()), **{f"layout_{k}": x for k, x in lay.items()}})
    return pd.DataFrame(rows)


def _units(spec) -> list[list]:
    """The parameter tensors (labkit.theory.memory.param_tensors) grouped as :class:`ZeroDataParallel` groups them:
    the root unit (everything outside the layers) first, then one unit per layer."""
    from labkit.theory import memory

    tensors = memory.param_tensors(spec)
    root = [t for t in tensors if t.layer is None]
    layers = [[t for t in tensors if t.layer == i] for i in range(spec.n_layers)]
    return [u for u in [root, *layers] if u]


def _chunk(dim0: int, d: int, rank: int) -> int:
    """Rows of a dim-0 shard as ``torch.chunk`` cuts them (FSDP2): ceil(dim0/d) each, the last ranks fewer."""
    c = -(-dim0 // d)
    return max(0, min(c, dim0 - rank * c))


def layout_bytes(spec, degree: int, variant: str, rank: int = 0, bytes_per_element: int = 4) -> dict[str, int]:
    """Predicted model-state bytes on ``rank`` of a group of ``degree`` ranks for *this implementation's*
    layout, to the byte, where the paper's Ψ/d (and the calculator's per-tensor ceil(numel/d)) is the ideal:

    * the lab's ZeRO pads each unit's flat buffer to a multiple of d and keeps k = padded/d elements per rank
      (:class:`ZeroDataParallel`); stages 1-2 keep the full parameters as views of that buffer, and a rank's
      shard view reaches into the padding on the last ranks, so the storage touched is max(numel, (r+1)·k);
      AdamW keeps one 4-byte step counter per unit;
    * FSDP2 cuts every parameter on dim 0 as ``torch.chunk`` does: ceil(dim0/d) rows each, the last ranks
      fewer (uneven when d does not divide dim0); one step counter per parameter tensor;
    * DDP holds everything.

    fp32 parameters, gradients and AdamW's two moments (``bytes_per_element`` each), as
    :func:`predicted_table`. Returns {"parameters", "gradients", "optimizer", "optimizer_steps"}.
    Raises ValueError for an unknown variant, degree < 1 or rank outside 0..degree-1.
    """
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    check_choice("variant", variant, VARIANTS)
    d = positive_int("degree", degree)
    if not 0 <= rank < d:
        raise ValueError(f"rank={rank} must be in 0..{d - 1} for degree={d}")
    e = bytes_per_element
    units = _units(spec)
    tensors = [t for u in units for t in u]
    full = sum(t.numel for t in tensors)
    if variant == "ddp":
        return {"parameters": e * full, "gradients": e * full, "optimizer": 2 * e * full + 4 * len(tensors),
                "optimizer_steps": 4 * len(tensors)}
    if variant == "fsdp2":
        local = sum(_chunk(t.shape[0], d, rank) * (t.numel // t.shape[0]) for t in tensors)
        return {"parameters": e * local, "gradients": e * local, "optimizer": 2 * e * local + 4 * len(tensors),
                "optimizer_steps": 4 * len(tensors)}
    stage = STAGE_OF[variant]
    sizes = [sum(t.numel for t in u) for u in units]
    ks = [-(-u // d) for u in sizes]
    viewed = sum(max(u, (rank + 1) * k) for u, k in zip(sizes, ks))  # full params + this rank's shard view
    shard = sum(ks)
    return {"parameters": e * (shard if stage == 3 else viewed), "gradients": e * (viewed if stage == 1 else shard),
            "optimizer": 2 * e * shard + 4 * len(units), "optimizer_steps": 4 * len(units)}


def padded_params(spec, degree: int, variant: str) -> tuple[int, int]:
    """(Ψ, Ψ_root) as the collectives of ``variant`` on ``degree`` ranks see them: each unit padded to a
    multiple of d (the lab's ZeRO), each parameter's dim 0 padded to a multiple of d (FSDP2: every rank
    all-gathers ceil(dim0/d) rows), unpadded for DDP. Equal to (``spec.n_params()``, :func:`root_params`)
    when d divides every size. Raises ValueError for an unknown variant."""
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    check_choice("variant", variant, VARIANTS)
    d = positive_int("degree", degree)
    units = _units(spec)
    if variant == "ddp":
        sizes = [sum(t.numel for t in u) for u in units]
    elif variant == "fsdp2":
        sizes = [sum(-(-t.shape[0] // d) * d * (t.numel // t.shape[0]) for t in u) for u in units]
    else:
        sizes = [-(-sum(t.numel for t in u) // d) * d for u in units]
    root = sizes[0] if units[0][0].layer is None else 0
    return sum(sizes), root


#: comm_table's byte columns, each named for where its number comes from
PAYLOAD = "payload S (measured: what the code issued)"
RING = "ring bytes (model: S x factor)"
PREDICTED = "ring bytes (predicted: formula of Ψ)"


def comm_table(results, model: str) -> pd.DataFrame:
    """Bytes per rank per step by collective for every run of a :func:`run_rank` / :func:`chapter_rank`
    launch. Columns: ``label``, ``op``, ``calls`` (measured, per step), :data:`PAYLOAD` (measured: the S the
    code passed to the collectives, CommLog), :data:`RING` (model: each S times its ring factor),
    :data:`PREDICTED` (:func:`predicted_comm_bytes` with the root unit kept gathered, Ψ and Ψ_root padded as
    the variant pads them: :func:`padded_params`). :data:`RING` equals :data:`PREDICTED` exactly when the code
    issued the predicted collectives; the bytes gloo actually wrote are per run, in
    :func:`labkit.parallel.harness.summarize`."""
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    runs = _runs(results)
    n = len(runs)
    rows = []
    for r in runs[0]:
        m = r.get("n_microbatches", 1)
        psi, root = padded_params(spec, n, r["variant"])
        pred = predicted_comm_bytes(STAGE_OF[r["variant"]], n, psi, root_params=root, n_microbatches=m)
        for op in sorted(set(pred) | set(r["comm"])):
            c = r["comm"].get(op, {"calls": 0.0, "nbytes": 0.0, "bytes_per_rank": 0.0})
            rows.append({"label": r["label"], "op": op, "calls": c["calls"], PAYLOAD: c["nbytes"],
                         RING: c["bytes_per_rank"], PREDICTED: pred.get(op, 0.0)})
    return pd.DataFrame(rows)
