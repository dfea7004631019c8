"""Units, dtypes and the bytes-per-parameter conventions of model states (ZeRO, EleutherAI, Megatron-LM,
DeepSpeed, the scaling book, torch), and the ZeRO paper's model-state formula. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import check_choice, positive_float, positive_int

GiB = 2**30
GB = 10**9

#: the categories of a budget, in the order they stack
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication", "kv_cache",
              "workspace", "headroom")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
#: how a ZeRO shard splits each tensor over the dp·cp ranks (see :func:`shard_numel`)
SHARD_LAYOUTS = ("even", "dim0")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("eager", "flash")
OPTIMIZERS = ("adamw", "sgd", "adafactor")
ACTIVATION_MODELS = ("lab", "korthikanti", "megatron")
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

# Magnitude bounds, checked before any arithmetic or divisor search, so that an absurd input (a sequence of
# 10**18 tokens, a billion GPUs) is a ValueError in microseconds, never a loop over its divisors. Each is far
# beyond any published run: the largest published training contexts are ~10**7 tokens, the largest clusters
# ~10**5 GPUs, the deepest models ~10**2 layers.
#: the largest parallel degree or GPU count
MAX_DEGREE = 2**20
#: the longest sequence (tokens), and the most sequences per (micro-)batch or micro-batches per step
MAX_SEQ_LEN = 2**24
MAX_BATCH = 2**24
#: the most layers, experts; the widest hidden / ffn / vocabulary / head count of a model spec
MAX_LAYERS = 2**14
MAX_EXPERTS = 2**12
MAX_WIDTH = 2**22


def bounded_int(name: str, value, maximum: int, *, minimum: int = 1, what: str = "") -> int:
    """``value`` as an int in [minimum, maximum] (:func:`labkit.checks.positive_int`, then the upper bound);
    else ValueError naming it and the valid range. Constant time whatever the magnitude."""
    n = positive_int(name, value, minimum=minimum)
    if n > maximum:
        raise ValueError(f"{name}={n} is out of range: valid {minimum}..{maximum}{f' ({what})' if what else ''}")
    return n


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
    #: the ZeRO stage from which the 16-bit gradients are sharded (2 in the ZeRO paper; 4 = never)
    grad_shard_stage: int = 2
    #: at ZeRO-3 the 16-bit gradients are not held at all (reduced straight into the sharded fp32 copy)
    no_grads_at_zero3: bool = False
    #: bytes per parameter of the largest layer held unsharded at ZeRO-3 (None: the lab's prefetch assumption,
    #: :func:`labkit.theory.memory.train_memory`'s temporary category)
    largest_layer_bytes: float | None = None

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
    "deepspeed": Convention("deepspeed", 16, 16, 32, 32, grad_fp32_bits=32, grad_shard_stage=4, no_grads_at_zero3=True,
                            largest_layer_bytes=4.0, source=(
        "DeepSpeed's own estimators (no offload): deepspeed/runtime/zero/stage_1_and_2.py "
        "estimate_zero2_model_states_mem_needs: gpu_mem = 4*total_params + 16*total_params/total_gpus (fp16 "
        "params and grads unsharded, fp32 params, grads and Adam moments sharded), used here for ZeRO-1 and 2; "
        "stage3.py estimate_zero3_model_states_mem_needs: 4*largest_layer_params + 18*total_params/total_gpus "
        "(no fp16 gradient buffer); unsharded 2 + 2 + 16 = 20 bytes/param")),
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
