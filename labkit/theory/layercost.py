"""The planner's compute, priced kernel by kernel at a mesh's per-rank shapes (:mod:`labkit.theory.kernels`).

Pure Python (no torch). One transformer layer of one micro-batch on one rank is the GEMMs, the attention kernel
and the memory-bound kernels it launches, each priced by :func:`labkit.theory.kernels.gemm_s` /
:func:`~labkit.theory.kernels.attention_s` / :func:`~labkit.theory.kernels.memory_s` at the shapes the mesh
leaves it. So a small per-rank GEMM (large tp, short sequence per cp rank), a ring-attention step of a few
hundred tokens and a stage of two layers cost what such kernels cost, not a fixed fraction of the peak.

Shapes, with t = b·s/cp tokens of the micro-batch on a rank, h hidden, a heads, g kv heads, d head_dim, f ffn,
tp-sharded as Megatron-LM shards them (Shoeybi et al. 2019, Sec. 3: QKV and the MLP's first GEMM by column, the
output projections by row; sequence parallelism gathers the t tokens before each and scatters after,
Korthikanti et al. 2022, Sec. 4.2.2):

* QKV ``[t, h] @ [h, (a + 2g)·d/tp]``, out projection ``[t, a·d/tp] @ [a·d/tp, h]``, MLP ``[t, h] @ [h, 2f/tp]``
  (SwiGLU's gate and up, fused) and ``[t, f/tp] @ [f/tp, h]`` (GELU: ``f/tp`` for the first);
* each GEMM's backward is two GEMMs of the same FLOPs: the input gradient ``[t, n] @ [n, k]`` and the weight
  gradient ``[k, t] @ [t, n]`` (the weight-gradient GEMM's inner dimension is the tokens);
* flash attention of a/tp heads: cp = 1 one causal kernel of s x s; cp > 1 the ring / zig-zag schedule of
  context parallelism (Liu et al. 2023, Ring Attention; Megatron-LM's zig-zag chunks): cp kernels per layer,
  one causal diagonal block of s/cp x s/cp and cp - 1 half blocks (s/(2cp) rows against s/cp keys), each with
  its own launch: a short chunk per rank pays latency and wave quantisation, not only FLOPs;
* MoE layers: the router ``[t, h] @ [h, E]``, then E/ep experts on this rank, each ``ep·t·top_k/E`` tokens
  (balanced routing) as one batched GEMM per projection, and the permutation's gather/scatter traffic;
* memory-bound kernels: two norms, two residual adds, the rotary embedding of q and k, the MLP activation (on
  t/tp tokens where sequence parallelism splits them), twice the bytes backward;
* the last stage adds the output head ``[t, h] @ [h, V/tp]`` and the cross-entropy over the logits; the first
  the embedding lookup;
* recompute: ``full`` runs every layer's forward again in backward, ``selective`` the attention core
  (Korthikanti et al. 2022, Sec. 5).

Results are cached per (model, device, micro-batch, sequence, tp, cp, ep, ...): every mesh of a plan with the
same per-rank shapes shares one pricing (benchmarks/planner_speed.py).
"""

from __future__ import annotations

import functools
import math

from labkit.theory import kernels as K
from labkit.theory.spec import ModelSpec

#: bytes per parameter an Adam step moves (fp32 master weight, gradient, two moments read; master, moments and
#: the bf16 copy written): 4·4 + 3·4 + 2 = 30 (mixed-precision Adam, Micikevicius et al. 2018 + Kingma & Ba)
ADAM_BYTES_PER_PARAM = 30


def _gemm_fb(m, n, k, kd) -> tuple[float, float]:
    """(forward, backward) seconds of one weight GEMM [m, k] @ [k, n] and its two backward GEMMs."""
    peak, bw, p = kd
    g = functools.partial(K.gemm_s, peak_flops=peak, memory_gbps=bw, params=p)
    return g(m, n, k), g(m, k, n) + g(k, n, m)


def _batched_fb(batch, m, n, k, kd) -> tuple[float, float]:
    peak, bw, p = kd
    g = functools.partial(K.gemm_s, batch=batch, peak_flops=peak, memory_gbps=bw, params=p)
    return g(m, n, k), g(m, k, n) + g(k, n, m)


def _attn_fb(b, heads, kv_heads, s, cp, d, kd) -> tuple[float, float]:
    peak, bw, p = kd
    a = functools.partial(K.attention_s, peak_flops=peak, memory_gbps=bw, params=p, kv_heads=kv_heads)
    if cp == 1:
        return a(b, heads, s, s, d, causal=True), a(b, heads, s, s, d, causal=True, backward=True)
    c = s / cp
    fwd = a(b, heads, c, c, d, causal=True) + (cp - 1) * a(b, heads, max(1, c / 2), c, d, causal=False)
    bwd = (a(b, heads, c, c, d, causal=True, backward=True)
           + (cp - 1) * a(b, heads, max(1, c / 2), c, d, causal=False, backward=True))
    return fwd, bwd


def _mem(nbytes, kd) -> float:
    peak, bw, p = kd
    return K.memory_s(nbytes, peak_flops=peak, memory_gbps=bw, params=p)


