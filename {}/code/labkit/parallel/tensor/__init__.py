"""Tensor parallelism (Megatron-LM) and sequence parallelism, written by hand, beside the DTensor variant.

TP splits the matrices inside a layer over the ``tp`` ranks of a group (Shoeybi et al. 2019, "Megatron-LM",
Section 3): a **column-parallel** linear ``Y = X A`` keeps a block of A's columns (whole input, output split
along its last dim), a **row-parallel** linear ``Z = Y B`` a block of B's rows (partial sums, one all-reduce).
Column then row needs ``g`` (all-reduce) forward and ``f`` backward per block: 2 + 2 per layer (Figure 4).
Sequence parallelism (Korthikanti et al. 2022, Section 4.2.2, Figure 5) also splits norms and residuals
along the sequence: each all-reduce becomes a reduce-scatter (``g-bar``) + an all-gather, the same bytes.

Read in this order:

* :mod:`~labkit.parallel.tensor.primitives` — ``f``, ``g``, ``g-bar`` and the other region functions
  (autograd), :func:`column_region` (several column layers that share one input, as Megatron's fused QKV);
* :mod:`~labkit.parallel.tensor.layers` — :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy` (the layout of the logits is checked,
  so a row-parallel output layer raises instead of silently computing a wrong loss);
* :mod:`~labkit.parallel.tensor.blocks` — :class:`ParallelAttention` (GQA: kv heads split, or replicated
  when ``n_kv_heads < tp``), :class:`ParallelMLP`;
* :mod:`~labkit.parallel.tensor.model` — :func:`apply_tp` -> :class:`TPTransformer` for the lab's model
  (sharded from the full weights every rank built, so every tp starts from the same function),
  :func:`finalize_grads`, :func:`gather_full`;
* :mod:`~labkit.parallel.tensor.dtensor` — :func:`apply_dtensor_tp`: the same plan with
  ``torch.distributed.tensor.parallel.parallelize_module``.

What a tp degree needs and what it communicates (``check_tp``, ``comm_theory_model``, ...) is predicted in
:mod:`labkit.theory.tensor`; parity, counting and timing rank functions are in :mod:`labkit.experiments.tensor`.
Dropout is refused (ValueError): with TP, dropout inside a region needs a different random stream per rank
and outside it the same one (Megatron's RNG tracker); the lab's models use dropout 0.
"""

from labkit.parallel.tensor.blocks import ParallelAttention, ParallelMLP
from labkit.parallel.tensor.dtensor import apply_dtensor_tp, dtensor_loss
from labkit.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardInfo,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from labkit.parallel.tensor.model import TPTransformer, apply_tp, finalize_grads, gather_full
from labkit.parallel.tensor.primitives import (
    column_region,
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
    tp_layout,
    tp_rank,
    tp_size,
)

__all__ = [
    "ColumnParallelLinear", "ParallelAttention", "ParallelMLP", "RowParallelLinear", "ShardInfo", "TPTransformer",
    "VocabParallelEmbedding", "apply_dtensor_tp", "apply_tp", "column_region", "copy_to_tp_region", "dtensor_loss",
    "finalize_grads", "gather_from_sp_region", "gather_from_tp_region", "gather_full", "reduce_from_tp_region",
    "reduce_scatter_to_sp_region", "scatter_to_sp_region", "scatter_to_tp_region", "tp_layout", "tp_rank", "tp_size",
    "vocab_parallel_cross_entropy",
]
