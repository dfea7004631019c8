"""The training budget per rank: :func:`train_memory`, stage by stage (parameters, gradients, optimizer
state, activations, temporary and communication buffers, workspace, headroom).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, replace

from labkit.checks import positive_int
from labkit.theory.memory.activations import _edge_bytes, _layer_activation_bytes, activation_bytes_per_layer
from labkit.theory.memory.budget import (
    MemoryEstimate,
    _device_info,
    _finish,
    _resolve_model,
    capacity_note,
    usable_bytes,
)
from labkit.theory.memory.config import (
    ParallelConfig,
    TrainConfig,
    check_spec_bounds,
    kv_heads_per_rank,
    padded_spec,
)
from labkit.theory.memory.conventions import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_HEADROOM,
    _ceil_div,
    check_headroom,
    nbytes,
)
from labkit.theory.memory.params import _kind_states, _model_states, _stage_shapes
from labkit.theory.memory.stages import _in_flight, _stage_layer_ids, format_split, in_flight_microbatches
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

    Pipeline stages may be uneven (``parallel.layers_per_stage``, or the split derived by
    :func:`labkit.theory.memory.stages.split_layers` when pp does not divide n_layers); every stage is
    computed and the heaviest one decides the peak. The vocabulary is padded for tp as Megatron-LM pads it
    (:func:`labkit.theory.memory.config.padded_vocab_size`; ``assumptions["vocab_size"]`` says so).

    Raises ValueError for an invalid model, configuration, device, a bad stage split, or degrees that do not
    divide the model (every "valid" list passes every rule), in bounded time whatever the magnitudes.
    """
    parallel = parallel or ParallelConfig()
    train = train or TrainConfig()
    headroom = check_headroom(headroom)
    bucket_bytes = positive_int("bucket_bytes", bucket_bytes, minimum=0)
    spec = _resolve_model(model)
    is_spec = isinstance(spec, ModelSpec)
    original_vocab = None
    if is_spec:
        check_spec_bounds(spec)
        original_vocab = spec.vocab_size
        spec = padded_spec(spec, parallel.tp)
    parallel.check(spec if is_spec else None, train.seq_len)
    conv = train.resolved_convention()
    dev, workspace = _device_info(device, workspace_bytes)
    dense_group = parallel.dp * parallel.cp
    expert_group = max(1, dense_group // parallel.ep)
    if not (isinstance(dp_rank, int) and not isinstance(dp_rank, bool) and 0 <= dp_rank < dense_group):
        raise ValueError(f"dp_rank={dp_rank!r} must be a ZeRO shard index in 0..{dense_group - 1} (dp*cp ranks)")
    shard = (parallel.shard_layout, dp_rank)
    capacity = usable_bytes(dev) if dev else None

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
                              dev["name"] if dev else None, capacity)

    if stage is not None and not (isinstance(stage, int) and 0 <= stage < parallel.pp):
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{parallel.pp - 1}")
    split = parallel.split(spec.n_layers)
    per_stage, results = [], []
    for k in range(parallel.pp):
        parts = _stage_parts(spec, parallel, train, conv, k, split, workspace, bucket_bytes, shard)
        fly = in_flight_microbatches(parallel.schedule, parallel.pp, train.n_microbatches, parallel.vpp, k)
        cats = _stage_cats(parts, fly, headroom)
        results.append((cats, parts, fly))
        per_stage.append(sum(cats.values()))
    if stage is None:
        stage = max(range(parallel.pp), key=lambda k: per_stage[k])
    cats, parts, fly = results[stage]
    details = {"activation_bytes_per_layer": parts["per_layer"], "layers": parts["n_layers"],
               "first_stage_edge_bytes": parts["first_b"], "last_stage_edge_bytes": parts["last_b"], "in_flight": fly}
    assumptions = _train_assumptions(conv, train, parallel, headroom, workspace, bucket_bytes)
    assumptions["dp_rank"] = dp_rank
    assumptions["in_flight_microbatches"] = fly
    assumptions["layers_per_stage"] = split
    assumptions["layers_per_stage_text"] = format_split(split)
    assumptions["layers_per_stage_given"] = parallel.layers_per_stage is not None
    assumptions["vocab_size"] = spec.vocab_size
    assumptions["vocab_padded_from"] = original_vocab if original_vocab != spec.vocab_size else None
    if dev:
        assumptions["device_capacity"] = capacity_note(dev)
    return MemoryEstimate("train", cats, _n_params(spec), parts["n_local"], assumptions, stage, per_stage,
                          dev["name"] if dev else None, capacity, details)


