"""Context parallelism (CP): split the sequence over ``cp`` ranks and exchange keys/values for attention.

Every rank holds ``seq_len / cp`` tokens of each sequence. Everything in a transformer is per token except
attention, where each query needs every (earlier) key and value; this package supplies attention kernels that
take the local shards ``q, k, v`` [B, heads, seq_len/cp, head_dim] and return the local output, equal to
the matching rows of full-sequence attention, forward and backward:

* ``"ring"`` — ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3; Brandon
  et al. 2023): K/V blocks travel around the ring with ``isend``/``irecv`` while the current block is
  computed; partial results are merged with the log-sum-exp trick (Milakov & Gimelshein 2018; FlashAttention,
  Dao et al. 2022, Algorithm 1). Backward (FlashAttention-2, Dao 2023, Algorithm 2) sends K/V around again
  and passes the dK/dV accumulators along behind them, so no rank ever stores more than two K/V blocks.
* ``"allgather"`` — all-gather K/V, attend locally, reduce-scatter dK/dV (Llama 3, Dubey et al. 2024,
  §3.3.2 "Context parallelism").
* ``"ulysses"`` — DeepSpeed-Ulysses (Jacobs et al. 2023, §3): one all-to-all turns sequence shards into
  head shards (each rank gets ``n_heads/cp`` heads of the whole sequence), attention runs locally, a second
  all-to-all turns the output back into sequence shards.

Sharding (``load_balance``): the sequence is cut into ``cp`` chunks (contiguous, rank r holds chunk r) or
``2·cp`` chunks (load-balanced "zigzag"/head-tail: rank r holds chunks r and 2·cp−1−r; Megatron-LM CP,
Llama 3 §3.3.2). With causal attention, contiguous sharding gives rank r ``r+1`` blocks of work and the last
rank ``cp`` times the first's; zigzag gives every rank the same ``(2·cp+1)/4`` blocks.

Causal masking is decided per *chunk pair* from the chunks' global positions: a key chunk before the query
chunk is fully visible (no mask), the same chunk gets the triangular mask, a later chunk is skipped. Only the
diagonal is masked — masking every block is the classic bug (:func:`ring_attention_emulated` can reproduce
it). Non-causal attention sees every pair unmasked, with or without load balancing.

Validation (:func:`check_context_parallel`): seq_len divisible by cp (by 2·cp with load balancing), n_heads
divisible by cp for Ulysses. Dropout inside attention is not supported (ValueError).

Files: ``sharding.py`` (zig-zag chunks, shard / unshard), ``blocks.py`` (the blockwise kernel, forward and
backward, with the log-sum-exp merge), ``ring.py`` (ring attention, and the ring emulated in one process),
``allgather.py``, ``ulysses.py``, ``api.py`` (the entry points). The formulas (blocks, bytes, the ring's
plan) are in :mod:`labkit.theory.context`, the rank functions in :mod:`labkit.experiments.context`.
"""

from labkit.parallel.context.api import ContextParallelAttention, apply_context_parallel, context_parallel_attention
from labkit.parallel.context.blocks import count_work
from labkit.parallel.context.ring import ring_attention_emulated
from labkit.parallel.context.sharding import (
    check_context_parallel,
    chunk_ids,
    n_chunks,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from labkit.theory.context import MASK_POLICIES, METHODS, chunk_pairs

__all__ = ["METHODS", "MASK_POLICIES", "ContextParallelAttention", "apply_context_parallel", "check_context_parallel",
           "chunk_ids", "chunk_pairs", "context_parallel_attention", "count_work", "n_chunks",
           "ring_attention_emulated", "shard_positions", "shard_sequence", "unshard_sequence"]
