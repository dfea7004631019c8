"""Composed (2-D) parallelism: the lab's strategies put together on a 2-D DeviceMesh.

A :class:`labkit.theory.mesh.ParallelDims` says which ranks share a group; :func:`labkit.parallel.mesh.device_mesh`
makes it a torch ``DeviceMesh`` (``mesh["tp"]``, ``mesh["dp"]``, ``mesh["pp"]`` are this rank's groups). A
composition applies one strategy per mesh dimension, each on its own group, the inner one first. Three of them,
two with torch's own ("production") APIs, one from the lab's hand-written modules:

* :func:`apply_dp_tp` — tensor parallelism inside each TP group with ``parallelize_module``
  (:func:`labkit.parallel.tensor.apply_dtensor_tp`; Megatron's split: ``wq``/``wk``/``wv`` and
  ``w_gate``/``w_up`` column-parallel, ``wo`` and ``w_down`` row-parallel, one all-reduce after attention and
  one after the MLP in forward; Shoeybi et al. 2019, Sec. 3; the embedding split by vocabulary rows, the output
  head by vocabulary columns with the logits gathered; norms replicated), then FSDP2 ``fully_shard`` of every
  block and of the root over the DP dimension (:func:`labkit.parallel.zero.fsdp2`) — the "2-D" FSDP + TP of
  torchtitan (Liang et al. 2024, "TorchTitan", Sec. 3.1).
* :func:`apply_dp_tp_hand` -> :class:`TPInDP` — the same mesh with the lab's hand-written modules on the mesh's
  process groups: :func:`labkit.parallel.tensor.apply_tp` (Megatron TP: vocab-parallel embedding and
  cross-entropy, column / row-parallel linears, explicit ``f``/``g`` autograd functions) over the TP group,
  wrapped in :class:`labkit.parallel.data.DataParallelBucket` (bucketed, overlapped gradient all-reduce) over
  the DP group: replicated data parallelism (ZeRO-0) around tensor parallelism.
* :class:`PipelineDP` — the layers split into ``pp`` consecutive stages
  (:class:`labkit.parallel.pipeline.stage.StageModule`), each stage a ``torch.distributed.pipelining``
  ``PipelineStage`` on the PP group, run with ``Schedule1F1B`` (Narayanan et al. 2021), and each stage
  ``fully_shard``-ed over its DP group (the pipelining runtime drives FSDP's gradient sync on the last
  micro-batch).

The hand-written pipeline runner (:mod:`labkit.parallel.pipeline.runner`) addresses stages by global rank, so
PP x DP is composed with torch's pipelining only.

Every composition returns the wrapped model and the lab's AdamW, built after sharding. Which runs a model and
a batch allow (:func:`labkit.theory.composed.check_runs`) and the model-state bytes each layout holds per rank
(:func:`labkit.theory.composed.predicted_model_states`) are in :mod:`labkit.theory.composed`; the rank function
that trains the three beside the single-process reference is in :mod:`labkit.experiments.composed`.
"""

from __future__ import annotations

import warnings

import torch

from labkit.models import Transformer, lm_loss, make_optimizer
from labkit.parallel.data import DataParallelBucket
from labkit.parallel.pipeline.stage import StageModule
from labkit.parallel.tensor import apply_dtensor_tp, apply_tp, finalize_grads
from labkit.parallel.zero import fsdp2


# ------------------------------------------------------------------------------------------------------
# DP x TP, torch-native: parallelize_module over tp, then fully_shard over dp
# ------------------------------------------------------------------------------------------------------
def apply_dp_tp(model: Transformer, mesh, *, lr: float = 1e-3):
    """DP x TP with torch's APIs, in place: Megatron's split over ``mesh["tp"]``
    (:func:`labkit.parallel.tensor.apply_dtensor_tp`, the logits gathered so a plain
    :func:`labkit.models.lm_loss` applies), then FSDP2 over ``mesh["dp"]``: ``fully_shard`` of every block,
    then of the root (:func:`labkit.parallel.zero.fsdp2`, ZeRO-3). Returns (model, AdamW over its parameters).

    Each parameter becomes a DTensor on both dimensions, sharded on dim 0 by FSDP over what TP left: a
    column-parallel weight (out, in) is held as (out/(tp·dp), in) per rank, a row-parallel one as
    (out/dp, in/tp), a norm (H,) as (H/dp,).

    Raises ValueError when tp does not fit the model's heads (:func:`labkit.theory.tensor.check_tp`,
    ``dtensor=True``: whole kv heads per rank) or when the parameters are not on the device the dp group's
    backend serves (:func:`labkit.parallel.zero.check_fsdp_devices`).
    """
    # the gathered logits are a view; lm_loss never writes to them in place, so FSDP's warning does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    apply_dtensor_tp(model, mesh["tp"], gather_logits=True)  # tokens (B/dp, T) -> logits (B/dp, T, V), gathered
    return fsdp2(model, None, lr=lr, mesh=mesh["dp"])  # each block, then the root: ZeRO-3 over dp


