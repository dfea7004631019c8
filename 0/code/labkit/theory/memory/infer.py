"""The serving budget per rank: :func:`infer_memory` (resident weights, KV cache, prefill workspace,
communication buffers, headroom) and :func:`kv_cache_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from labkit.checks import check_divides, positive_int
from labkit.theory.memory.budget import MemoryEstimate, _device_info, _finish, _resolve_model, usable_bytes
from labkit.theory.memory.config import InferConfig, ParallelConfig, check_spec_bounds, kv_heads_per_rank, padded_spec
from labkit.theory.memory.conventions import (
    DEFAULT_HEADROOM,
    QUANT_GROUP,
    _ceil_div,
    check_headroom,
    dtype_bits,
    nbytes,
)
from labkit.theory.memory.params import local_param_tensors
from labkit.theory.spec import ModelSpec


def kv_cache_bytes(spec: ModelSpec, tokens: int, kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> int:
    """KV cache bytes on one rank: 2 (K and V) · n_layers/pp · kv heads per rank · head_dim · bytes per
    element · tokens (Pope et al. 2022, Sec. 2); kv heads per rank = n_kv_heads/tp, or 1 when the heads are
    replicated (tp a multiple of n_kv_heads, :func:`kv_heads_per_rank`). ``tokens`` = concurrent sequences ×
    context length.

    Raises ValueError if tp neither divides n_kv_heads nor is a multiple of it (or does not divide n_heads),
    or pp does not divide n_layers.
    """
    heads = kv_heads_per_rank(spec.n_heads, spec.n_kv_heads, tp)
    check_divides("pp", pp, "n_layers", spec.n_layers)
    tokens = positive_int("tokens", tokens, minimum=0)
    return nbytes(2 * (spec.n_layers // pp) * heads * spec.head_dim * tokens, dtype_bits(kv_dtype))



def infer_memory(model, parallel: ParallelConfig | None = None, infer: InferConfig | None = None, *,
                 device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                 workspace_bytes: int | None = None) -> MemoryEstimate:
    """Predicted serving memory per rank, by category (bytes), on the pipeline stage with the highest peak.

    * parameters — every local tensor at ``weight_dtype`` (int8/int4 add one fp16 scale per
      :data:`QUANT_GROUP` weights; the lab quantises every tensor, embeddings and norms included).
    * kv_cache — :func:`kv_cache_bytes` for batch × (prompt + output) tokens, split by tp (kv heads
      replicated when tp > n_kv_heads: :func:`kv_heads_per_rank`), cp, and pp by the stage's layers (the
      stage split of :meth:`ParallelConfig.split`: uneven when pp does not divide n_layers).
    * workspace — the largest prefill transient of one layer (lab assumption): n·(h + q/t + 2kv' +
      max(2q/t, 3f/t))·e (kv' = kv heads per rank × head_dim) with n = ``prefill_tokens`` (default one
      prompt), plus the eager score matrix (n/s sequences)·a/t·s²·e, plus the fp32 logits of one token per
      sequence batch·v/t·4; plus ``workspace_bytes`` (None -> 1 GiB with a device, else 0).
    * communication — one n·h·e buffer for TP all-reduce, 2·n·h·e send/recv for PP.
    * headroom — ``headroom`` × the rest.

    Raises ValueError as :func:`train_memory`.
    """
    parallel = parallel or ParallelConfig()
    infer = infer or InferConfig()
    headroom = check_headroom(headroom)
    spec = _resolve_model(model)
    if not isinstance(spec, ModelSpec):
        raise ValueError("mode 'infer' needs a model spec (--model), not a bare parameter count: the KV cache "
                         "depends on layers and heads")
    spec = padded_spec(check_spec_bounds(spec), parallel.tp)
    parallel.check(spec, infer.prompt_len if parallel.cp > 1 else None)
    split = parallel.split(spec.n_layers)
    dev, workspace = _device_info(device, workspace_bytes)
    wbits = dtype_bits(infer.weight_dtype)
    e = dtype_bits(infer.act_dtype) / 8
    t = parallel.tp
    per_stage, best = [], None
    for stage in range(parallel.pp):
        tensors = local_param_tensors(spec, parallel, stage)
        n_local = sum(math.prod(x.local_shape(t)) for x in tensors)
        cats = {"parameters": nbytes(n_local, wbits)}
        if infer.weight_dtype in ("int8", "int4"):
            cats["parameters"] += 2 * sum(_ceil_div(math.prod(x.local_shape(t)), QUANT_GROUP) for x in tensors)
        n_stage_layers = split[stage]
        kv_heads = kv_heads_per_rank(spec.n_heads, spec.n_kv_heads, t)
        cats["kv_cache"] = nbytes(2 * n_stage_layers * kv_heads * spec.head_dim * infer.batch
                                  * _ceil_div(infer.context_len, parallel.cp), infer.kv_bits())
        s = infer.prompt_len // parallel.cp
        n = (infer.prefill_tokens or infer.prompt_len) // parallel.cp
        seqs = max(1, n // s)
        q, f, h = spec.q_size, spec.ffn_hidden_size, spec.hidden_size
        if spec.is_moe:
            f = spec.expert_ffn_hidden_size * spec.top_k
        ws = n * (h + q / t + 2 * kv_heads * spec.head_dim + max(2 * q / t, 3 * f / t)) * e
        if infer.attention == "eager":
            ws += seqs * spec.n_heads / t * s * infer.prompt_len * e
        if stage == parallel.pp - 1:
            ws += infer.batch * spec.vocab_size / t * 4
        cats["workspace"] = int(round(ws)) + workspace
        comm = 0
        if t > 1:
            comm += int(n * h * e)
        if parallel.pp > 1:
            comm += int(2 * n * h * e)
        cats["communication"] = comm
        cats = _finish(cats, headroom)
        per_stage.append(sum(cats.values()))
        if best is None or per_stage[-1] > sum(best[0].values()):
            best = (cats, n_local, stage)
    cats, n_local, stage = best
    assumptions = {"weight_dtype": infer.weight_dtype, "kv_dtype_bytes": infer.kv_bits() / 8,
                   "act_dtype": infer.act_dtype, "batch": infer.batch, "prompt_len": infer.prompt_len,
                   "output_len": infer.output_len, "attention": infer.attention, "parallel": asdict(parallel),
                   "prefill_tokens": infer.prefill_tokens or infer.prompt_len,
                   "quant_group": QUANT_GROUP if infer.weight_dtype in ("int8", "int4") else None,
                   "headroom_fraction": headroom, "workspace_bytes": workspace,
                   "kv_heads_per_rank": kv_heads_per_rank(spec.n_heads, spec.n_kv_heads, t),
                   "kv_formula": "2 * n_layers/pp * kv_heads_per_rank * head_dim * bytes * batch * (prompt + "
                                 "output); kv_heads_per_rank = n_kv_heads/tp, or 1 when tp > n_kv_heads (replicated)"}
    return MemoryEstimate("infer", cats, spec.n_params(), n_local, assumptions, stage, per_stage,
                          dev["name"] if dev else None, usable_bytes(dev) if dev else None)
