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

Files (one concern each; this package re-exports their public names, so ``from labkit.theory import memory as
mem; mem.train_memory(...)`` is the way to call them)
------------------------------------------------------------------------------------------------------------------
* :mod:`.conventions` — units, dtypes, bytes-per-parameter conventions, the ZeRO paper's formula;
* :mod:`.config` — ParallelConfig (and its divisibility rules), TrainConfig, InferConfig, kv heads per rank;
* :mod:`.stages` — the pipeline-stage split (layers per stage: even, given, or derived with fewer layers on the
  first and last stages) and the micro-batches each stage holds in flight;
* :mod:`.params` — parameter tensors by name and shape, the ones each rank holds, ZeRO sharding of their states;
* :mod:`.activations` — what autograd saves, item by item, per layer and on the edge stages;
* :mod:`.budget` — MemoryEstimate, its table, the devices of data/hardware.yaml;
* :mod:`.train` / :mod:`.infer` — the two budgets; :mod:`.tables` — many predictions at once, and ``estimate``.
"""

from labkit.theory.memory.activations import (
    ActivationItem,
    activation_bytes_per_layer,
    activation_items,
    edge_activation_items,
    korthikanti_table2,
)
from labkit.theory.memory.budget import MemoryEstimate, capacity_note, devices, format_table, get_device, usable_bytes
from labkit.theory.memory.config import (
    VOCAB_MULTIPLE,
    InferConfig,
    ParallelConfig,
    TrainConfig,
    check_spec_bounds,
    check_tp,
    kv_heads_per_rank,
    padded_spec,
    padded_vocab_size,
    valid_tp,
)
from labkit.theory.memory.conventions import (
    ACTIVATION_MODELS,
    ATTENTION,
    CATEGORIES,
    CONVENTIONS,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GPU_WORKSPACE_BYTES,
    DEFAULT_HEADROOM,
    DTYPE_BITS,
    GB,
    KERNELS,
    MAX_BATCH,
    MAX_DEGREE,
    MAX_EXPERTS,
    MAX_HEADROOM,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_WIDTH,
    MODES,
    OPTIMIZERS,
    QUANT_GROUP,
    RECOMPUTE,
    SCHEDULES,
    SHARD_LAYOUTS,
    Convention,
    GiB,
    bounded_int,
    canonical_dtype,
    check_headroom,
    dtype_bits,
    get_convention,
    nbytes,
    zero_model_state_bytes,
)
from labkit.theory.memory.infer import infer_memory, kv_cache_bytes
from labkit.theory.memory.params import ParamTensor, local_param_tensors, param_tensors, shard_numel
from labkit.theory.memory.stages import (
    check_split,
    chunk_split,
    format_split,
    in_flight_microbatches,
    resolve_split,
    split_layers,
    stage_layers,
)
from labkit.theory.memory.tables import convention_table, estimate, layout_rows, serving_rows
from labkit.theory.memory.train import train_memory, train_peaks

__all__ = [
    "ACTIVATION_MODELS", "ATTENTION", "CATEGORIES", "CONVENTIONS", "DEFAULT_BUCKET_BYTES",
    "DEFAULT_GPU_WORKSPACE_BYTES", "DEFAULT_HEADROOM", "DTYPE_BITS", "GB", "KERNELS", "MAX_BATCH", "MAX_DEGREE",
    "MAX_EXPERTS", "MAX_HEADROOM", "MAX_LAYERS", "MAX_SEQ_LEN", "MAX_WIDTH", "MODES", "OPTIMIZERS", "QUANT_GROUP",
    "RECOMPUTE", "SCHEDULES", "SHARD_LAYOUTS", "VOCAB_MULTIPLE", "ActivationItem", "Convention", "GiB",
    "InferConfig", "MemoryEstimate", "ParallelConfig", "ParamTensor", "TrainConfig", "activation_bytes_per_layer",
    "activation_items", "bounded_int", "canonical_dtype", "capacity_note", "check_headroom", "check_split",
    "check_spec_bounds", "check_tp", "chunk_split", "convention_table", "devices", "dtype_bits",
    "edge_activation_items", "estimate", "format_split", "format_table", "get_convention", "get_device",
    "in_flight_microbatches", "infer_memory", "korthikanti_table2", "kv_cache_bytes", "kv_heads_per_rank",
    "layout_rows", "local_param_tensors", "nbytes", "padded_spec", "padded_vocab_size", "param_tensors",
    "resolve_split", "serving_rows", "shard_numel", "split_layers", "stage_layers", "train_memory", "train_peaks",
    "usable_bytes", "valid_tp", "zero_model_state_bytes",
]
