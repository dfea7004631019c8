"""What a prediction is asked about: the parallel degrees (:class:`ParallelConfig`, with the rules that
make them divide a model), a training step (:class:`TrainConfig`) and a serving workload (:class:`InferConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.checks import divisors as _divisors
from labkit.theory.memory.conventions import (
    ACTIVATION_MODELS,
    ATTENTION,
    DTYPE_BITS,
    KERNELS,
    OPTIMIZERS,
    RECOMPUTE,
    SCHEDULES,
    SHARD_LAYOUTS,
    Convention,
    dtype_bits,
    get_convention,
)
from labkit.theory.spec import ModelSpec


def kv_heads_per_rank(n_heads: int, n_kv_heads: int, tp: int) -> int:
    """KV heads each tensor-parallel rank holds (weights wk/wv and the KV cache).

    * tp divides n_kv_heads: the heads are split, n_kv_heads/tp per rank;
    * n_kv_heads < tp and n_kv_heads divides tp: each rank keeps the one kv head its n_heads/tp query heads
      use, replicated on tp/n_kv_heads ranks (Megatron-LM's GQA with tp > num_query_groups; vLLM's
      ``QKVParallelLinear``; labkit.theory.tensor ``kv_plan`` "replicate").

    Raises ValueError when tp does not divide n_heads, or neither divides the other (n_kv_heads, tp), naming
    the valid tp.
    """
    n_heads, n_kv_heads = positive_int("n_heads", n_heads), positive_int("n_kv_heads", n_kv_heads)
    check_divides("tp", tp, "n_heads", n_heads)
    if n_kv_heads % tp == 0:
        return n_kv_heads // tp
    if tp % n_kv_heads == 0:
        return 1
    valid = [d for d in _divisors(n_heads) if n_kv_heads % d == 0 or d % n_kv_heads == 0]
    raise ValueError(f"tp={tp} neither divides n_kv_heads={n_kv_heads} (to split the kv heads) nor is a multiple "
                     f"of it (to replicate them); valid tp: {', '.join(map(str, valid))}")


# ------------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees of a run: ``dp`` (data), ``tp`` (tensor), ``pp`` (pipeline), ``cp`` (context),
    ``ep`` (expert, carved out of dp·cp as in Megatron-LM), ``zero`` stage 0-3 (FSDP = 3) over dp·cp,
    ``sequence_parallel`` (Korthikanti et al. 2022), ``vpp`` model chunks per pipeline rank and ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved``; vpp > 1 means interleaved); ``shard_layout`` how ZeRO splits each
    tensor over dp·cp (``even``: ceil(numel/N) per rank; ``dim0``: FSDP2's dim-0 chunks, see
    :func:`shard_numel`).

    World size = dp · tp · pp · cp. Raises ValueError for non-positive degrees, an unknown schedule or shard
    layout, a zero stage outside 0..3, ``interleaved`` with vpp < 2, or vpp > 1 with another schedule.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    vpp: int = 1
    schedule: str = "1f1b"
    shard_layout: str = "even"

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        check_choice("zero", self.zero, (0, 1, 2, 3))
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("shard_layout", self.shard_layout, SHARD_LAYOUTS)
        if self.schedule == "interleaved" and self.vpp < 2:
            raise ValueError(f"schedule='interleaved' needs vpp >= 2 model chunks per rank, got vpp={self.vpp}")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise ValueError(f"vpp={self.vpp} needs schedule='interleaved', got schedule={self.schedule!r}")

    @property
    def world_size(self) -> int:
        """dp · tp · pp · cp (ep is carved out of dp·cp and adds no ranks)."""
        return self.dp * self.tp * self.pp * self.cp

    def check(self, spec: ModelSpec | None, seq_len: int | None = None) -> None:
        """Raise ValueError unless the degrees split ``spec`` (and ``seq_len``) evenly: tp divides n_heads,
        ffn_hidden_size (and the experts' ffn) and vocab_size, and tp divides n_kv_heads or is a multiple of
        it (kv heads replicated, :func:`kv_heads_per_rank`); pp·vpp divides n_layers; ep divides n_experts
        and dp·cp; cp divides seq_len."""
        if seq_len is not None and self.cp > 1:
            check_divides("cp", self.cp, "seq_len", seq_len)
        if spec is None:
            if self.ep > 1 or self.cp > 1:
                raise ValueError(f"ep={self.ep} / cp={self.cp} need a model spec (a bare parameter count has no "
                                 "experts or sequence)")
            return
        kv_heads_per_rank(spec.n_heads, spec.n_kv_heads, self.tp)
        for size_name in ("ffn_hidden_size", "vocab_size"):
            check_divides("tp", self.tp, size_name, getattr(spec, size_name))
        if spec.is_moe:
            check_divides("tp", self.tp, "expert_ffn_hidden_size", spec.expert_ffn_hidden_size)
        if self.vpp > 1:
            check_divides("pp*vpp", self.pp * self.vpp, "n_layers", spec.n_layers,
                          hint=f"pp={self.pp} stages x vpp={self.vpp} chunks each")
        else:
            check_divides("pp", self.pp, "n_layers", spec.n_layers)
        if self.ep > 1:
            if not spec.is_moe:
                raise ValueError(f"ep={self.ep} needs a mixture-of-experts model; {spec.name!r} is dense "
                                 "(n_experts=0); valid ep: 1")
            check_divides("ep", self.ep, "n_experts", spec.n_experts)
            check_divides("ep", self.ep, "dp*cp", self.dp * self.cp,
                          hint="expert parallelism is carved out of the data-parallel ranks")


@dataclass(frozen=True)
class TrainConfig:
    """What a training step holds in memory besides the model.

    micro_batch_size, seq_len (tokens per sequence), n_microbatches (per step, per pipeline);
    convention (bytes per parameter, :data:`CONVENTIONS`) with optional overrides ``param_dtype``,
    ``grad_dtype``, ``master_weights`` (fp32 master copy on/off), ``optimizer_dtype``;
    optimizer (``adamw``; ``sgd`` with momentum; ``adafactor``: factored second moment, no momentum, Shazeer
    & Stern 2018); recompute (``none`` / ``selective`` / ``full``); attention (``eager`` materialises the
    scores; ``flash`` does not); dropout (None -> the model's); act_dtype (None -> the parameter dtype);
    activation_model (``lab``: what torch autograd saves for labkit.models, see :func:`activation_items`;
    ``korthikanti``: Table 2 of Korthikanti et al. 2022); kernels (``cuda`` or ``cpu``: which torch
    kernels' saving behaviour the lab model assumes, see :func:`activation_items`); capacity_factor (MoE).
    """

    micro_batch_size: int = 1
    seq_len: int = 2048
    n_microbatches: int = 1
    convention: str = "zero"
    param_dtype: str | None = None
    grad_dtype: str | None = None
    master_weights: bool | None = None
    optimizer_dtype: str | None = None
    optimizer: str = "adamw"
    recompute: str = "none"
    attention: str = "flash"
    dropout: float | None = None
    act_dtype: str | None = None
    activation_model: str = "lab"
    kernels: str = "cuda"
    capacity_factor: float = 1.0

    def __post_init__(self):
        for name in ("micro_batch_size", "seq_len", "n_microbatches"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        get_convention(self.convention)
        for name in ("param_dtype", "grad_dtype", "optimizer_dtype", "act_dtype"):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), DTYPE_BITS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("attention", self.attention, ATTENTION)
        check_choice("activation_model", self.activation_model, ACTIVATION_MODELS)
        check_choice("kernels", self.kernels, KERNELS)
        if self.dropout is not None and not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        positive_float("capacity_factor", self.capacity_factor)

    def resolved_convention(self) -> Convention:
        """The convention with this config's dtype overrides applied."""
        c = get_convention(self.convention)
        changes = {}
        if self.param_dtype is not None:
            changes["param_bits"] = dtype_bits(self.param_dtype)
        if self.grad_dtype is not None:
            changes["grad_bits"] = dtype_bits(self.grad_dtype)
        if self.optimizer_dtype is not None:
            changes["state_bits"] = dtype_bits(self.optimizer_dtype)
        if self.master_weights is not None:
            changes["master_bits"] = 32 if self.master_weights else 0
        if changes:
            c = replace(c, name=f"{c.name}+overrides", **changes)
        if c.param_bits >= 32 and c.master_bits:
            c = replace(c, master_bits=0)  # fp32 parameters are their own master copy
        return c

    def act_bits(self) -> int:
        """Bits per activation element: ``act_dtype``'s, else the resolved convention's parameter bits."""
        if self.act_dtype is not None:
            return dtype_bits(self.act_dtype)
        return self.resolved_convention().param_bits


@dataclass(frozen=True)
class InferConfig:
    """A serving workload: ``batch`` concurrent sequences of ``prompt_len`` + ``output_len`` tokens;
    ``weight_dtype`` (fp32/bf16/fp16/int8/int4), ``kv_dtype`` (None -> bf16 for quantised weights, else the
    weight dtype), ``act_dtype`` (activations in the prefill workspace), ``attention`` (eager materialises
    the prefill score matrix), ``prefill_tokens`` (tokens prefilled in one step; None -> one prompt, as a
    chunked-prefill server does; the workspace scales with it)."""

    batch: int = 1
    prompt_len: int = 2048
    output_len: int = 256
    weight_dtype: str = "bf16"
    kv_dtype: str | None = None
    act_dtype: str = "bf16"
    attention: str = "flash"
    prefill_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "batch", positive_int("batch", self.batch))
        if self.prefill_tokens is not None:
            object.__setattr__(self, "prefill_tokens", positive_int("prefill_tokens", self.prefill_tokens))
        object.__setattr__(self, "prompt_len", positive_int("prompt_len", self.prompt_len))
        object.__setattr__(self, "output_len", positive_int("output_len", self.output_len, minimum=0))
        check_choice("weight_dtype", self.weight_dtype, ("fp32", "bf16", "fp16", "int8", "int4"))
        if self.kv_dtype is not None:
            check_choice("kv_dtype", self.kv_dtype, ("fp32", "bf16", "fp16", "fp8", "int8"))
        check_choice("act_dtype", self.act_dtype, ("fp32", "bf16", "fp16"))
        check_choice("attention", self.attention, ATTENTION)

    def kv_bits(self) -> int:
        """Bits per KV-cache element: ``kv_dtype``'s; else 16 for int8/int4 weights, else the weights'."""
        if self.kv_dtype is not None:
            return dtype_bits(self.kv_dtype)
        return 16 if self.weight_dtype in ("int8", "int4") else dtype_bits(self.weight_dtype)

    @property
    def context_len(self) -> int:
        """Tokens cached per sequence at the end: prompt_len + output_len."""
        return self.prompt_len + self.output_len