def train_peaks(spec: ModelSpec, parallel: ParallelConfig, train: TrainConfig, schedules, *,
                headroom: float = DEFAULT_HEADROOM, workspace_bytes: int = 0,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[int, int, int]]:
    """The peak of :func:`train_memory` for several pipeline schedules at once, fast: for each ``(schedule,
    vpp)`` of ``schedules``, ``(total_bytes, stage, n_params_local)`` equal to
    ``train_memory(spec, replace(parallel, schedule=schedule, vpp=vpp), train, headroom=headroom,
    workspace_bytes=workspace_bytes)``'s ``total_bytes``, ``stage`` and ``n_params_local`` (tests/test_memory.py
    checks the equality). Used by the planner, which scores every mesh.

    Only the stages that can hold the peak are computed: the first, the last, and of the middle stages the
    first with each distinct layer count. A middle stage's bytes grow with its layer count and, at equal
    count, never grow with its index (it holds the same kinds of tensors, and
    :func:`~labkit.theory.memory.stages.in_flight_microbatches` never grows with the index), so no other
    stage can be higher. MoE models with dense layers between the MoE ones (moe_layer_freq > 1) compute every
    stage (which layers a stage holds then matters). ``spec`` must already be padded
    (:func:`labkit.theory.memory.config.padded_spec`) and ``parallel`` checked against it.
    """
    conv = train.resolved_convention()
    shard = (parallel.shard_layout, 0)
    out = []
    parts_by_vpp: dict = {}
    moe_mixed = spec.is_moe and spec.moe_layer_freq > 1
    split = parallel.split(spec.n_layers)
    m, pp = train.n_microbatches, parallel.pp
    for schedule, vpp in schedules:
        if min(split) < vpp:
            raise ValueError(f"stage split {format_split(split)} puts {min(split)} layer(s) on a stage, fewer than "
                             f"vpp={vpp} model chunks")
        key = vpp if moe_mixed else 1
        if key not in parts_by_vpp:
            ppar = replace(parallel, schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp) if moe_mixed else parallel
            stages = range(pp) if moe_mixed else _peak_candidates(split)
            parts_by_vpp[key] = {k: _stage_parts(spec, ppar, train, conv, k, split, workspace_bytes, bucket_bytes,
                                                 shard) for k in stages}
        best = None
        for k, parts in parts_by_vpp[key].items():
            # what _stage_cats + _finish give, summed: the other categories, the activations, the headroom
            act = int(round(parts["act_layers"] * _in_flight(schedule, pp, m, vpp, k) + parts["first_b"]
                            * _in_flight(schedule, pp, m, vpp, k) + parts["last_b"]))
            sub = parts["base_sub"] + act
            total = sub + int(round(sub * headroom))
            if best is None or total > best[0]:
                best = (total, k, parts["n_local"])
        out.append(best)
    return out


def _one_microbatch(train: TrainConfig) -> TrainConfig:
    return train if train.n_microbatches == 1 else replace(train, n_microbatches=1)


@functools.lru_cache(maxsize=1024)
def _no_recompute(train: TrainConfig) -> TrainConfig:
    return replace(train, recompute="none")


@functools.lru_cache(maxsize=1024)
def _act_par(tp: int, cp: int, sp: bool) -> ParallelConfig:
    return ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp)


