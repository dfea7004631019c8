"""Activations: what autograd saves for backward, item by item (the lab's derivation, or Korthikanti et
al. 2022, Table 2), per layer after recompute, and outside the layers (first and last pipeline stage).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit.checks import check_choice, check_divides, positive_int
from labkit.theory.memory.config import ParallelConfig, TrainConfig
from labkit.theory.memory.conventions import RECOMPUTE
from labkit.theory.spec import ModelSpec


@dataclass(frozen=True)
class ActivationItem:
    """One tensor autograd keeps for backward: ``name``, ``nbytes`` (per micro-batch, on one rank), ``where``
    (``layer`` / ``first_stage`` / ``last_stage``), ``core`` (part of core attention: dropped by selective
    recompute), ``note`` (what saves it)."""

    name: str
    nbytes: int
    where: str = "layer"
    core: bool = False
    note: str = ""


def _resolved_dropout(spec: ModelSpec, train: TrainConfig) -> float:
    return float(spec.dropout if train.dropout is None else train.dropout)


def activation_items(spec: ModelSpec, train: TrainConfig, parallel: ParallelConfig | None = None, *,
                     moe_layer: bool = False) -> list[ActivationItem]:
    """What one transformer layer saves for backward, per micro-batch, on one rank (bytes), item by item.

    ``activation_model="korthikanti"``: Korthikanti et al. 2022, Table 2 (GPT block; 16-bit activations,
    1-byte dropout masks in the paper — here ``act_dtype`` bytes and 1-byte masks, or ``act_dtype`` masks with
    ``kernels="cpu"``): with t = tp, s = seq_len/cp, b = micro_batch_size, h = hidden, a = n_heads,
    replicated under TP: LayerNorm inputs 2·sbh, QKV input sbh, fc1 input sbh (16-bit: 10sbh incl. two
    masks); split by t: Q, K, V 3sbh, projection input sbh, GELU input and output 2·(4h)sb (16-bit: 24sbh/t);
    core attention 5as²b/t (softmax output, dropout mask, dropout output). Sequence parallelism also splits
    the replicated part by t. Flash attention drops the s² terms (what selective recompute does).

    ``activation_model="megatron"``: Megatron-LM's own formula (``megatron/training/theoretical_memory_usage.py``,
    ``compute_activation_memory``): sbh·(18 + 4·f/h) bytes per layer for 16-bit activations and 1-byte masks,
    which is Table 2's 34sbh with the MLP's 16sbh generalised to f = ffn_hidden_size, dropout masks always
    counted, and neither GQA (K and V counted at full width) nor SwiGLU's third matrix (two f-wide tensors)
    modelled — the formula as the framework states it. Megatron divides it all by t (it assumes sequence
    parallelism); without it the replicated 10sbh (Table 2) stays whole. Core attention (5as²b/t) only with
    eager attention. MoE layers: f = expert_ffn_hidden_size·top_k·capacity_factor plus router logits (the
    lab's extension; Megatron's formula covers dense layers).

    ``activation_model="lab"``: the lab's derivation, item by item, of what torch 2.13 autograd saves for
    ``labkit.models.Block`` (checked to the byte on CPU by tests/test_measure.py). Per token (n = b·s/cp
    tokens), e = bytes of the activation dtype, q = n_heads·head_dim, kv' = q when GQA repeats K/V to every
    query head (labkit.models does, with repeat_interleave, before the kernel) else n_kv_heads·head_dim:

    * each norm (two per layer): RMSNorm (``F.rms_norm``, decomposed on CPU) saves its input and the
      normalised x (in fp32 when e < 4: the decomposition upcasts) and rstd (fp32): 2h·max(e,4) + 4;
      with ``kernels="cuda"`` the lab assumes the fused kernel (input h·e + rstd 4). LayerNorm saves its input
      h·e and mean, rstd (2·e on CPU, 2·4 on CUDA).
    * the norm output, saved once by the QKV (and by the MLP input) projections: h·e each.
    * RoPE: the per-layer cos/sin rows gathered for the sequence, s·head_dim·e per layer (not per token of
      the batch: they are shared across b).
    * flash (``F.scaled_dot_product_attention`` without dropout, or with dropout on CUDA): q, k, v inputs
      (q + 2kv')·e, output q·e, logsumexp n_heads·4 (fp32). The kernel gives its output q's memory layout:
      with RoPE q is a fresh [B, heads, T, d] tensor, so the output is too and the wo input below is a
      copy; without RoPE q is a transposed view of the wq output, the output is laid out [B, T, heads, d]
      and the wo input is that same storage (counted once).
      eager, and SDPA with dropout on CPU (torch falls back to the math kernel, which upcasts 16-bit inputs
      to fp32): q, k, v (q + 2kv')·e, softmax output b·a·s²·e, and with dropout its mask and output
      2·b·a·s²·e (mask: 1 byte on CUDA); eager also keeps the causal bool mask s² bytes.
    * attention output projection input (a transposed copy): q·e; residual dropout mask h·m.
    * SwiGLU: gate, silu(gate), up, silu·up: 4f·e; GELU: fc_in output and GELU output: 2f·e; MLP residual
      dropout mask h·m.

    Tensor parallelism splits the head- and ffn-sized items by t; sequence parallelism also the rest. MoE
    layers: the MLP items scale by top_k·capacity_factor (tokens processed per token) plus router logits
    n·n_experts·4 — the lab's assumption, not checked against a run.
    """
    parallel = parallel or ParallelConfig()
    t, sp = parallel.tp, parallel.sequence_parallel
    s = train.seq_len // parallel.cp
    b = train.micro_batch_size
    n = b * s
    e = train.act_bits() / 8
    drop = _resolved_dropout(spec, train) > 0
    cpu = train.kernels == "cpu"
    m = e if cpu else 1  # bytes per dropout-mask element
    rep = t if sp else 1  # replicated-under-TP items are split only with sequence parallelism
    h, heads = spec.hidden_size, spec.n_heads
    items: list[ActivationItem] = []

    def add(name, nb, core=False, note=""):
        items.append(ActivationItem(name, int(round(nb)), "layer", core, note))

    if train.activation_model == "megatron":
        return _megatron_items(spec, train, n, h, e, t, rep, moe_layer, add, items)
    if train.activation_model == "korthikanti":
        if moe_layer:
            raise ValueError("activation_model='korthikanti' covers dense GPT blocks only; use 'lab' for MoE")
        f = spec.ffn_hidden_size
        add("layernorm inputs", 2 * n * h * e / rep, note="Table 2: 4sbh")
        add("qkv input", n * h * e / rep)
        add("mlp input", n * h * e / rep)
        if drop:
            add("dropout masks (attention, mlp)", 2 * n * h * m / rep, note="Table 2: 2sbh")
        add("q, k, v", 3 * n * h * e / t)
        add("projection input", n * h * e / t)
        add("gelu input and output", 2 * n * f * e / t)
        if train.attention == "eager":
            add("softmax output", b * heads * s * s * e / t, core=True)
            if drop:
                add("attention dropout mask and output", b * heads * s * s * (m + e) / t, core=True)
        return items

    kv_eff = spec.q_size if spec.n_kv_heads < spec.n_heads else spec.kv_size
    q = spec.q_size
    # norms
    for which in ("attn_norm", "mlp_norm"):
        if spec.norm == "rmsnorm":
            if cpu:
                add(f"{which} input and normalised x", 2 * n * h * max(e, 4) / rep,
                    note="F.rms_norm (CPU decomposition)")
                add(f"{which} rstd", n * 4 / rep)
            else:
                add(f"{which} input", n * h * e / rep, note="fused rms_norm (CUDA)")
                add(f"{which} rstd", n * 4 / rep)
        else:
            add(f"{which} input", n * h * e / rep, note="native_layer_norm")
            add(f"{which} mean, rstd", 2 * n * (e if cpu else 4) / rep)
    add("qkv input", n * h * e / rep, note="norm output, saved by wq/wk/wv")
    add("mlp input", n * h * e / rep, note="norm output, saved by the MLP's input projections")
    if spec.position == "rope":
        add("rope cos/sin", s * spec.head_dim * e, note="gathered per layer, shared across the batch")
    math_fallback = train.attention == "flash" and drop and cpu
    if train.attention == "flash" and not math_fallback:
        add("q, k, v (attention inputs)", n * (q + 2 * kv_eff) * e / t, note="SDPA flash")
        if spec.position == "rope":  # q is a fresh [B, heads, T, d] tensor: the output is too, and wo copies it
            add("attention output", n * q * e / t, core=True)
        add("logsumexp", n * heads * 4 / t, core=True)
    else:
        ea = 4 if math_fallback else e  # the CPU math fallback upcasts 16-bit inputs to fp32
        note = "SDPA math fallback (dropout on CPU)" if math_fallback else "eager attention"
        add("q, k, v (attention inputs)", n * (q + 2 * kv_eff) * ea / t, note=note)
        add("softmax output", b * heads * s * s * ea / t, core=True)
        if drop:
            add("attention dropout mask and output", b * heads * s * s * ((ea if cpu else 1) + ea) / t, core=True)
        if train.attention == "eager":
            add("causal mask", s * s, core=True, note="bool [s, s]")
    aliased = train.attention == "flash" and not math_fallback and spec.position != "rope"
    add("wo input", n * q * e / t, note="the attention output itself (its layout is [B, T, heads, d])" if aliased
        else "transposed copy of the attention output")
    if drop:
        add("residual dropout masks", 2 * n * h * m / rep)
    f = spec.expert_ffn_hidden_size if moe_layer else spec.ffn_hidden_size
    scale = spec.top_k * train.capacity_factor if moe_layer else 1
    if spec.mlp == "swiglu":
        add("swiglu gate, silu, up, product", 4 * n * f * e * scale / t)
    else:
        add("gelu input and output", 2 * n * f * e * scale / t)
    if moe_layer:
        add("router logits", n * spec.n_experts * 4)
    return items


def _megatron_items(spec, train, n, h, e, t, rep, moe_layer, add, items):
    m = 1  # bytes per dropout-mask element, as Megatron's formula counts them
    b, s, heads = train.micro_batch_size, n // train.micro_batch_size, spec.n_heads
    f = spec.ffn_hidden_size
    if moe_layer:
        f = spec.expert_ffn_hidden_size * spec.top_k * train.capacity_factor
    note = "Megatron-LM theoretical_memory_usage.py: sbh(18 + 4f/h)"
    add("layernorm inputs", 2 * n * h * e / rep, note=note)
    add("qkv input", n * h * e / rep)
    add("mlp input", n * h * e / rep)
    add("dropout masks (attention, mlp)", 2 * n * h * m / rep)
    add("q, k, v", 3 * n * h * e / t)
    add("projection input", n * h * e / t)
    add("mlp activations (fc1 output and activation output)", 2 * n * f * e / t)
    if moe_layer:
        add("router logits", n * spec.n_experts * 4)
    if train.attention == "eager":
        add("softmax output", b * heads * s * s * e / t, core=True)
        add("attention dropout mask and output", b * heads * s * s * (m + e) / t, core=True)
    return items


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False,
                       recompute: str = "none") -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022, Table 2 (16-bit activations, dropout):

    =========================  ===============================
    no parallelism             sbh(34 + 5as/h)
    tensor parallel            sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel sbh(34/t + 5as/(ht))
    + selective recompute      drop the 5as/h term
    full recompute             sbh·2
    =========================  ===============================

    ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a`` attention heads, ``t`` TP degree.
    Raises ValueError unless s, b, h, a, t are integers >= 1 and t divides a, or for an unknown recompute.
    """
    s, b, h, a = (positive_int(n, v) for n, v in (("s", s), ("b", b), ("h", h), ("a", a)))
    check_divides("t", t, "a", a)
    check_choice("recompute", recompute, RECOMPUTE)
    if recompute == "full":
        return s * b * h * 2
    scores = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + scores)
    return s * b * h * (10 + 24 / t + scores)


def activation_bytes_per_layer(spec: ModelSpec, train: TrainConfig, parallel: ParallelConfig | None = None,
                               *, layer: int = 0) -> int:
    """Bytes one layer keeps for backward per micro-batch on one rank, after recompute:

    ``none``: the sum of :func:`activation_items`; ``selective``: without the core-attention items
    (Korthikanti et al. 2022, Sec. 5); ``full``: only the layer input, n·h·e (/tp with sequence parallelism;
    Table 2's sbh·2 for 16-bit).
    """
    parallel = parallel or ParallelConfig()
    if train.recompute == "full":
        rep = parallel.tp if parallel.sequence_parallel else 1
        n = train.micro_batch_size * train.seq_len // parallel.cp
        return int(round(n * spec.hidden_size * train.act_bits() / 8 / rep))
    items = activation_items(spec, train, parallel, moe_layer=spec.is_moe_layer(layer))
    if train.recompute == "selective":
        items = [i for i in items if not i.core]
    return sum(i.nbytes for i in items)


def edge_activation_items(spec: ModelSpec, train: TrainConfig,
                          parallel: ParallelConfig | None = None) -> list[ActivationItem]:
    """Activations outside the layers, per micro-batch, on one rank.

    ``activation_model="megatron"``: Megatron-LM's terms as its formula states them (8sb/t token ids and sbh/t
    embedding dropout on the first stage, 4sbh(1 + v/h)/t output layer and loss on the last).

    First stage: token ids (int64, 8 bytes/token; Megatron's 8sb), learned positions (int64 per sequence),
    embedding dropout mask (sbh·m). Last stage: the final norm (as in :func:`activation_items`), the output
    projection input sbh·e, the log-softmax output of the cross-entropy in fp32 (labkit.models.lm_loss
    upcasts the logits) sbv·4/t, targets 8sb and a scalar (Megatron: 4sbh(1 + v/h)/t for 16-bit).
    """
    parallel = parallel or ParallelConfig()
    t, sp = parallel.tp, parallel.sequence_parallel
    rep = t if sp else 1
    s = train.seq_len // parallel.cp
    n = train.micro_batch_size * s
    e = train.act_bits() / 8
    cpu = train.kernels == "cpu"
    m = e if cpu else 1
    h = spec.hidden_size
    if train.activation_model == "megatron":  # theoretical_memory_usage.py, everything divided by t
        return [ActivationItem("token ids", int(round(8 * n / t)), "first_stage", note="Megatron: 8sb/t"),
                ActivationItem("embedding dropout mask", int(round(n * h / t)), "first_stage", note="Megatron: sbh/t"),
                ActivationItem("output layer input and cross-entropy",
                               int(round(4 * n * h * (1 + spec.vocab_size / h) / t)), "last_stage",
                               note="Megatron: 4sbh(1 + v/h)/t")]
    out = [ActivationItem("token ids", 8 * n, "first_stage", note="int64, saved by the embedding")]
    if spec.position == "learned":
        out.append(ActivationItem("positions", 8 * s, "first_stage", note="int64"))
    if _resolved_dropout(spec, train) > 0:
        out.append(ActivationItem("embedding dropout mask", int(round(n * h * m / rep)), "first_stage"))
    if spec.norm == "rmsnorm":
        if cpu:
            out.append(ActivationItem("final norm input and normalised x", int(round(2 * n * h * max(e, 4) / rep)),
                                      "last_stage"))
        else:
            out.append(ActivationItem("final norm input", int(round(n * h * e / rep)), "last_stage"))
        out.append(ActivationItem("final norm rstd", int(round(n * 4 / rep)), "last_stage"))
    else:
        out.append(ActivationItem("final norm input", int(round(n * h * e / rep)), "last_stage"))
        out.append(ActivationItem("final norm mean, rstd", int(round(2 * n * (e if cpu else 4) / rep)), "last_stage"))
    out.append(ActivationItem("output projection input", int(round(n * h * e / rep)), "last_stage"))
    out.append(ActivationItem("log-softmax output (fp32)", int(round(n * spec.vocab_size * 4 / t)), "last_stage"))
    out.append(ActivationItem("targets and loss scalar", 8 * n + 4, "last_stage"))
    return out



@functools.lru_cache(maxsize=1024)
def _layer_activation_bytes(spec: ModelSpec, train: TrainConfig, parallel: ParallelConfig, moe: bool) -> int:
    """:func:`activation_bytes_per_layer` of the dense (``moe`` False) or MoE layers: all layers of a kind save
    the same bytes."""
    layer = next(i for i in range(spec.n_layers) if spec.is_moe_layer(i) == moe)
    return activation_bytes_per_layer(spec, train, parallel, layer=layer)


@functools.lru_cache(maxsize=1024)
def _edge_bytes(spec: ModelSpec, train: TrainConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """(first-stage, last-stage) bytes of :func:`edge_activation_items`."""
    edges = edge_activation_items(spec, train, parallel)
    return (sum(i.nbytes for i in edges if i.where == "first_stage"),
            sum(i.nbytes for i in edges if i.where == "last_stage"))