@functools.lru_cache(maxsize=8192)
def microbatch_costs(spec: ModelSpec, kd: tuple, b: int, s: int, tp: int, cp: int, ep: int, sp: bool,
                     e: int = 2) -> dict:
    """Seconds of one micro-batch of ``b`` sequences of ``s`` tokens on one rank of a (tp, cp, ep) mesh:

    ``dense`` / ``moe``: (forward, backward, attention-core forward) of one dense / MoE layer; ``head``:
    (forward, backward) of the output head, final norm and cross-entropy; ``embed``: (forward, backward) of the
    embedding lookup. ``kd`` = (peak FLOP/s, memory GB/s, :class:`~labkit.theory.kernels.KernelParams`);
    ``e`` bytes per activation element. The shapes: module docstring."""
    h, a, g, d = spec.hidden_size, spec.n_heads, spec.n_kv_heads, spec.head_dim
    t = max(1, b * s // cp)
    aq, gk = a / tp, max(1.0, g / tp)
    ts = t / tp if sp and tp > 1 else t  # tokens a norm / residual sees
    # attention block
    qkv = _gemm_fb(t, (aq + 2 * gk) * d, h, kd)
    out = _gemm_fb(t, h, aq * d, kd)
    core = _attn_fb(b, aq, gk, s, cp, d, kd)
    mem_attn = (_mem(2 * ts * h * e, kd)  # norm
                + _mem(3 * ts * h * e, kd)  # residual add
                + _mem(2 * t * (aq + gk) * d * e, kd))  # rotary embedding of q and k
    attn_f = qkv[0] + out[0] + core[0] + mem_attn
    attn_b = qkv[1] + out[1] + core[1] + 2 * mem_attn

    def mlp(ffn_tp, tokens, batch=1):
        n_up = 2 * ffn_tp if spec.mlp == "swiglu" else ffn_tp
        up = _batched_fb(batch, tokens, n_up, h, kd)
        down = _batched_fb(batch, tokens, h, ffn_tp, kd)
        act = _mem(((3 if spec.mlp == "swiglu" else 2) * tokens * ffn_tp * batch) * e, kd)
        return up[0] + down[0] + act, up[1] + down[1] + 2 * act

    mem_mlp = _mem(2 * ts * h * e, kd) + _mem(3 * ts * h * e, kd)  # norm, residual add
    dense_f, dense_b = mlp(spec.ffn_hidden_size / tp, t)
    out_d = {"dense": (attn_f + dense_f + mem_mlp, attn_b + dense_b + 2 * mem_mlp, core[0])}
    if spec.is_moe:
        n_e = spec.n_experts
        local = max(1, n_e // ep)
        tok = max(1, math.ceil(ep * t * spec.top_k / n_e))
        router = _gemm_fb(t, n_e, h, kd)
        ex_f, ex_b = mlp(spec.expert_ffn_hidden_size / tp, tok, local)
        perm = 2 * _mem(2 * t * spec.top_k * h * e, kd)
        out_d["moe"] = (attn_f + router[0] + ex_f + perm + mem_mlp,
                        attn_b + router[1] + ex_b + 2 * perm + 2 * mem_mlp, core[0])
    else:
        out_d["moe"] = out_d["dense"]
    v = spec.vocab_size / tp
    head = _gemm_fb(t, v, h, kd)
    xent = _mem(3 * t * v * 4, kd)  # fp32 logits: softmax read, loss, gradient written
    norm = _mem(2 * ts * h * e, kd)
    out_d["head"] = (head[0] + xent + norm, head[1] + xent + 2 * norm)
    emb = _mem(2 * t * h * e, kd)
    out_d["embed"] = (emb, 2 * emb)
    return out_d


def stage_seconds(spec: ModelSpec, costs: dict, split, recompute: str) -> list[float]:
    """Seconds of one micro-batch's forward + backward on each pipeline stage of ``split`` (layers per stage;
    MoE layers by the model's ``moe_layer_freq``, in order), recompute included; the first stage adds the
    embedding, the last the output head."""
    out, first = [], 0
    for i, n in enumerate(split):
        t = 0.0
        for layer in range(first, first + n):
            f, bwd, core = costs["moe" if spec.is_moe_layer(layer) else "dense"]
            t += f + bwd + (f if recompute == "full" else core if recompute == "selective" else 0.0)
        first += n
        if i == 0:
            t += sum(costs["embed"])
        if i == len(split) - 1:
            hf, hb = costs["head"]
            t += hf + hb + (hf if recompute == "full" else 0.0)
        out.append(t)
    return out


def optimizer_seconds(n_params_local: float, shards: int, kd: tuple) -> float:
    """Seconds of one Adam step over the rank's ``n_params_local / shards`` parameters (ZeRO >= 1 shards the
    optimizer over dp·cp): :data:`ADAM_BYTES_PER_PARAM` bytes each, memory-bound (a multi-tensor-apply launch
    per ~2^16-element chunk list is folded into the launch cost)."""
    return _mem(n_params_local / max(1, shards) * ADAM_BYTES_PER_PARAM, kd)