def _peak_candidates(split: tuple[int, ...]) -> list[int]:
    pp = len(split)
    out = {0, pp - 1}
    seen = set()
    for k in range(1, pp - 1):
        if split[k] not in seen:
            seen.add(split[k])
            out.add(k)
    return sorted(out)


@functools.lru_cache(maxsize=64)
def _n_params(spec: ModelSpec) -> int:
    return spec.n_params()


def _stage_parts(spec, parallel, train, conv, stage, split, workspace, bucket_bytes, shard=("even", 0)) -> dict:
    """Everything of a stage's budget but the schedule: model states, the activation bytes of one micro-batch
    of its layers (``act_layers``) and of its edges (``first_b``, ``last_b``), temporary and communication
    buffers, workspace. :func:`_stage_cats` applies the in-flight count and the headroom."""
    t, sp = parallel.tp, parallel.sequence_parallel
    dense_group = parallel.dp * parallel.cp
    expert_group = max(1, dense_group // parallel.ep)
    kinds, n_local, biggest_layer = _stage_shapes(spec, parallel.pp, parallel.vpp, parallel.ep, stage, t, split)
    cats = dict(_kind_states(kinds, conv, train.optimizer, parallel.zero, dense_group, expert_group, *shard))
    layers = _stage_layer_ids(split, parallel.vpp)[stage]
    first, last = stage == 0, stage == parallel.pp - 1
    act_par = _act_par(t, parallel.cp, sp)  # all that the activations depend on
    act_train = _one_microbatch(train)  # what activations depend on, as a cache key
    n_moe = sum(1 for i in layers if spec.is_moe_layer(i)) if spec.is_moe else 0
    counts = {False: len(layers) - n_moe, True: n_moe}
    # every dense layer saves the same bytes, and every MoE layer
    by_kind = {kind: _layer_activation_bytes(spec, act_train, act_par, kind) for kind, c in counts.items() if c}
    act_layers = sum(by_kind[kind] * c for kind, c in counts.items() if c)
    edge_first, edge_last = _edge_bytes(spec, act_train, act_par)
    first_b = edge_first if first else 0
    last_b = edge_last if last else 0
    n = train.micro_batch_size * train.seq_len // parallel.cp
    h = spec.hidden_size
    e = train.act_bits() / 8
    rep = t if sp else 1
    # temporary buffers
    temp = 0
    if last:
        temp += int(n * spec.vocab_size * 4 / t)  # gradient of the fp32 logits
    if train.recompute == "full":
        full = _no_recompute(train)
        temp += max(_full_layer_bytes(spec, _one_microbatch(full), act_par, kind) for kind in by_kind)
    if parallel.zero >= 3 and dense_group > 1:
        if conv.largest_layer_bytes is not None:  # the convention's own term (DeepSpeed's 4 x largest layer)
            temp += int(round(conv.largest_layer_bytes * biggest_layer))
        else:
            temp += 2 * nbytes(biggest_layer, conv.param_bits) + nbytes(biggest_layer, max(conv.grad_bits, 16))
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
    base_sub = sum(int(v) for k, v in cats.items() if k not in ("headroom", "activations"))
    return {"cats": cats, "act_layers": act_layers, "first_b": first_b, "last_b": last_b, "n_local": n_local,
            "base_sub": base_sub,
            "n_layers": len(layers), "per_layer": by_kind[spec.is_moe_layer(layers[0])]}


def _stage_cats(parts: dict, fly: float, headroom: float) -> dict[str, int]:
    cats = dict(parts["cats"])
    cats["activations"] = int(round(parts["act_layers"] * fly + parts["first_b"] * fly + parts["last_b"]))
    return _finish(cats, headroom)


@functools.lru_cache(maxsize=1024)
def _full_layer_bytes(spec, train, act_par, moe: bool) -> int:
    layer = next(i for i in range(spec.n_layers) if spec.is_moe_layer(i) == moe)
    return activation_bytes_per_layer(spec, train, act_par, layer=layer)


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
