"""Mixture of experts (MoE) and expert parallelism (EP): experts spread over ranks, tokens routed with all-to-all.

* :func:`route` (``routing.py``) — the top-k router (Shazeer et al. 2017; GShard, Lepikhin et al. 2020 §2.2;
  Switch Transformer, Fedus et al. 2022 §2.1): softmax over expert logits, the top_k experts per token,
  gates = their probabilities (optionally renormalised to sum to 1, as Mixtral does), and a capacity per
  expert with a drop policy. Capacity = ceil(capacity_factor · tokens · top_k / n_experts) (Switch §2.1
  "expert capacity", with GShard's top_k factor); assignments beyond it are dropped.
* :class:`MoE` (``moe.py``) — the single-process layer: router + ``n_experts`` MLPs. A dropped assignment
  contributes nothing, so a token dropped by every expert gets a zero MoE output: the layer must sit on a
  residual path (``x + moe(norm(x))``, as in :class:`labkit.models.Block`) so the token passes through
  unchanged instead of becoming a zero vector.
* :class:`ExpertParallelMoE` (``ep.py``) — the same layer with the experts sharded over ``ep`` ranks (rank r
  holds experts ``r·E/ep .. (r+1)·E/ep − 1``) and the router replicated. Dispatch and combine use
  ``all_to_all_single`` with split sizes; the per-expert counts are exchanged FIRST (a small all-to-all), so
  every rank knows how many rows it will receive. Uneven counts, zero counts, and ranks with no tokens at all
  work; equal-shape all-to-all with per-rank capacities (shapes differing between ranks, e.g. [4, 3, 32]
  vs [4, 4, 32]) is the bug this avoids.

Capacity is applied per rank to the rank's own tokens (GShard's per-group capacity): the EP layer gives exactly
what the single-process layer gives on each rank's tokens. With no capacity (``capacity_factor=None``) nothing
is dropped and the result equals the single-process layer on the whole batch, for any placement of tokens.

Validation (:func:`check_expert_parallel`): ep divides n_experts, 1 <= top_k <= n_experts, capacity_factor > 0.
The formulas (capacity, predicted dropped fraction) are in :mod:`labkit.theory.expert`, the rank functions in
:mod:`labkit.experiments.expert`.
"""

from labkit.parallel.expert.ep import ExpertParallelMoE, set_capacity_factor
from labkit.parallel.expert.moe import MoE
from labkit.parallel.expert.routing import Routing, load_balancing_loss, route
from labkit.theory.expert import DROP_POLICIES, check_expert_parallel, expert_capacity

__all__ = ["DROP_POLICIES", "ExpertParallelMoE", "MoE", "Routing", "check_expert_parallel", "expert_capacity",
           "load_balancing_loss", "route", "set_capacity_factor"]
