"""Composed (2-D) runs, predicted: which runs a model and a batch allow, and the model-state bytes of each layout.

Pure Python (no torch). A run is a dict ``{"kind": ..., "dp": ..., "tp": ..., "pp": ...}``; its kinds are the
compositions of :mod:`labkit.parallel.composed` (``dp_tp``: :func:`~labkit.parallel.composed.apply_dp_tp`,
``dp_tp_hand``: :func:`~labkit.parallel.composed.apply_dp_tp_hand`, ``pp_dp``:
:class:`~labkit.parallel.composed.PipelineDP`). The rank grid and its rules are :mod:`labkit.theory.mesh`'s; the
bytes are :mod:`labkit.theory.memory`'s.
"""

from __future__ import annotations

from labkit.checks import check_choice, divisors
from labkit.theory.mesh import MeshError, ParallelDims, Violation
from labkit.theory.spec import ModelSpec

KINDS = ("dp_tp", "dp_tp_hand", "pp_dp")
#: ZeRO stage of each kind's data parallelism (FSDP2 = 3; DataParallelBucket = 0), for the memory prediction
ZERO_OF = {"dp_tp": 3, "dp_tp_hand": 0, "pp_dp": 3}


def run_dims(run: dict, world_size: int) -> ParallelDims:
    """The :class:`ParallelDims` of one run dict (``kind`` plus degrees). Raises ValueError (MeshError) when the
    degrees do not multiply to ``world_size`` or the kind is unknown."""
    check_choice("kind", run.get("kind"), KINDS)
    degrees = {k: run.get(k, 1) for k in ("dp", "tp", "pp")}
    if run["kind"] in ("dp_tp", "dp_tp_hand") and degrees["pp"] != 1:
        raise ValueError(f"kind={run['kind']!r} composes dp and tp only, got pp={degrees['pp']}; use kind='pp_dp'")
    if run["kind"] == "pp_dp" and degrees["tp"] != 1:
        raise ValueError(f"kind='pp_dp' composes pp and dp only, got tp={degrees['tp']}; use kind='dp_tp'")
    return ParallelDims(world_size, **degrees)


def check_runs(runs, world_size: int, spec: ModelSpec, *, global_batch_size: int, seq_len: int,
               n_microbatches: int) -> list[ParallelDims]:
    """Validate every run before anything is launched (the ParallelDims rules for ``spec`` and the batch;
    pp_dp needs an untied output head). Returns the runs' :class:`ParallelDims`. Raises ValueError naming the
    run and the fix."""
    out = []
    for run in runs:
        dims = run_dims(run, world_size)
        m = n_microbatches if run["kind"] == "pp_dp" else None
        mbs = global_batch_size // (dims.dp * n_microbatches) if m else global_batch_size // dims.dp
        dims.check(spec, seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=max(1, mbs),
                   n_microbatches=m if m else 1)
        if run["kind"] == "dp_tp" and spec.n_kv_heads % dims.tp:
            # ParallelDims accepts replicated kv heads (n_kv_heads | tp), which the hand TP implements; the DTensor
            # plan shards wk/wv by columns, so it needs whole kv heads per rank
            raise MeshError([Violation("tp_kv_heads", (
                f"kind='dp_tp': tp={dims.tp} does not divide n_kv_heads={spec.n_kv_heads} (the DTensor plan "
                "splits wk/wv by columns, whole kv heads per rank); use kind='dp_tp_hand', which replicates kv "
                f"heads, or tp in {divisors(spec.n_kv_heads)}"))])
        if run["kind"] == "pp_dp" and spec.tied_embeddings:
            raise ValueError(f"kind='pp_dp' needs an untied output head ({spec.name!r} ties it to the embedding, "
                             "which would live on two stages); use a model with tied_embeddings=False, e.g. "
                             "lab-tiny-llama")
        out.append(dims)
    return out


def predicted_model_states(spec: ModelSpec, dims: ParallelDims, stage: int, zero: int = 3) -> dict[str, int]:
    """labkit.theory.memory's prediction of this layout's model states on pipeline rank ``stage``: parameters,
    gradients and AdamW state in fp32 (convention ``torch-fp32``), ZeRO stage ``zero`` over dp (FSDP2 = 3,
    replicated DP = 0), TP-split as :func:`labkit.theory.memory.param_tensors` says. Bytes per rank."""
    from labkit.theory import memory as mem

    est = mem.train_memory(spec, dims.parallel_config(zero=zero), mem.TrainConfig(convention="torch-fp32"),
                           headroom=0.0, workspace_bytes=0, stage=stage)
    return {k: est.categories[k] for k in ("parameters", "gradients", "optimizer")}
