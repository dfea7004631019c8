"""Memory budgets per rank for training and inference, under every parallel degree. Pure Python, no torch.

Two budgets (the lab's first rule):

* training peak  = parameters + gradients + optimizer state + saved activations + temporary buffers
  + communication buffers + workspace + allocator headroom;
* inference peak = resident weights + KV cache + runtime workspace + communication buffers + headroom.

:func:`train_memory` and :func:`infer_memory` return a :class:`MemoryEstimate`: bytes per rank by category
(:data:`CATEGORIES`), the peak, a verdict against a device from ``data/hardware.yaml``, and every assumption
used. Every formula names its source; where the lab derived one itself (the activations of its own
Llama-style block), the derivation is written out in :func:`activation_items`.

Units: bytes (int) everywhere; GiB = 2**30 and GB = 10**9 only when printing.

Sources
-------
* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  Sec. 3.1 and Figure 1: model states of mixed-precision Adam are 2Ψ + 2Ψ + KΨ bytes (K = 12); stage 1
  shards the K part, stage 2 also the gradients, stage 3 also the parameters, each over N_d ranks.
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2
  (activations per layer: none / selective / full recompute, with tensor and sequence parallelism) and
  Sec. 4.2.3 (pipeline: the first stage holds p micro-batches under 1F1B, L·(1 + (p-1)/(p·m)) layers'
  worth under the interleaved schedule with m model chunks per rank).
* Megatron-LM ``megatron/training/theoretical_memory_usage.py``: 18 bytes/parameter, 6 + 12/dp with the
  distributed optimizer; input ids (8sb·p) and embedding dropout (sbh·p) on the first stage; output layer
  4sbh(1 + v/h)/t on the last.
* DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py`` ``estimate_zero2_model_states_mem_needs``:
  2Ψ + 18Ψ/N (18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 optimizer states).
* EleutherAI, "Transformer Math 101" (2023), https://blog.eleuther.ai/transformer-math/: 16 bytes/param.
* Austin et al. 2025, "How to Scale Your Model" (the JAX scaling book), training chapter: 10 bytes/param
  (bf16 parameters + fp32 Adam moments; gradients not held as a persistent buffer).
* KV cache: 2 (K and V) · n_layers · n_kv_heads · head_dim · bytes per element, per token
  (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 2). With tensor parallelism each rank
  keeps n_kv_heads/tp heads, or one head when tp > n_kv_heads and n_kv_heads divides tp (the kv heads are
  replicated, as Megatron-LM and vLLM do and labkit.parallel.tensor does): :func:`kv_heads_per_rank`.
* FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every tensor on dim 0 in ``torch.chunk`` pieces of
  ceil(d0/N) rows (PyTorch docs, "FSDP2: fully_shard", per-parameter sharding): ``shard_layout="dim0"``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace

import yaml

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.checks import divisors as _divisors
from labkit.paths import data_dir
from labkit.theory.spec import ModelSpec, get_spec

GiB = 2**30
GB = 10**9

#: the categories of a budget, in the order they stack
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication", "kv_cache",
              "workspace", "headroom")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: how a ZeRO shard splits each tensor over the dp·cp ranks (see :func:`shard_numel`)
SHARD_LAYOUTS = ("even", "dim0")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("eager", "flash")
OPTIMIZERS = ("adamw", "sgd", "adafactor")
ACTIVATION_MODELS = ("lab", "korthikanti")
KERNELS = ("cpu", "cuda")
MODES = ("train", "infer")

#: bits per element of each dtype name the lab accepts (aliases map to the same width)
DTYPE_BITS = {"fp32": 32, "float32": 32, "bf16": 16, "bfloat16": 16, "fp16": 16, "float16": 16, "fp8": 8,
              "int8": 8, "int4": 4}
_CANONICAL = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: int8/int4 weights carry one fp16 scale per group of this many weights (GPTQ/AWQ-style default)
QUANT_GROUP = 128
#: torch DDP's default gradient bucket (``bucket_cap_mb=25``), the lab's assumption for one DP bucket
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: assumed CUDA context + cuBLAS/NCCL workspaces on a GPU (an assumption, not a formula)
DEFAULT_GPU_WORKSPACE_BYTES = 1 * GiB
DEFAULT_HEADROOM = 0.15
#: the largest allocator headroom accepted, as a fraction of the other bytes (1.0 = doubling the budget)
MAX_HEADROOM = 1.0


def dtype_bits(name: str) -> int:
    """Bits per element of dtype ``name`` (see :data:`DTYPE_BITS`). Raises ValueError for unknown names."""
    check_choice("dtype", name, DTYPE_BITS)
    return DTYPE_BITS[name]


def canonical_dtype(name: str) -> str:
    """The lab's short name of dtype ``name``: ``float32`` -> ``fp32``, ``bfloat16`` -> ``bf16``, ``float16`` ->
    ``fp16``; short names (fp32, bf16, fp16, fp8, int8, int4) are returned as given. Raises ValueError for a
    name outside :data:`DTYPE_BITS`, listing the valid ones."""
    dtype_bits(name)
    return _CANONICAL.get(name, name)


def nbytes(elements: int, bits: int) -> int:
    """Bytes to hold ``elements`` values of ``bits`` bits each (rounded up to whole bytes). Raises ValueError
    for a negative ``elements`` or a ``bits`` < 0."""
    elements = positive_int("elements", elements, minimum=0)
    bits = positive_int("bits", bits, minimum=0)
    return -(-elements * bits // 8)


def check_headroom(headroom) -> float:
    """``headroom`` as a float if it is a fraction in [0, :data:`MAX_HEADROOM`] (0.15 = 15 % of the other
    bytes); else ValueError saying so (a value like 5 or 15 is a percentage given as a fraction)."""
    f = positive_float("headroom", headroom, allow_zero=True)
    if f > MAX_HEADROOM:
        raise ValueError(f"headroom={headroom!r} is a fraction of the other bytes (0.15 = 15 %); valid: 0 to "
                         f"{MAX_HEADROOM:g} (the seeds advise 0.1-0.2)")
    return f


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
# bytes-per-parameter conventions
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Convention:
    """How many bits each model-state component takes per parameter, and which source says so.

    ``param_bits`` (the weights used in compute), ``grad_bits`` (the gradients backward writes),
    ``grad_fp32_bits`` (an extra fp32 gradient copy held by the optimizer, DeepSpeed), ``master_bits``
    (fp32 master weights), ``state_bits`` (each optimizer moment), ``step_bytes`` (a per-tensor step counter,
    torch.optim keeps a float32 scalar tensor per parameter for AdamW/Adafactor).

    ZeRO stage s shards, over the data-parallel ranks: stage >= 1 the optimizer part (master, moments, the
    fp32 gradient copy), stage >= 2 the gradients, stage 3 the parameters (Rajbhandari et al. 2020, Fig. 1).
    """

    name: str
    param_bits: int
    grad_bits: int
    master_bits: int
    state_bits: int
    grad_fp32_bits: int = 0
    step_bytes: int = 0
    source: str = ""

    def bytes_per_param(self, optimizer: str = "adamw") -> float:
        """Unsharded bytes per parameter with ``optimizer`` (step counters excluded; Adafactor's factored
        state depends on the shapes and is not a per-parameter constant, so it raises ValueError)."""
        if optimizer == "adafactor":
            raise ValueError("optimizer='adafactor' has no per-parameter constant (its state is factored per "
                             "matrix); use train_memory with a ModelSpec")
        states = _N_STATES[optimizer]
        bits = self.param_bits + self.grad_bits + self.grad_fp32_bits + self.master_bits + states * self.state_bits
        return bits / 8


_N_STATES = {"adamw": 2, "sgd": 1}

CONVENTIONS: dict[str, Convention] = {
    "zero": Convention("zero", 16, 16, 32, 32, source=(
        "Rajbhandari et al. 2020 (ZeRO), Sec. 3.1/Fig. 1: mixed-precision Adam, 2 (fp16 params) + 2 (fp16 "
        "grads) + K=12 (fp32 params, momentum, variance) = 16 bytes/param")),
    "eleuther": Convention("eleuther", 16, 16, 32, 32, source=(
        "EleutherAI, Transformer Math 101 (2023): 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32 copy, "
        "momentum, variance) = 16 bytes/param")),
    "megatron": Convention("megatron", 16, 32, 32, 32, source=(
        "Megatron-LM theoretical_memory_usage.py: 18 bytes/param = 2 (bf16 params) + 4 (fp32 main grads) + "
        "12 (fp32 params, Adam moments); distributed optimizer (ZeRO-1) 6 + 12/dp")),
    "deepspeed": Convention("deepspeed", 16, 16, 32, 32, grad_fp32_bits=32, source=(
        "DeepSpeed stage_1_and_2.py estimate_zero2_model_states_mem_needs: 2 (fp16 params) + 18/N, "
        "18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 optimizer states")),
    "scaling-book": Convention("scaling-book", 16, 0, 0, 32, source=(
        "Austin et al. 2025, How to Scale Your Model (training chapter): 10 bytes/param = 2 (bf16 params) + "
        "8 (fp32 Adam moments); gradients are not held as a persistent buffer")),
    "torch-fp32": Convention("torch-fp32", 32, 32, 0, 32, step_bytes=4, source=(
        "what torch.optim.AdamW holds for fp32 parameters (the lab's CPU runs): param, .grad, exp_avg, "
        "exp_avg_sq in the parameter dtype + a float32 'step' tensor per parameter = 16 bytes/param + 4/tensor")),
    "torch-bf16": Convention("torch-bf16", 16, 16, 0, 16, step_bytes=4, source=(
        "pure-bf16 torch training: parameters, gradients and AdamW moments in bf16 (torch.optim keeps states "
        "in the parameter dtype) + a float32 'step' tensor per parameter = 8 bytes/param + 4/tensor")),
}


def get_convention(name: str) -> Convention:
    """The convention ``name`` (see :data:`CONVENTIONS`); ValueError listing the valid ones."""
    check_choice("convention", name, CONVENTIONS)
    return CONVENTIONS[name]


def zero_model_state_bytes(n_params: float, dp: int, stage: int, k: float = 12.0) -> float:
    """Model states per rank of mixed-precision Adam under ZeRO, exactly Rajbhandari et al. 2020, Figure 1:

    stage 0: (2 + 2 + K)Ψ; stage 1 (P_os): 2Ψ + 2Ψ + KΨ/N_d; stage 2 (P_os+g): 2Ψ + (2 + K)Ψ/N_d;
    stage 3 (P_os+g+p): (2 + 2 + K)Ψ/N_d. Bytes (float: the paper's arithmetic, no rounding).

    The paper's own example (Fig. 1): Ψ = 7.5e9, N_d = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    Raises ValueError for stage outside 0..3 or a non-positive Ψ / N_d.
    """
    psi = positive_float("n_params", n_params)
    n = positive_int("dp", dp)
    check_choice("zero", stage, (0, 1, 2, 3))
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    return (2 + 2 + k) * psi / n


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


# ------------------------------------------------------------------------------------------------------
# parameter tensors (names and shapes of labkit.models.Transformer)
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: ``name`` (as in ``labkit.models.Transformer.named_parameters()`` for dense
    models), ``shape`` (nn.Linear weights are [out, in]), ``layer`` (None outside the layers), ``part``
    (``embed``, ``layer``, ``final_norm``, ``head``), ``tp_dim`` (the dimension tensor parallelism splits:
    0 for column-parallel / vocab-parallel, 1 for row-parallel, None if replicated), ``expert`` (index, or
    None for dense tensors), ``tp_max`` (the most pieces tp may cut it into: n_kv_heads for wk/wv, whose
    heads are replicated beyond that, :func:`kv_heads_per_rank`; None: no limit)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    part: str
    tp_dim: int | None = None
    expert: int | None = None
    tp_max: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the whole (unsplit) tensor."""
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape on one tensor-parallel rank: ``shape[tp_dim]`` / min(tp, tp_max)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] //= min(tp, self.tp_max) if self.tp_max else tp
        return tuple(s)


