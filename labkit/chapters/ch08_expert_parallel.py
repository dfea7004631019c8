"""Chapter 08 (expert parallelism): its parameter check, and the ep degrees it accepts.

The strategy is :mod:`labkit.parallel.expert`, the predictions :mod:`labkit.theory.expert`, the rank
functions it launches :func:`labkit.experiments.expert.ep_parity_rank` and
:func:`labkit.experiments.expert.ep_profile_rank`.
"""

from __future__ import annotations

from labkit.chapters.common import check_world_size
from labkit.checks import positive_float, positive_int
from labkit.theory.expert import check_expert_parallel, moe_spec


def check_chapter(*, world_size: int, tokens_per_rank: int, hidden_size: int, ffn_hidden_size: int,
                  n_experts: int, top_k: int, capacity_factor: float | None, capacity_factors, repeats: int,
                  spec: str, backend: str = "auto") -> None:
    """Validate chapter 08's parameters before anything is launched (the chapter's first code cell).

    Raises ValueError naming the value and the fix: world_size < 2 (expert parallelism needs ranks to move
    tokens between), ep = world_size not dividing n_experts, top_k outside 1..n_experts, a capacity factor
    that is not > 0, ``capacity_factors`` empty or not increasing (the sweep's check reads the dropped
    fraction falling along it), non-positive sizes or repeats, a ``spec`` that is not an MoE preset, or a
    backend the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`).
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("08", world_size, why="expert parallelism spreads the experts over ranks and "
                                  "moves tokens between them with all-to-all")
    for name, value in (("tokens_per_rank", tokens_per_rank), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size), ("repeats", repeats)):
        positive_int(name, value)
    if positive_int("n_experts", n_experts) % world_size:
        valid = chapter_ep_degrees(n_experts)
        fix = (f"world_size (= ep) values that pass every rule of chapter 08 with n_experts={n_experts}: "
               f"{', '.join(map(str, valid))}" if valid else
               f"no world_size >= 2 divides n_experts={n_experts}: choose an n_experts with a divisor >= 2, e.g. "
               "n_experts=8")
        raise ValueError(f"ep=world_size={world_size} does not divide n_experts={n_experts} (chapter 08 runs ep = "
                         f"world_size, each rank holding n_experts/ep experts); {fix}; or choose an n_experts it "
                         "divides")
    check_expert_parallel(n_experts, ep=world_size, top_k=top_k, capacity_factor=capacity_factor)
    if isinstance(capacity_factors, (str, bytes)) or not hasattr(capacity_factors, "__iter__"):
        raise ValueError(f"capacity_factors={capacity_factors!r} must be a list of numbers > 0, e.g. [0.5, 1.0, 2.0]")
    cfs = [positive_float("capacity_factors[]", c) for c in capacity_factors]
    if not cfs:
        raise ValueError("capacity_factors=[] is empty; give at least one number > 0, e.g. [0.5, 1.0, 2.0]")
    if any(b <= a for a, b in zip(cfs, cfs[1:])):
        raise ValueError(f"capacity_factors={list(capacity_factors)!r} must be strictly increasing (the sweep reads "
                         f"the dropped fraction falling as capacity grows); e.g. {sorted(set(cfs))}")
    moe_spec(spec)
    resolve_backend(backend, world_size)


def chapter_ep_degrees(n_experts: int) -> list[int]:
    """The world_size (= ep) values chapter 08 accepts for ``n_experts`` (the backend aside): ep >= 2 dividing
    n_experts. Raises ValueError for n_experts < 1."""
    n_experts = positive_int("n_experts", n_experts)
    return [e for e in range(2, n_experts + 1) if n_experts % e == 0]
