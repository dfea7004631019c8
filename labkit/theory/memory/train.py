"""The training budget per rank: :func:`train_memory`, stage by stage (parameters, gradients, optimizer
state, activations, temporary and communication buffers, workspace, headroom).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, replace

from labkit.checks import positive_int
from labkit.theory.memory.activations import _edge_bytes, _layer_activation_bytes, activation_bytes_per_layer
from labkit.theory.memory.budget import MemoryEstimate, _device_info, _finish, _resolve_model
from labkit.theory.memory.config import ParallelConfig, TrainConfig, kv_heads_per_rank
from labkit.theory.memory.conventions import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_HEADROOM,
    _ceil_div,
    check_headroom,
    nbytes,
)
from labkit.theory.memory.params import _kind_states, _model_states, _stage_shapes
from labkit.theory.memory.stages import in_flight_microbatches, stage_layers
from labkit.theory.spec import ModelSpec


def train_memory(model, parallel: ParallelConfig | None = None, train: TrainConfig | None = None, *,
                 device: str | None = None, headroom: float = DEFAULT_HEADROOM, workspace_bytes: int | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage: int | None = None,
                 dp_rank: int = 0) -> MemoryEstimate:
    """Predicted training memory per rank, by category (bytes), on the pipeline stage with the highest peak
    (or on pipeline rank ``stage`` when given; ``per_stage`` always lists every stage's peak), for ZeRO shard
    ``dp_rank`` in 0..dp·cp-1 (it matters only with ``shard_layout="dim0"``, where rank 0 holds the most).

    ``model``: a ModelSpec, a preset name, or a bare parameter count (model states only: activations and
    buffers are 0, and the count is split evenly over tp·pp). ``parallel`` / ``train``: see
    :class:`ParallelConfig`, :class:`TrainConfig`. ``device``: a name from data/hardware.yaml for the verdict.
    ``headroom``: allocator headroom as a fraction of everything else (default 0.15; the seeds advise 10-20 %).
    ``workspace_bytes``: None -> 1 GiB with a device (CUDA context + cuBLAS/NCCL workspaces, assumed), else 0.
    ``bucket_bytes``: one data-parallel gradient bucket (torch DDP's 25 MiB default).

    Categories:

    * parameters / gradients / optimizer — per tensor held by the rank (TP-split, its pipeline stage, its
      experts), sharded over dp·cp (experts: dp·cp/ep) by the ZeRO stage (Rajbhandari et al. 2020), bytes per
      parameter from the convention (:data:`CONVENTIONS`); ZeRO shards round up per tensor.
    * activations — :func:`activation_bytes_per_layer` × the stage's layers × :func:`in_flight_microbatches`,
      plus :func:`edge_activation_items` (first stage: × in-flight micro-batches; last stage: one).
    * temporary (lab assumption; these coexist at the start of backward): the logits gradient on the last
      stage (n·v/t·4); with full recompute one layer's activations being recomputed; with ZeRO-3 two layers'
      unsharded parameters (current + prefetch, FSDP2's default) and one layer's unsharded gradients.
    * communication (lab assumption): two DP gradient buckets (capped at the gradient bytes) when dp·cp > 1
      and ZeRO < 3; one n·h·e buffer for TP collectives; 2·n·h·e send/recv for PP; 2·(2·n·kv·e) for ring
      attention (CP); 2·n·top_k·h·e dispatch/combine for EP.
    * workspace, headroom — as above.

    Raises ValueError for an invalid model, configuration, device, or degrees that do not divide the model.
    """
    parallel = parallel or ParallelConfig()
    train = train or TrainConfig()
    headroom = check_headroom(headroom)
    bucket_bytes = positive_int("bucket_bytes", bucket_bytes, minimum=0)
    spec = _resolve_model(model)
    is_spec = isinstance(spec, ModelSpec)
    parallel.check(spec if is_spec else None, train.seq_len)
    conv = train.resolved_convention()
    dev, workspace = _device_info(device, workspace_bytes)
    dense_group = parallel.dp * parallel.cp
    expert_group = max(1, dense_group // parallel.ep)
    if not (isinstance(dp_rank, int) and not isinstance(dp_rank, bool) and 0 <= dp_rank < dense_group):
        raise ValueError(f"dp_rank={dp_rank!r} must be a ZeRO shard index in 0..{dense_group - 1} (dp*cp ranks)")
    shard = (parallel.shard_layout, dp_rank)
    e = train.act_bits() / 8

    if not is_spec:
        if train.optimizer == "adafactor":
            raise ValueError("optimizer='adafactor' needs a ModelSpec (its state is factored per matrix), not a "
                             "bare parameter count")
        local = _ceil_div(spec, parallel.tp * parallel.pp)
        cats = _model_states([(None, (local,))], conv, train.optimizer, parallel.zero, dense_group, expert_group,
                             *shard)
        cats["workspace"] = workspace
        cats = _finish(cats, headroom)
        assumptions = _train_assumptions(conv, train, parallel, headroom, workspace, bucket_bytes,
                                         model_states_only=True)
        assumptions["dp_rank"] = dp_rank
        return MemoryEstimate("train", cats, spec, local, assumptions, 0, [sum(cats.values())],
                              dev["name"] if dev else None, dev["memory_bytes"] if dev else None)

    if stage is not None and not (isinstance(stage, int) and 0 <= stage < parallel.pp):
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{parallel.pp - 1}")
    per_stage, results = [], []
    for k in range(parallel.pp):
        results.append(_train_stage(spec, parallel, train, conv, k, dense_group, expert_group, e, workspace,
                                    headroom, bucket_bytes, shard))
        per_stage.append(sum(results[-1][0].values()))
    if stage is None:
        stage = max(range(parallel.pp), key=lambda k: per_stage[k])
    cats, n_local, details = results[stage]
    assumptions = _train_assumptions(conv, train, parallel, headroom, workspace, bucket_bytes)
    assumptions["dp_rank"] = dp_rank
    assumptions["in_flight_microbatches"] = in_flight_microbatches(parallel.schedule, parallel.pp,
                                                                   train.n_microbatches, parallel.vpp, stage)
    return MemoryEstimate("train", cats, _n_params(spec), n_local, assumptions, stage, per_stage,
                          dev["name"] if dev else None, dev["memory_bytes"] if dev else None, details)


@functools.lru_cache(maxsize=64)
def _n_params(spec: ModelSpec) -> int:
    return spec.n_params()


def _train_stage(spec, parallel, train, conv, stage, dense_group, expert_group, e, workspace, headroom, bucket_bytes,
                 shard=("even", 0)):
    t, sp = parallel.tp, parallel.sequence_parallel
    kinds, n_local, biggest_layer = _stage_shapes(spec, parallel.pp, parallel.vpp, parallel.ep, stage, t)
    cats = dict(_kind_states(kinds, conv, train.optimizer, parallel.zero, dense_group, expert_group, *shard))
    layers = stage_layers(spec.n_layers, parallel.pp, parallel.vpp, stage)
    first, last = stage == 0, stage == parallel.pp - 1
    fly = in_flight_microbatches(parallel.schedule, parallel.pp, train.n_microbatches, parallel.vpp, stage)
    by_kind: dict[bool, int] = {}  # every dense layer saves the same bytes, and every MoE layer
    per_layer = {}
    for i in layers:
        kind = spec.is_moe_layer(i)
        if kind not in by_kind:
            by_kind[kind] = _layer_activation_bytes(spec, train, parallel, kind)
        per_layer[i] = by_kind[kind]
    edge_first, edge_last = _edge_bytes(spec, train, parallel)
    first_b = edge_first if first else 0
    last_b = edge_last if last else 0
    cats["activations"] = int(round(sum(per_layer.values()) * fly + first_b * fly + last_b))
    n = train.micro_batch_size * train.seq_len // parallel.cp
    h = spec.hidden_size
    rep = t if sp else 1
    # temporary buffers
    temp = 0
    if last:
        temp += int(n * spec.vocab_size * 4 / t)  # gradient of the fp32 logits
    if train.recompute == "full":
        full = replace(train, recompute="none")
        kinds = {spec.is_moe_layer(i): i for i in layers}.values()
        temp += max(activation_bytes_per_layer(spec, full, parallel, layer=i) for i in kinds)
    if parallel.zero >= 3 and dense_group > 1:
        biggest = biggest_layer
        temp += 2 * nbytes(biggest, conv.param_bits) + nbytes(biggest, max(conv.grad_bits, 16))
    cats["temporary"] = temp
    # communication buffers
    comm = 0
    if dense_group > 1 and parallel.zero < 3:
        comm += min(2 * bucket_bytes, cats["gradients"])
    if t > 1:
        comm += int(n * h * e)
    if parallel.pp > 1:
        comm += int(2 * n * h * e / rep)
    if parallel.cp > 1:
        comm += int(2 * 2 * n * kv_heads_per_rank(spec.n_heads, spec.n_kv_heads, t) * spec.head_dim * e)
    if parallel.ep > 1:
        comm += int(2 * n * spec.top_k * train.capacity_factor * h * e)
    cats["communication"] = comm
    cats["workspace"] = workspace
    cats = _finish(cats, headroom)
    details = {"activation_bytes_per_layer": per_layer[layers[0]], "layers": len(layers),
               "first_stage_edge_bytes": first_b, "last_stage_edge_bytes": last_b, "in_flight": fly}
    return cats, n_local, details


def _train_assumptions(conv, train, parallel, headroom, workspace, bucket_bytes, model_states_only=False) -> dict:
    a = {
        "convention": conv.name,
        "convention_source": conv.source,
        "bytes_per_param": {"parameters": conv.param_bits / 8, "gradients": (conv.grad_bits + conv.grad_fp32_bits) / 8,
                            "master": conv.master_bits / 8, "per_state": conv.state_bits / 8,
                            "step_bytes_per_tensor": conv.step_bytes},
        "optimizer": train.optimizer,
        "zero": parallel.zero,
        "zero_shards_over": parallel.dp * parallel.cp,
        "shard_layout": parallel.shard_layout,
        "parallel": asdict(parallel),
        "headroom_fraction": headroom,
        "workspace_bytes": workspace,
    }
    if model_states_only:
        a["model_states_only"] = True
        a["note"] = "bare parameter count: activations and buffers not estimated; count split evenly over tp*pp"
        return a
    a.update({
        "micro_batch_size": train.micro_batch_size, "seq_len": train.seq_len, "n_microbatches": train.n_microbatches,
        "act_dtype_bytes": train.act_bits() / 8, "recompute": train.recompute, "attention": train.attention,
        "dropout": train.dropout, "activation_model": train.activation_model, "kernels": train.kernels,
        "dp_bucket_bytes": bucket_bytes,
    })
    return a
