"""Tensor parallelism for inference: the lab's model split with :func:`labkit.parallel.tensor.apply_tp` (the
same split chapter 05 trains with), and its vocabulary-split logits gathered to sample.

Attention heads (query and key/value heads together, so grouped-query attention keeps its groups) and MLP
hidden units are column/row-parallel, one all-reduce after attention and one after the MLP per layer
(Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3), a vocabulary-parallel embedding (one more all-reduce)
and output layer (its logits all-gathered). Every rank keeps ``n_kv_heads/tp`` heads of the cache. What tp
a model allows and how many collectives a forward pass issues: :mod:`labkit.theory.serving`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.models import Transformer
from labkit.parallel.tensor import apply_tp, gather_from_tp_region
from labkit.theory.serving import check_tp


def shard_tp(model: Transformer, group):
    """The whole ``model`` (identical on every rank) split over ``group`` with
    :func:`labkit.parallel.tensor.apply_tp`: attention heads and MLP hidden units column/row-parallel
    (Shoeybi et al. 2019, Sec. 3), vocabulary-parallel embedding and output layer. ``model`` is consumed
    (pass a copy). Raises ValueError from :func:`labkit.theory.serving.check_tp`."""
    check_tp(model.spec, dist.get_world_size(group))
    return apply_tp(model, group)


def gather_vocab(model, logits: torch.Tensor) -> torch.Tensor:
    """A TP model's vocabulary blocks [..., Vp/tp] all-gathered to [..., vocab_size]; others unchanged."""
    if getattr(model, "tp", 1) > 1:
        logits = gather_from_tp_region(logits, model.group)[..., : model.vocab_size]  # (..., Vp) -> (..., V)
    return logits


def logits(model, x: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits of hidden ``x`` [B, T, H] -> [B, T, vocab_size]."""
    return gather_vocab(model, model.head(x))  # (B, T, V/tp) -> (B, T, V)
