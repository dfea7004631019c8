"""Sharded data parallelism, measured: DDP, the lab's ZeRO-1/2/3 and FSDP2 trained side by side
(:func:`run_rank`), and the model-state bytes each rank holds at every sharding degree (:func:`memory_rank`).
The predictions they are checked against are in :mod:`labkit.theory.zero`.

Every function here whose first argument is ``ctx`` is a rank function for :func:`labkit.launch`.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_choice
from labkit.experiments import data as dp_experiments
from labkit.experiments.common import optimizer_step_bytes, run_experiments
from labkit.models import make_optimizer
from labkit.parallel.zero import ZeroDataParallel, fsdp2
from labkit.runtime.training import train_steps
from labkit.theory.zero import STAGE_OF, VARIANTS


# ------------------------------------------------------------------------------------------------------
# builders and rank functions
# ------------------------------------------------------------------------------------------------------
def build(variant: str, module: nn.Module, ctx, *, lr: float = 1e-3, group=None, mesh=None, **options):
    """Wrap ``module`` as ``variant`` (:data:`VARIANTS`: ddp = stage 0 via torch DDP, zero1/2/3 from
    scratch, fsdp2) and build the optimizer after sharding. Returns (wrapped, optimizer). Raises ValueError
    for an unknown variant or parameters on a device the group's backend does not serve."""
    check_choice("variant", variant, VARIANTS)
    if variant == "ddp":
        return dp_experiments.build("ddp", module, ctx, lr=lr, group=group, **options)
    if variant == "fsdp2":
        return fsdp2(module, ctx, lr=lr, mesh=mesh, **options)
    z = ZeroDataParallel(module, int(variant[-1]), ctx=ctx, group=group, **options)
    return z, make_optimizer(z.optim_parameters(), lr)


#: variant -> builder ``fn(module, ctx, **options) -> (wrapped, optimizer)`` for run_experiments
WRAPPERS = {v: functools.partial(build, v) for v in VARIANTS}


def run_rank(ctx, runs: list[dict] | None = None, **kwargs) -> list[dict]:
    """Rank function: :func:`labkit.experiments.common.run_experiments` over :data:`VARIANTS` (default: one
    run of each). Keyword arguments are run_experiments' (model, steps, global_batch_size, seq_len, ...)."""
    runs = [{"variant": v} for v in VARIANTS] if runs is None else runs
    return run_experiments(ctx, WRAPPERS, runs, **kwargs)


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