def _linear(name, out_f, in_f, bias, layer, tp_dim, expert=None, tp_max=None) -> list[ParamTensor]:
    out = [ParamTensor(f"{name}.weight", (out_f, in_f), layer, "layer", tp_dim, expert, tp_max)]
    if bias:  # column-parallel biases split with their outputs; row-parallel biases are replicated
        out.append(ParamTensor(f"{name}.bias", (out_f,), layer, "layer", 0 if tp_dim == 0 else None, expert,
                               tp_max if tp_dim == 0 else None))
    return out


def _norm(name, spec, layer, part) -> list[ParamTensor]:
    out = [ParamTensor(f"{name}.weight", (spec.hidden_size,), layer, part)]
    if spec.norm == "layernorm":
        out.append(ParamTensor(f"{name}.bias", (spec.hidden_size,), layer, part))
    return out


def _mlp(prefix, spec, ffn, layer, expert=None) -> list[ParamTensor]:
    h, b = spec.hidden_size, spec.bias
    if spec.mlp == "swiglu":
        return (_linear(f"{prefix}.w_gate", ffn, h, b, layer, 0, expert)
                + _linear(f"{prefix}.w_up", ffn, h, b, layer, 0, expert)
                + _linear(f"{prefix}.w_down", h, ffn, b, layer, 1, expert))
    return (_linear(f"{prefix}.fc_in", ffn, h, b, layer, 0, expert)
            + _linear(f"{prefix}.fc_out", h, ffn, b, layer, 1, expert))