# ------------------------------------------------------------------------------------------------------
# DP x TP, hand-written: apply_tp over tp inside DataParallelBucket over dp
# ------------------------------------------------------------------------------------------------------
class TPInDP:
    """A hand-written TP model inside a hand-written DP wrapper, as one wrapper of the protocol of
    :mod:`labkit.runtime.training`: forward through the DP wrapper; after each backward
    (:meth:`finish_grad_sync`) the DP average (buckets launched during backward, waited on here) and then the
    sum of TP-partial gradients (:func:`labkit.parallel.tensor.finalize_grads`; none without SP / replicated kv
    heads). ``module`` is the TP model (its ``loss`` is the vocabulary-parallel cross-entropy)."""

    def __init__(self, dpm: DataParallelBucket, tpm, tp_group):
        self.dpm, self.module, self.tp_group = dpm, tpm, tp_group

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dpm(tokens)  # tokens (B/dp, T) -> logits (B/dp, T, Vp/tp): this rank's vocabulary block

    def finish_grad_sync(self) -> None:
        self.dpm.finish_grad_sync()  # grads averaged over dp (each TP shard with its dp peers)
        finalize_grads(self.module, self.tp_group)  # then summed over tp where a gradient is TP-partial

    def close(self) -> None:
        """Remove the DP wrapper's gradient hooks."""
        self.dpm.close()


def apply_dp_tp_hand(model: Transformer, mesh, ctx=None, *, lr: float = 1e-3) -> tuple[TPInDP, torch.optim.Optimizer]:
    """DP x TP with the lab's own modules: :func:`labkit.parallel.tensor.apply_tp` over ``mesh["tp"]``'s group
    (each rank keeps its shard of the full weights every rank built), inside
    :class:`labkit.parallel.data.DataParallelBucket` over ``mesh["dp"]``'s group (replicated, ZeRO-0).
    ``ctx`` (optional, anything with ``ctx.timeline``) records the bucket all-reduces. Returns
    (:class:`TPInDP`, AdamW over the TP shards).

    Raises ValueError when tp does not fit the model (:func:`labkit.theory.tensor.check_tp`).
    """
    tp_group = mesh.get_group("tp")
    tpm = apply_tp(model, tp_group)  # weights: column (out/tp, in), row (out, in/tp), embedding (Vp/tp, H)
    dpm = DataParallelBucket(tpm, ctx=ctx, group=mesh.get_group("dp"))
    return TPInDP(dpm, tpm, tp_group), make_optimizer(tpm.parameters(), lr)


# ------------------------------------------------------------------------------------------------------
# PP x DP: a StageModule per pipeline rank, fully_shard over dp, torch's 1F1B over pp
# ------------------------------------------------------------------------------------------------------
class PipelineDP:
    """PP x DP on one rank: pipeline stage ``stage`` of ``mesh["pp"].size()`` (a
    :class:`labkit.parallel.pipeline.stage.StageModule`: an equal share of ``model``'s layers under their
    full-model names, the embedding on the first stage, the final norm and head on the last),
    ``fully_shard``-ed over ``mesh["dp"]`` (each layer, then the stage: :func:`labkit.parallel.zero.fsdp2`), run
    by torch's ``PipelineStage`` on the PP group with ``Schedule1F1B`` over ``n_microbatches`` micro-batches
    and ``loss_fn`` on the last stage.

    ``module``, ``opt`` (AdamW over the stage's sharded parameters) and ``schedule`` are attributes;
    :meth:`step` runs one optimizer step. Raises ValueError when the stages do not divide the layers, or
    (tied embeddings) when the stage would hold the embedding twice on a single stage.
    """

    def __init__(self, model: Transformer, mesh, *, stage: int, n_microbatches: int, device, lr: float = 1e-3,
                 loss_fn=lm_loss):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        n_stages = mesh["pp"].size()
        self.stage = stage
        self.module = StageModule(model, stage, n_stages)
        self.module, self.opt = fsdp2(self.module, None, lr=lr, mesh=mesh["dp"])  # ZeRO-3 of this stage over dp
        pipe = PipelineStage(self.module, stage, n_stages, device, group=mesh.get_group("pp"))
        self.schedule = Schedule1F1B(pipe, n_microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return self.module.is_first

    @property
    def is_last(self) -> bool:
        return self.module.is_last

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One optimizer step on this DP rank's batch: ``tokens``, ``targets`` (B/dp, T) int64, which the
        schedule splits into ``n_microbatches`` micro-batches (b, T), b = B/(dp·m). The first stage feeds the
        tokens, the last the targets; returns the last stage's loss per micro-batch ([] on the other stages)."""
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.is_first:
            self.schedule.step(tokens)  # tokens (b, T) -> hidden (b, T, H), sent to the next stage
        else:
            # hidden (b, T, H) received -> the last stage's logits (b, T, V) -> one loss () per micro-batch
            self.schedule.step(target=targets, losses=losses)
        self.opt.step()
        return losses
