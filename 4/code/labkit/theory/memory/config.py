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
    MAX_BATCH,
    MAX_DEGREE,
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_WIDTH,
    OPTIMIZERS,
    RECOMPUTE,
    SCHEDULES,
    SHARD_LAYOUTS,
    Convention,
    bounded_int,
    dtype_bits,
    get_convention,
)
from labkit.theory.memory.stages import resolve_split
from labkit.theory.spec import ModelSpec

#: Megatron-LM pads the vocabulary to a multiple of this x tp (``--make-vocab-size-divisible-by``, default 128)
VOCAB_MULTIPLE = 128


def check_spec_bounds(spec: ModelSpec) -> ModelSpec:
    """``spec`` if its sizes are within the calculator's magnitude bounds (:data:`MAX_LAYERS` layers,
    :data:`MAX_EXPERTS` experts, :data:`MAX_WIDTH` for hidden / ffn / vocabulary / heads / head_dim); else
    ValueError naming the size. Constant time: checked before anything loops over layers or lists divisors."""
    bounded_int(f"{spec.name}.n_layers", spec.n_layers, MAX_LAYERS)
    for name in ("hidden_size", "ffn_hidden_size", "vocab_size", "n_heads", "n_kv_heads", "head_dim",
                 "expert_ffn_hidden_size", "max_seq_len"):
        bounded_int(f"{spec.name}.{name}", getattr(spec, name), MAX_SEQ_LEN if name == "max_seq_len" else MAX_WIDTH)
    if spec.n_experts:
        bounded_int(f"{spec.name}.n_experts", spec.n_experts, MAX_EXPERTS)
    return spec


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary size Megatron-LM trains with when ``tp`` does not divide ``vocab_size``: the next multiple
    of 128·tp (``_vocab_size_with_padding`` in megatron/training/tokenizer, ``--make-vocab-size-divisible-by``
    128); ``vocab_size`` itself when tp divides it (the lab pads only when it must)."""
    if vocab_size % tp == 0:
        return vocab_size
    m = VOCAB_MULTIPLE * tp
    return -(-vocab_size // m) * m


def padded_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """``spec`` with the vocabulary padded for ``tp`` (:func:`padded_vocab_size`); unchanged when tp divides it.
    The planner and the calculator both use this, so ``labkit memory`` accepts what ``labkit plan`` pads."""
    v = padded_vocab_size(spec.vocab_size, tp)
    return spec if v == spec.vocab_size else spec.replace(vocab_size=v)


def valid_tp(spec: ModelSpec) -> list[int]:
    """Every tp that passes every tensor-parallel rule for ``spec``: divides n_heads, hidden_size,
    ffn_hidden_size (and expert_ffn_hidden_size), and divides n_kv_heads or is a multiple of it. The vocabulary
    is padded (:func:`padded_vocab_size`), so it adds no rule."""
    check_spec_bounds(spec)
    out = []
    for d in _divisors(spec.n_heads):
        if spec.hidden_size % d or spec.ffn_hidden_size % d or (spec.is_moe and spec.expert_ffn_hidden_size % d):
            continue
        if spec.n_kv_heads % d and d % spec.n_kv_heads:
            continue
        out.append(d)
    return out


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError naming the first tensor-parallel rule ``tp`` breaks for ``spec`` and listing
    :func:`valid_tp` (values that pass every rule) as "valid tp: ..."."""
    tp = positive_int("tp", tp)
    why = None
    for size_name in ("n_heads", "hidden_size", "ffn_hidden_size"):
        if getattr(spec, size_name) % tp:
            why = f"tp={tp} does not divide {size_name}={getattr(spec, size_name)}"
            break
    if why is None and spec.is_moe and spec.expert_ffn_hidden_size % tp:
        why = f"tp={tp} does not divide expert_ffn_hidden_size={spec.expert_ffn_hidden_size}"
    if why is None and spec.n_kv_heads % tp and tp % spec.n_kv_heads:
        why = (f"tp={tp} neither divides n_kv_heads={spec.n_kv_heads} (to split the kv heads) nor is a multiple "
               "of it (to replicate them)")
    if why:
        raise ValueError(f"{why}; valid tp: {', '.join(map(str, valid_tp(spec)))}")


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
    (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``; vpp > 1 means interleaved); ``shard_layout`` how ZeRO
    splits each tensor over dp·cp (``even``: ceil(numel/N) per rank; ``dim0``: FSDP2's dim-0 chunks, see
    :func:`shard_numel`); ``layers_per_stage`` the layers of each pipeline rank (None: derived by
    :func:`labkit.theory.memory.stages.split_layers` — even when pp divides n_layers, else fewer layers on the
    first and last stages).

    World size = dp · tp · pp · cp. Raises ValueError for non-positive degrees (or above
    :data:`MAX_DEGREE`), an unknown schedule or shard layout, a zero stage outside 0..3, ``interleaved`` with
    vpp < 2, vpp > 1 with another schedule, or a ``layers_per_stage`` without pp entries.
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
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "vpp"):
            object.__setattr__(self, name, bounded_int(name, getattr(self, name), MAX_DEGREE))
        if self.world_size > MAX_DEGREE:
            raise ValueError(f"dp*tp*pp*cp = {self.world_size} ranks is out of range: valid 1..{MAX_DEGREE}")
        if self.layers_per_stage is not None:
            try:
                split = tuple(self.layers_per_stage)
            except TypeError:
                raise ValueError(f"layers_per_stage={self.layers_per_stage!r} must be a sequence of layer counts, "
                                 "one per pipeline stage") from None
            if len(split) != self.pp:
                raise ValueError(f"layers_per_stage has {len(split)} entries but pp={self.pp}: give one layer count "
                                 "per pipeline stage")
            object.__setattr__(self, "layers_per_stage",
                               tuple(bounded_int(f"layers_per_stage[{i}]", c, MAX_LAYERS) for i, c in enumerate(split)))
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

    def split(self, n_layers: int) -> tuple[int, ...]:
        """Layers per pipeline rank for a model of ``n_layers``: ``layers_per_stage`` checked, or the derived
        split (:func:`labkit.theory.memory.stages.resolve_split`)."""
        return resolve_split(n_layers, self.pp, self.vpp, self.layers_per_stage)

    def check(self, spec: ModelSpec | None, seq_len: int | None = None) -> None:
        """Raise ValueError unless the degrees split ``spec`` (and ``seq_len``): tp passes every tensor-parallel
        rule (:func:`check_tp`: n_heads, hidden, ffn and the experts' ffn, kv heads split or replicated; the
        vocabulary is padded, :func:`padded_vocab_size`); the stage split is valid (pp·vpp <= n_layers, or the
        given ``layers_per_stage`` sums to n_layers with >= vpp layers each); ep divides n_experts and dp·cp;
        cp divides seq_len. Every message lists only values that pass every rule."""
        if seq_len is not None:
            seq_len = bounded_int("seq_len", seq_len, MAX_SEQ_LEN)
            if self.cp > 1:
                check_divides("cp", self.cp, "seq_len", seq_len)
        if spec is None:
            if self.ep > 1 or self.cp > 1:
                raise ValueError(f"ep={self.ep} / cp={self.cp} need a model spec (a bare parameter count has no "
                                 "experts or sequence)")
            if self.layers_per_stage is not None:
                raise ValueError("layers_per_stage needs a model spec (a bare parameter count has no layers)")
            return
        check_spec_bounds(spec)
        check_tp(spec, self.tp)
        self.split(spec.n_layers)
        if self.ep > 1:
            if not spec.is_moe:
                raise ValueError(f"ep={self.ep} needs a mixture-of-experts model; {spec.name!r} is dense "
                                 "(n_experts=0); valid ep: 1")
            both = [d for d in _divisors(spec.n_experts) if (self.dp * self.cp) % d == 0]
            if spec.n_experts % self.ep:
                raise ValueError(f"ep={self.ep} does not divide n_experts={spec.n_experts}; valid ep (dividing "
                                 f"n_experts and dp*cp={self.dp * self.cp}): {', '.join(map(str, both))}")
            if (self.dp * self.cp) % self.ep:
                raise ValueError(f"ep={self.ep} does not divide dp*cp={self.dp * self.cp} (expert parallelism is "
                                 f"carved out of the data-parallel ranks); valid ep (dividing n_experts and dp*cp): "
                                 f"{', '.join(map(str, both))}")


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
        for name, top in (("micro_batch_size", MAX_BATCH), ("seq_len", MAX_SEQ_LEN), ("n_microbatches", MAX_BATCH)):
            object.__setattr__(self, name, bounded_int(name, getattr(self, name), top))
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
        object.__setattr__(self, "batch", bounded_int("batch", self.batch, MAX_BATCH))
        if self.prefill_tokens is not None:
            object.__setattr__(self, "prefill_tokens", bounded_int("prefill_tokens", self.prefill_tokens, MAX_SEQ_LEN))
        object.__setattr__(self, "prompt_len", bounded_int("prompt_len", self.prompt_len, MAX_SEQ_LEN))
        object.__setattr__(self, "output_len", bounded_int("output_len", self.output_len, MAX_SEQ_LEN, minimum=0))
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