@functools.lru_cache(maxsize=64)
def param_tensors(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of ``spec`` with the names and shapes ``labkit.models.build_model(spec)`` gives
    them (MoE layers: ``layers.i.mlp.router.weight`` and ``layers.i.mlp.experts.e.*``). Their numels sum to
    ``spec.n_params()`` (tests/test_memory.py)."""
    h = spec.hidden_size
    out = [ParamTensor("embed.weight", (spec.vocab_size, h), None, "embed", 0)]
    if spec.position == "learned":
        out.append(ParamTensor("pos_embed.weight", (spec.max_seq_len, h), None, "embed"))
    for i in range(spec.n_layers):
        p = f"layers.{i}"
        out += _norm(f"{p}.attn_norm", spec, i, "layer")
        out += _linear(f"{p}.attn.wq", spec.q_size, h, spec.bias, i, 0)
        out += _linear(f"{p}.attn.wk", spec.kv_size, h, spec.bias, i, 0, tp_max=spec.n_kv_heads)
        out += _linear(f"{p}.attn.wv", spec.kv_size, h, spec.bias, i, 0, tp_max=spec.n_kv_heads)
        out += _linear(f"{p}.attn.wo", h, spec.q_size, spec.bias, i, 1)
        out += _norm(f"{p}.mlp_norm", spec, i, "layer")
        if spec.is_moe_layer(i):
            out.append(ParamTensor(f"{p}.mlp.router.weight", (spec.n_experts, h), i, "layer"))
            for e in range(spec.n_experts):
                out += _mlp(f"{p}.mlp.experts.{e}", spec, spec.expert_ffn_hidden_size, i, e)
        else:
            out += _mlp(f"{p}.mlp", spec, spec.ffn_hidden_size, i)
    out += _norm("norm", spec, None, "final_norm")
    if not spec.tied_embeddings:
        out.append(ParamTensor("lm_head.weight", (spec.vocab_size, h), None, "head", 0))
    return tuple(out)


def stage_layers(n_layers: int, pp: int, vpp: int, stage: int) -> list[int]:
    """Layers held by pipeline rank ``stage``: with vpp model chunks per rank, chunk c of rank i holds the
    (c·pp + i)-th block of n_layers/(pp·vpp) consecutive layers (Narayanan et al. 2021, Sec. 2.2.2).
    Raises ValueError unless pp·vpp divides n_layers and 0 <= stage < pp."""
    pp, vpp = positive_int("pp", pp), positive_int("vpp", vpp)
    check_divides("pp*vpp", pp * vpp, "n_layers", n_layers)
    if not (isinstance(stage, int) and 0 <= stage < pp):
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{pp - 1}")
    per_chunk = n_layers // (pp * vpp)
    return [(c * pp + stage) * per_chunk + j for c in range(vpp) for j in range(per_chunk)]


def local_param_tensors(spec: ModelSpec, parallel: ParallelConfig, stage: int = 0,
                        ep_rank: int = 0) -> list[ParamTensor]:
    """The tensors pipeline rank ``stage`` holds (before tensor-parallel splitting, see
    :meth:`ParamTensor.local_shape`): its layers, the embedding on the first stage, the final norm and head on
    the last (with tied embeddings and pp > 1 the last stage holds its own copy of the embedding, as in
    Megatron-LM), and of each MoE layer the n_experts/ep experts of expert-parallel rank ``ep_rank``."""
    return list(_stage_tensors(spec, parallel.pp, parallel.vpp, parallel.ep, stage, ep_rank))


@functools.lru_cache(maxsize=1024)
def _stage_tensors(spec: ModelSpec, pp: int, vpp: int, ep: int, stage: int, ep_rank: int) -> tuple[ParamTensor, ...]:
    """:func:`local_param_tensors`, cached on what it depends on (the planner asks for the same stages of
    many meshes)."""
    layers = set(stage_layers(spec.n_layers, pp, vpp, stage))
    first, last = stage == 0, stage == pp - 1
    per_ep = spec.n_experts // ep if spec.is_moe else 0
    out = []
    for t in param_tensors(spec):
        if t.part == "embed":
            keep = first or (last and spec.tied_embeddings and t.name == "embed.weight")
        elif t.part in ("final_norm", "head"):
            keep = last
        else:
            keep = t.layer in layers and (t.expert is None or t.expert // per_ep == ep_rank)
        if keep:
            out.append(t)
    return tuple(out)


# ------------------------------------------------------------------------------------------------------
# activations
# ------------------------------------------------------------------------------------------------------
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


def in_flight_microbatches(schedule: str, pp: int, n_microbatches: int, vpp: int = 1, stage: int = 0) -> float:
    """How many micro-batches' activations pipeline rank ``stage`` holds at its peak, in units of its whole
    share of layers.

    * pp = 1: 1 (gradient accumulation runs each micro-batch's forward and backward in turn);
    * GPipe (Huang et al. 2019): all m;
    * 1F1B (Narayanan et al. 2021, PipeDream-Flush): min(m, pp - stage);
    * interleaved with v chunks (Megatron-LM's warm-up of 2(pp - stage - 1) + (v - 1)·pp chunks, plus one):
      min(m, (2(pp - stage - 1) + (v - 1)·pp + 1)/v); on stage 0 this is pp·(1 + (pp - 1)/(pp·v)),
      Korthikanti et al. 2022, Sec. 4.2.3.
    """
    check_choice("schedule", schedule, SCHEDULES)
    pp, m, vpp = positive_int("pp", pp), positive_int("n_microbatches", n_microbatches), positive_int("vpp", vpp)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in 0..{pp - 1}")
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - stage))
    return float(min(m, (2 * (pp - stage - 1) + (vpp - 1) * pp + 1) / vpp))


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


# ------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _load_hardware(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def devices() -> dict[str, dict]:
    """Device entries of ``data/hardware.yaml`` (``devices:``): name -> {memory_bytes, source, ...}."""
    raw = _load_hardware(str(data_dir() / "hardware.yaml"))
    return {k: dict(v) for k, v in (raw.get("devices") or {}).items() if isinstance(v, dict) and "memory_bytes" in v}


def get_device(name: str) -> dict:
    """The device ``name`` from data/hardware.yaml; ValueError listing the valid names."""
    table = devices()
    if name not in table:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(sorted(table))}")
    return {"name": name, **table[name]}


# ------------------------------------------------------------------------------------------------------
# the estimate
# ------------------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """A predicted budget for one rank (the most loaded one).

    ``categories``: name -> bytes (every name of :data:`CATEGORIES`, 0 when it does not apply);
    ``n_params`` (whole model), ``n_params_local`` (held by this rank before ZeRO sharding), ``stage``
    (the pipeline rank reported: the one with the highest peak), ``per_stage`` (peak bytes of every stage),
    ``device`` / ``device_bytes`` / ``fits`` (None without a device), ``assumptions`` (every choice made).
    """

    mode: str
    categories: dict[str, int]
    n_params: int
    n_params_local: int
    assumptions: dict
    stage: int = 0
    per_stage: list[int] = field(default_factory=list)
    device: str | None = None
    device_bytes: int | None = None
    details: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The peak: the sum of every category (headroom included)."""
        return int(sum(self.categories.values()))

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the device's memory (None without a device)."""
        return None if self.device_bytes is None else self.total_bytes <= self.device_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state, bytes (no activations, buffers, workspace or headroom)."""
        return sum(self.categories[c] for c in ("parameters", "gradients", "optimizer"))

    def verdict(self) -> str:
        """One line: the predicted peak, and whether it fits the device (for a bare parameter count, a lower
        bound: model states only)."""
        unit, div = ("GiB", GiB) if self.total_bytes >= GiB // 10 else ("MiB", 2**20)
        if self.assumptions.get("model_states_only"):
            peak = f"at least {self.total_bytes / div:.2f} {unit} per rank (model states only)"
        else:
            peak = f"peak {self.total_bytes / div:.2f} {unit} per rank"
        if self.device_bytes is None:
            return f"{peak} (no device given)"
        word = "fits" if self.fits else "does NOT fit"
        return (f"{peak}: {word} on {self.device} ({self.device_bytes / GiB:.1f} GiB; "
                f"{'free' if self.fits else 'short'} {abs(self.device_bytes - self.total_bytes) / GiB:.2f} GiB)")

    def to_dict(self) -> dict:
        """Plain data (JSON-able): categories, total_bytes, n_params, fits and the assumptions used."""
        return {"mode": self.mode, "categories": dict(self.categories), "total_bytes": self.total_bytes,
                "n_params": self.n_params, "n_params_local": self.n_params_local, "fits": self.fits,
                "device": self.device, "device_bytes": self.device_bytes, "stage": self.stage,
                "per_stage_bytes": list(self.per_stage), "assumptions": self.assumptions}

    def table(self, unit: str = "GiB") -> str:
        """The categories as an aligned text table (``unit``: GiB, GB, MiB or bytes)."""
        return format_table(self, unit)


_UNITS = {"GiB": GiB, "GB": GB, "MiB": 2**20, "MB": 10**6, "bytes": 1}


def format_table(est: MemoryEstimate, unit: str = "GiB") -> str:
    """``est`` as aligned text: a title line saying the numbers are *predicted* per rank (mode, pipeline
    stage, unit), one line per category of :data:`CATEGORIES` ("not estimated" for what a bare parameter
    count cannot tell: activations, temporary and communication buffers), the total and the verdict. ``unit``:
    ``GiB`` (2**30), ``GB`` (10**9), ``MiB``, ``MB`` or ``bytes`` (exact, with thousands separators); other
    units print 3 decimals. Raises ValueError for an unknown unit."""
    check_choice("unit", unit, _UNITS)
    div = _UNITS[unit]
    fmt = (lambda v: f"{v:,d}") if unit == "bytes" else (lambda v: f"{v / div:,.3f}")
    states_only = bool(est.assumptions.get("model_states_only"))
    unknown = {"activations", "temporary", "communication"} if states_only else set()
    rows = [(c, est.categories[c]) for c in CATEGORIES]
    rows.append(("total (lower bound)" if states_only else "total (peak)", est.total_bytes))
    w = max([len(fmt(v)) for _, v in rows] + [len("not estimated")] * bool(unknown))
    what = "model states only" if states_only else est.mode
    lines = [f"predicted memory per rank ({what}, pipeline stage {est.stage}), {unit}"]
    nw = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{nw}s} {'not estimated' if name in unknown else fmt(v):>{w}s}" for name, v in rows]
    lines.append(f"  {est.verdict()}")
    return "\n".join(lines)


def _resolve_model(model) -> ModelSpec | int:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_spec(model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if positive_float("n_params", model) < 1:
            raise ValueError(f"n_params={model!r} must be a parameter count >= 1 (e.g. 7.5e9)")
        return int(model)
    raise ValueError(f"model={model!r} must be a ModelSpec, a preset name or a parameter count")


def shard_numel(shape: tuple[int, ...], group: int, layout: str = "even", rank: int = 0) -> int:
    """Elements of one tensor of ``shape`` that shard ``rank`` of a ZeRO group of ``group`` ranks holds.

    * ``even``: ceil(numel/group) on every rank — the ZeRO paper's Ψ/N_d (Rajbhandari et al. 2020, Fig. 1),
      rounded up per tensor; an upper bound for any even split.
    * ``dim0``: what FSDP2 ``fully_shard`` does (per-parameter sharding on dim 0, ``torch.chunk`` semantics):
      chunks of c = ceil(d0/group) rows; rank r holds max(0, min(c, d0 - r·c)) rows × the other dims, so
      rank 0 holds the most and the last ranks may hold fewer rows (or none) when group does not divide d0.

    Raises ValueError for an unknown layout, group < 1 or rank outside 0..group-1.
    """
    check_choice("shard_layout", layout, SHARD_LAYOUTS)
    group = positive_int("group", group)
    if not (isinstance(rank, int) and 0 <= rank < group):
        raise ValueError(f"rank={rank!r} must be a shard index in 0..{group - 1}")
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if group == 1:
        return n
    if layout == "even" or not shape:
        return _ceil_div(n, group)
    c = _ceil_div(shape[0], group)
    rows = max(0, min(c, shape[0] - rank * c))
    return rows * math.prod(shape[1:])


def _shard(shape: tuple[int, ...], group: int, sharded: bool, layout: str, rank: int) -> int:
    if not sharded or group == 1:
        return math.prod(shape)
    return shard_numel(shape, group, layout, rank % group)


def _model_states(tensors: Iterable[tuple[ParamTensor | None, tuple[int, ...]]], conv: Convention, optimizer: str,
                  zero: int, dense_group: int, expert_group: int, layout: str = "even",
                  dp_rank: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state for (tensor, local shape) pairs under ZeRO ``zero``,
    on ZeRO shard ``dp_rank`` with :func:`shard_numel`'s ``layout``. Tensors of the same local shape and group
    (dense / expert) cost the same bytes, so each kind is computed once and multiplied by its count
    (:func:`_kinds`, :func:`_kind_states`)."""
    return dict(_kind_states(_kinds(tensors), conv, optimizer, zero, dense_group, expert_group, layout, dp_rank))


def _kinds(tensors) -> tuple[tuple[tuple[tuple[int, ...], bool], int], ...]:
    """((local shape, is_expert), count) for (tensor, local shape) pairs."""
    kinds: dict[tuple[tuple[int, ...], bool], int] = {}
    for t, shape in tensors:
        key = (tuple(shape), t is not None and t.expert is not None)
        kinds[key] = kinds.get(key, 0) + 1
    return tuple(kinds.items())


@functools.lru_cache(maxsize=4096)
def _kind_states(kinds, conv: Convention, optimizer: str, zero: int, dense_group: int, expert_group: int,
                 layout: str = "even", dp_rank: int = 0) -> tuple[tuple[str, int], ...]:
    """:func:`_model_states` of grouped tensors, as ((category, bytes), ...) (cached: the middle pipeline
    stages of a model hold the same kinds)."""
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for (shape, is_expert), count in kinds:
        g = expert_group if is_expert else dense_group

        def part(level, g=g, shape=shape):  # elements held once ZeRO stage >= level shards this state
            return _shard(shape, g, zero >= level, layout, dp_rank)

        grads = nbytes(part(2), conv.grad_bits) + nbytes(part(1), conv.grad_fp32_bits)
        opt = nbytes(part(1), conv.master_bits)
        if optimizer == "adafactor":  # factored second moment (Shazeer & Stern 2018): rows + cols per matrix
            states = shape[0] + shape[1] if len(shape) == 2 else math.prod(shape)  # split evenly (any layout)
            opt += nbytes(_shard((states,), g, zero >= 1, "even", 0), conv.state_bits) + conv.step_bytes
        else:
            opt += _N_STATES[optimizer] * nbytes(part(1), conv.state_bits)
            opt += conv.step_bytes if optimizer == "adamw" else 0
        out["parameters"] += count * nbytes(part(3), conv.param_bits)
        out["gradients"] += count * grads
        out["optimizer"] += count * opt
    return tuple(out.items())


def _finish(cats: dict[str, int], headroom: float) -> dict[str, int]:
    sub = sum(v for k, v in cats.items() if k != "headroom")
    cats["headroom"] = int(round(sub * headroom))
    return {c: int(cats.get(c, 0)) for c in CATEGORIES}


def _device_info(device: str | None, workspace_bytes: int | None):
    dev = get_device(device) if device else None
    if workspace_bytes is None:
        workspace_bytes = DEFAULT_GPU_WORKSPACE_BYTES if dev else 0
    positive_int("workspace_bytes", workspace_bytes, minimum=0)
    return dev, int(workspace_bytes)


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


@functools.lru_cache(maxsize=4096)
def _stage_shapes(spec: ModelSpec, pp: int, vpp: int, ep: int, stage: int, tp: int):
    """For pipeline rank ``stage`` (expert rank 0): its tensors grouped by :func:`_kinds`, their total numel,
    and the numel of its biggest layer (cached: the planner asks for the same stages of many meshes)."""
    pairs = tuple((x, x.local_shape(tp)) for x in _stage_tensors(spec, pp, vpp, ep, stage, 0))
    layer_local: dict[int, int] = {}
    for x, shp in pairs:
        if x.layer is not None:
            layer_local[x.layer] = layer_local.get(x.layer, 0) + math.prod(shp)
    return _kinds(pairs), sum(math.prod(s) for _, s in pairs), max(layer_local.values(), default=0)


@functools.lru_cache(maxsize=64)
def _n_params(spec: ModelSpec) -> int:
    return spec.n_params()


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


def infer_memory(model, parallel: ParallelConfig | None = None, infer: InferConfig | None = None, *,
                 device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                 workspace_bytes: int | None = None) -> MemoryEstimate:
    """Predicted serving memory per rank, by category (bytes), on the pipeline stage with the highest peak.

    * parameters — every local tensor at ``weight_dtype`` (int8/int4 add one fp16 scale per
      :data:`QUANT_GROUP` weights; the lab quantises every tensor, embeddings and norms included).
    * kv_cache — :func:`kv_cache_bytes` for batch × (prompt + output) tokens, split by tp (kv heads
      replicated when tp > n_kv_heads: :func:`kv_heads_per_rank`) and pp (and cp).
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
    parallel.check(spec, infer.prompt_len if parallel.cp > 1 else None)
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
        n_stage_layers = spec.n_layers // parallel.pp
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
                          dev["name"] if dev else None, dev["memory_bytes"] if dev else None)


def convention_table(n_params: float, dp: int = 1, zero: int = 0, optimizer: str = "adamw") -> list[dict]:
    """Model-state bytes per rank of ``n_params`` parameters under every convention of :data:`CONVENTIONS`
    (rows: convention, bytes_per_param unsharded, parameters, gradients, optimizer, total bytes, source).
    Raises ValueError for n_params < 1, dp < 1, a zero stage outside 0..3 or an unknown optimizer."""
    if isinstance(n_params, bool) or not isinstance(n_params, (int, float)):
        raise ValueError(f"n_params={n_params!r} must be a parameter count (a number >= 1)")
    n_params = _resolve_model(n_params)
    check_choice("zero", zero, (0, 1, 2, 3))
    check_choice("optimizer", optimizer, ("adamw", "sgd"))
    rows = []
    for name, conv in CONVENTIONS.items():
        cats = _model_states([(None, (int(n_params),))], conv, optimizer, zero, positive_int("dp", dp), 1)
        rows.append({"convention": name, "bytes_per_param": conv.bytes_per_param(optimizer), **cats,
                     "total_bytes": sum(cats.values()), "source": conv.source})
    return rows


def estimate(mode: str = "train", **kwargs) -> MemoryEstimate:
    """One call for the CLI and widgets: ``mode`` ``train`` or ``infer``; ``model``; parallel fields (dp, tp, pp,
    cp, ep, zero, sequence_parallel, vpp, schedule, shard_layout); train or infer fields; ``device``,
    ``headroom``, ``workspace_bytes``, and for training ``bucket_bytes``, ``dp_rank``. Unknown keywords raise
    ValueError naming them."""
    check_choice("mode", mode, MODES)
    model = kwargs.pop("model")
    par_fields = {f for f in ParallelConfig.__dataclass_fields__}
    cfg_cls = TrainConfig if mode == "train" else InferConfig
    cfg_fields = set(cfg_cls.__dataclass_fields__)
    top = {"device", "headroom", "workspace_bytes"} | ({"bucket_bytes", "dp_rank"} if mode == "train" else set())
    unknown = set(kwargs) - par_fields - cfg_fields - top
    if unknown:
        valid = sorted(par_fields | cfg_fields | top)
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} for mode={mode!r}; valid: {', '.join(valid)}")
    parallel = ParallelConfig(**{k: v for k, v in kwargs.items() if k in par_fields})
    cfg = cfg_cls(**{k: v for k, v in kwargs.items() if k in cfg_fields})
    rest = {k: v for k, v in kwargs.items() if k in top}
    if mode == "train":
        return train_memory(model, parallel, cfg, **rest)
    return infer_memory(model, parallel, cfg, **rest)


def layout_rows(model, layouts: Iterable[dict], *, device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                **train_kwargs) -> list[dict]:
    """Predicted training memory of ``model`` for several parallel layouts, one row each (plain dicts, bytes):
    the layout's fields (dp, tp, pp, zero, ...), ``world_size``, every category, ``total_bytes``, ``stage``
    and ``fits`` on ``device``. ``train_kwargs`` are TrainConfig fields shared by every row. A layout that does
    not divide the model raises ValueError naming it."""
    rows = []
    for lay in layouts:
        par = ParallelConfig(**lay)
        est = train_memory(model, par, TrainConfig(**train_kwargs), device=device, headroom=headroom)
        rows.append({**asdict(par), "world_size": par.world_size, **est.categories,
                     "total_bytes": est.total_bytes, "stage": est.stage, "fits": est.fits})
    return rows


def serving_rows(model, workloads: Iterable[dict], *, device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                 **parallel_kwargs) -> list[dict]:
    """Predicted serving memory of ``model`` for several workloads (InferConfig fields: batch, prompt_len,
    output_len, weight_dtype, ...), one row each: the workload, every category (bytes), ``total_bytes``,
    ``fits`` on ``device``, and ``max_batch`` — the most concurrent sequences whose peak still fits (None
    without a device)."""
    par = ParallelConfig(**parallel_kwargs)
    rows = []
    for wl in workloads:
        cfg = InferConfig(**wl)
        est = infer_memory(model, par, cfg, device=device, headroom=headroom)
        row = {**wl, **est.categories, "total_bytes": est.total_bytes, "fits": est.fits, "max_batch": None}
        if est.device_bytes is not None:
            lo, hi = 0, 1
            while infer_memory(model, par, replace(cfg, batch=hi), device=device, headroom=headroom).fits:
                lo, hi = hi, hi * 2
                if hi > 1 << 20:
                    break
            while hi - lo > 1:  # largest batch that fits, by bisection
                mid = (lo + hi) // 2
                if infer_memory(model, par, replace(cfg, batch=mid), device=device, headroom=headroom).fits:
                    lo = mid
                else:
                    hi = mid
            row["max_batch"] = lo
        rows.append(row)
    return rows
