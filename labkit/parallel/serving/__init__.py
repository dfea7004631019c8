"""Serving (inference) on the lab's model: prefill and batched decode with a KV cache, one engine per
replica or per tensor-parallel group.

Read in this order:

* :mod:`~labkit.parallel.serving.kv_cache` — :func:`prefill` (the whole prompt in one forward pass, its keys
  and values written into the request's cache), :func:`decode` (one token for every sequence in flight,
  each attending to its own cache), :func:`kv_cache_shape`;
* :mod:`~labkit.parallel.serving.tp` — :func:`shard_tp` (the model split with
  :func:`labkit.parallel.tensor.apply_tp`, every rank keeping n_kv_heads/tp heads of the cache) and the
  vocabulary-split logits gathered to sample;
* :mod:`~labkit.parallel.serving.engine` — :class:`Engine`: the queue, admission under a concurrency cap,
  the decode loop, KV bytes measured, a cancel storm and a lost rank survived.

Replicas are several engines on whole models; TP is one engine over a group. What a tp degree needs, the
collectives of a forward pass and the analytic deployment model are predicted in
:mod:`labkit.theory.serving`; the rank functions that launch the engines are in
:mod:`labkit.experiments.serving`.
"""

from labkit.parallel.serving.engine import (
    CLIENT_OUTCOMES,
    ERROR_TYPES,
    Engine,
    RankLost,
    check_requests,
    is_comm_failure,
    prompt_tokens,
)
from labkit.parallel.serving.kv_cache import decode, kv_cache_shape, prefill
from labkit.parallel.serving.tp import gather_vocab, logits, shard_tp

__all__ = ["CLIENT_OUTCOMES", "ERROR_TYPES", "Engine", "RankLost", "check_requests", "decode", "gather_vocab",
           "is_comm_failure", "kv_cache_shape", "logits", "prefill", "prompt_tokens", "shard_tp"]
