"""Serving (inference) on the lab's model: prefill and batched decode with a KV cache, one engine per
replica or per tensor-parallel group.

Read in this order:

* :mod:`~labkit.parallel.serving.kv_cache` — :func:`forward_segments` (one forward pass over a ragged
  batch: whole prompts, prompt chunks and decode tokens, each request attending to its own cache), its two
  common cases :func:`prefill` and :func:`decode`, :func:`kv_cache_shape`;
* :mod:`~labkit.parallel.serving.tp` — :func:`shard_tp` (the model split with
  :func:`labkit.parallel.tensor.apply_tp`, every rank keeping n_kv_heads/tp heads of the cache) and the
  vocabulary-split logits gathered to sample;
* :mod:`~labkit.parallel.serving.requests` — a request's life in the engine (:class:`Live`) and the record
  it leaves (TTFT, TPOT, inter-token latencies);
* :mod:`~labkit.parallel.serving.engine` — :class:`Engine`: arrivals (closed or open loop), the queue,
  admission under a concurrency cap, prefill-first or chunked-prefill steps, the time series of the run, KV
  bytes measured, a cancel storm, a lost rank and a hot swap survived;
* :mod:`~labkit.parallel.serving.quant` — :func:`quantize`: an int8 / int4 weight-only copy of a model
  (group-wise fp16 scales, the memory calculator's convention), :func:`weight_bytes` measured.

Replicas are several engines on whole models; TP is one engine over a group. What a tp degree needs, the
collectives of a forward pass and the analytic deployment model are predicted in
:mod:`labkit.theory.serving`; the rank functions that launch the engines are in
:mod:`labkit.experiments.serving`.
"""

from labkit.parallel.serving.engine import POLICIES, Engine
from labkit.parallel.serving.kv_cache import decode, forward_segments, kv_cache_shape, prefill
from labkit.parallel.serving.quant import dequantize, quantize, quantize_tensor, weight_bytes
from labkit.parallel.serving.requests import (
    CLIENT_OUTCOMES,
    ERROR_TYPES,
    OUTCOMES,
    RETRIED_OUTCOMES,
    RankLost,
    check_requests,
    is_comm_failure,
    prompt_tokens,
    target_tokens,
)
from labkit.parallel.serving.tp import gather_vocab, logits, shard_tp

__all__ = ["CLIENT_OUTCOMES", "ERROR_TYPES", "OUTCOMES", "POLICIES", "RETRIED_OUTCOMES", "Engine", "RankLost",
           "check_requests", "decode", "dequantize", "forward_segments", "gather_vocab", "is_comm_failure",
           "kv_cache_shape", "logits", "prefill", "prompt_tokens", "quantize", "quantize_tensor", "target_tokens",
           "shard_tp", "weight_bytes"]
