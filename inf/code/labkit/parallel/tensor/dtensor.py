"""Tensor parallelism with torch's DTensor API: the plan of :mod:`labkit.parallel.tensor` (Megatron's split)
written as ``parallelize_module`` styles, the one the lab uses wherever it wants torch's own TP (chapter 05's
comparison, and the DP x TP composition in :mod:`labkit.parallel.composed`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.models import SwiGLU, Transformer
from labkit.theory.tensor import check_tp


def apply_dtensor_tp(model: Transformer, mesh=None, *, sequence_parallel: bool = False,
                     gather_logits: bool = False) -> Transformer:
    """The same plan with torch's DTensor API (``parallelize_module`` with ``ColwiseParallel``,
    ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``; the plan torchtitan uses for Llama):
    ``wq``/``wk``/``wv`` and ``w_gate``/``w_up`` (``fc_in``) column-parallel, ``wo`` and ``w_down``
    (``fc_out``) row-parallel (Shoeybi et al. 2019, Sec. 3); the embedding split by vocabulary rows, the output
    layer by vocabulary columns; with SP the norms run on sequence shards (Korthikanti et al. 2022).

    Parallelises ``model`` in place (its parameters become DTensors sharded from the full weights) and returns
    it. The logits come out as a ``Shard(-1)`` DTensor: compute the loss with :func:`dtensor_loss`
    (``loss_parallel``); with ``gather_logits=True`` they are gathered into a plain [B, T, V] tensor instead,
    for a plain loss (``labkit.models.lm_loss``; the DP x TP composition does this). ``mesh``: a 1-D
    DeviceMesh (default: all ranks on the model's device type). Checked on gloo/CPU with torch 2.13.
    Raises ValueError from :func:`labkit.theory.tensor.check_tp` (``dtensor=True``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if mesh is None:
        dev = next(model.parameters()).device.type
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
    check_tp(model.spec, mesh.size(), sequence_parallel=sequence_parallel, dtensor=True)
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()  # the residual stream: (B, T/tp, H) with SP, else (B, T, H)
    head = (ColwiseParallel(input_layouts=seq, output_layouts=Replicate()) if gather_logits  # (B, T, V) plain
            else ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False))  # (B, T, V/tp)
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),  # tokens (B, T) -> seq
           "lm_head": head}
    if sp:
        top["norm"] = SequenceParallel()  # (B, T/tp, H)
    parallelize_module(model, mesh, top)
    names = ("w_gate", "w_up", "w_down") if isinstance(model.layers[0].mlp, SwiGLU) else ("fc_in", None, "fc_out")
    for blk in model.layers:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),  # H/tp
                "attn.wo": RowwiseParallel(output_layouts=seq),  # g (SP: g-bar)
                f"mlp.{names[0]}": ColwiseParallel(), f"mlp.{names[2]}": RowwiseParallel(output_layouts=seq)}
        if names[1]:
            plan[f"mlp.{names[1]}"] = ColwiseParallel()  # (B, T, F/tp)
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None),  # (B, T/tp, H) -> (B, T, H)
                                                    desired_input_layouts=(Replicate(), None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(blk, mesh, plan)
    return model


def dtensor_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``Shard(-1)`` DTensor logits under ``loss_parallel()`` (no gather of logits)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _dtensor_backward(loss) -> None:
    """``loss.backward()`` under ``loss_parallel()`` (the backward of :func:`dtensor_loss`)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


def _full(t) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), or ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

