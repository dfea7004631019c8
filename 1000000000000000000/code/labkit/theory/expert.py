"""Mixture of experts, predicted: the validation every MoE/EP configuration goes through, the capacity per
expert, and the fraction of assignments a capacity limit drops under a uniform router. Pure Python (no torch).

Capacity = ceil(capacity_factor · tokens · top_k / n_experts) (Switch Transformer, Fedus et al. 2022, §2.1
"expert capacity", with GShard's top_k factor, Lepikhin et al. 2020 §2.2); assignments beyond it are dropped.
The strategy (:mod:`labkit.parallel.expert`) calls :func:`expert_capacity` and
:func:`check_expert_parallel` from here, so the prediction and the router use one formula.
"""

from __future__ import annotations

import math

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.theory.spec import ModelSpec, get_spec, presets

DROP_POLICIES = ("position", "score")


def check_expert_parallel(n_experts: int, *, ep: int = 1, top_k: int = 1, capacity_factor: float | None = None,
                          drop_policy: str = "position") -> None:
    """Raise ValueError unless ``ep`` divides ``n_experts``, ``1 <= top_k <= n_experts``, ``capacity_factor`` is
    None or > 0, and ``drop_policy`` is one of :data:`DROP_POLICIES`."""
    n_experts = positive_int("n_experts", n_experts)
    top_k = positive_int("top_k", top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be <= n_experts={n_experts}; valid top_k: 1..{n_experts}")
    check_divides("ep", ep, "n_experts", n_experts, hint="each rank holds n_experts/ep whole experts")
    if capacity_factor is not None:
        positive_float("capacity_factor", capacity_factor)
    check_choice("drop_policy", drop_policy, DROP_POLICIES)


def moe_spec(spec_name: str) -> ModelSpec:
    """The :class:`~labkit.theory.spec.ModelSpec` preset ``spec_name``, which must be a mixture of experts.

    Raises ValueError for an unknown preset or a dense one (the message lists the MoE presets)."""
    spec = get_spec(spec_name)
    if not spec.is_moe:
        moe = sorted(name for name, p in presets().items() if p.is_moe)
        raise ValueError(f"spec={spec_name!r} has n_experts=0 (a dense model); choose an MoE preset: "
                         f"{', '.join(moe)}")
    return spec


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert: ``ceil(capacity_factor · n_tokens · top_k / n_experts)`` (Switch Transformer §2.1,
    times top_k as in GShard §2.2); None when ``capacity_factor`` is None (no limit).

    Raises:
        ValueError: n_tokens not an integer >= 0, n_experts not an integer >= 1, top_k outside 1..n_experts,
            or capacity_factor neither None nor a finite number > 0 (each message names the value).
    """
    n_tokens = positive_int("n_tokens", n_tokens, minimum=0)
    check_expert_parallel(n_experts, top_k=top_k, capacity_factor=capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def predicted_dropped_fraction(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> float:
    """Expected fraction of the n_tokens·top_k assignments dropped when routing is uniform and independent per
    token: each expert's load is X ~ Binomial(n_tokens, top_k/n_experts) (a token picks a given expert with
    probability top_k/n_experts), and E[dropped] = n_experts · E[max(0, X − C)] with C from
    :func:`expert_capacity`. Pure Python. A model of an untrained (near-uniform) router, not of a trained one.

    Raises ValueError as :func:`expert_capacity` does."""
    cap = expert_capacity(n_tokens, n_experts, top_k, capacity_factor)
    if cap is None or n_tokens == 0:
        return 0.0
    p = top_k / n_experts
    if p >= 1.0:
        return max(0, n_tokens - cap) / n_tokens
    expected_over = 0.0
    for x in range(cap + 1, n_tokens + 1):
        log_pmf = (math.lgamma(n_tokens + 1) - math.lgamma(x + 1) - math.lgamma(n_tokens - x + 1)
                   + x * math.log(p) + (n_tokens - x) * math.log1p(-p))
        expected_over += (x - cap) * math.exp(log_pmf)
    return n_experts * expected_over / (n_tokens * top_k)
