"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020), predicted: bytes sent per step by stage, and
the model-state bytes each rank holds in this lab's layouts. Pure Python (no torch); the strategies are in
:mod:`labkit.parallel.zero`, the paper's Ψ/d per rank in :mod:`labkit.theory.memory`.

The variants the lab runs side by side, and the ZeRO stage each implements: ``ddp`` (stage 0, torch DDP),
``zero1`` / ``zero2`` / ``zero3`` (the lab's :class:`~labkit.parallel.zero.ZeroDataParallel`) and
``fsdp2`` (torch's ``fully_shard``: full sharding, stage 3).

A *unit* is what the lab's ZeRO gathers at once: each transformer layer, plus a *root* unit with every
other parameter (embeddings, final norm, output head) — :func:`root_params`.
"""

from __future__ import annotations

from labkit.checks import check_choice, positive_int

STAGES = (0, 1, 2, 3)
#: the ZeRO stage each variant implements (FSDP2 = full sharding = stage 3)
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
VARIANTS = tuple(STAGE_OF)


def predicted_comm_bytes(stage: int, world_size: int, n_params: int, *, root_params: int = 0,
                         n_microbatches: int = 1, bytes_per_element: int = 4) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by collective, with ring algorithms (nccl-tests factors:
    all-reduce 2(n-1)/n·S, all-gather / reduce-scatter (n-1)/n·S).

    * stage 0 (DDP): one all-reduce of Ψ per step (accumulation uses no_sync): 2(n-1)/n·Ψ.
    * stage 1: reduce-scatter Ψ once per step (no_sync too) + all-gather Ψ after the update — the same total
      (Rajbhandari et al. 2020, Sec. 7.2.1).
    * stage 2: reduce-scatter Ψ every micro-batch + all-gather Ψ once.
    * stage 3: per micro-batch, all-gather every unit for forward and every unit but the root again for
      backward, reduce-scatter Ψ: (n-1)/n·(3Ψ - Ψ_root) per micro-batch — 1.5x DDP when Ψ_root → 0
      (Sec. 7.2.2). FSDP2 keeps its root the same way, so the same formula applies.

    ``n_params`` = Ψ (padded sizes, if padding exists: :func:`padded_params`), ``root_params`` = Ψ_root.
    Returns {op: bytes} (float: the ring factors are fractions).

    Raises:
        ValueError: stage not in 0-3; world_size, n_params, n_microbatches or bytes_per_element not a
            positive integer; root_params negative or larger than n_params.
    """
    check_choice("stage", stage, STAGES)
    n = positive_int("world_size", world_size)
    m = positive_int("n_microbatches", n_microbatches)
    e = positive_int("bytes_per_element", bytes_per_element)
    psi = positive_int("n_params", n_params) * e
    root = positive_int("root_params", root_params, minimum=0) * e
    if root > psi:
        raise ValueError(f"root_params={root_params} exceeds n_params={n_params}: the root unit is part of the model")
    f = (n - 1) / n
    if stage == 0:
        return {"all_reduce": 2 * f * psi}
    if stage == 1:
        return {"reduce_scatter": f * psi, "all_gather": f * psi}
    if stage == 2:
        return {"reduce_scatter": m * f * psi, "all_gather": f * psi}
    return {"reduce_scatter": m * f * psi, "all_gather": m * f * (2 * psi - root)}


def root_params(spec) -> int:
    """Parameters of the root unit (everything outside the layers): embeddings, final norm, output head."""
    return spec.embedding_params() + spec.norm_params() + spec.head_params()


def _units(spec) -> list[list]:
    """The parameter tensors (labkit.theory.memory.param_tensors) grouped as
    :class:`~labkit.parallel.zero.ZeroDataParallel` groups them: the root unit (everything outside the
    layers) first, then one unit per layer."""
    from labkit.theory import memory

    tensors = memory.param_tensors(spec)
    root = [t for t in tensors if t.layer is None]
    layers = [[t for t in tensors if t.layer == i] for i in range(spec.n_layers)]
    return [u for u in [root, *layers] if u]


def _chunk(dim0: int, d: int, rank: int) -> int:
    """Rows of a dim-0 shard as ``torch.chunk`` cuts them (FSDP2): ceil(dim0/d) each, the last ranks fewer."""
    c = -(-dim0 // d)
    return max(0, min(c, dim0 - rank * c))


def layout_bytes(spec, degree: int, variant: str, rank: int = 0, bytes_per_element: int = 4) -> dict[str, int]:
    """Predicted model-state bytes on ``rank`` of a group of ``degree`` ranks for *this implementation's*
    layout, to the byte, where the paper's Ψ/d (and the calculator's per-tensor ceil(numel/d)) is the ideal:

    * the lab's ZeRO pads each unit's flat buffer to a multiple of d and keeps k = padded/d elements per rank
      (:class:`~labkit.parallel.zero.ZeroDataParallel`); stages 1-2 keep the full parameters as views of that
      buffer, and a rank's shard view reaches into the padding on the last ranks, so the storage touched is
      max(numel, (r+1)·k); AdamW keeps one 4-byte step counter per unit;
    * FSDP2 cuts every parameter on dim 0 as ``torch.chunk`` does: ceil(dim0/d) rows each, the last ranks
      fewer (uneven when d does not divide dim0); one step counter per parameter tensor;
    * DDP holds everything.

    fp32 parameters, gradients and AdamW's two moments (``bytes_per_element`` each), as the calculator's
    convention "torch-fp32". Returns {"parameters", "gradients", "optimizer", "optimizer_steps"}.
    Raises ValueError for an unknown variant, degree < 1 or rank outside 0..degree-1.
    """
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    check_choice("variant", variant, VARIANTS)
    d = positive_int("degree", degree)
    if not 0 <= rank < d:
        raise ValueError(f"rank={rank} must be in 0..{d - 1} for degree={d}")
    e = bytes_per_element
    units = _units(spec)
    tensors = [t for u in units for t in u]
    full = sum(t.numel for t in tensors)
    if variant == "ddp":
        return {"parameters": e * full, "gradients": e * full, "optimizer": 2 * e * full + 4 * len(tensors),
                "optimizer_steps": 4 * len(tensors)}
    if variant == "fsdp2":
        local = sum(_chunk(t.shape[0], d, rank) * (t.numel // t.shape[0]) for t in tensors)
        return {"parameters": e * local, "gradients": e * local, "optimizer": 2 * e * local + 4 * len(tensors),
                "optimizer_steps": 4 * len(tensors)}
    stage = STAGE_OF[variant]
    sizes = [sum(t.numel for t in u) for u in units]
    ks = [-(-u // d) for u in sizes]
    viewed = sum(max(u, (rank + 1) * k) for u, k in zip(sizes, ks))  # full params + this rank's shard view
    shard = sum(ks)
    return {"parameters": e * (shard if stage == 3 else viewed), "gradients": e * (viewed if stage == 1 else shard),
            "optimizer": 2 * e * shard + 4 * len(units), "optimizer_steps": 4 * len(units)}


def padded_params(spec, degree: int, variant: str) -> tuple[int, int]:
    """(Ψ, Ψ_root) as the collectives of ``variant`` on ``degree`` ranks see them: each unit padded to a
    multiple of d (the lab's ZeRO), each parameter's dim 0 padded to a multiple of d (FSDP2: every rank
    all-gathers ceil(dim0/d) rows), unpadded for DDP. Equal to (``spec.n_params()``, :func:`root_params`)
    when d divides every size. Raises ValueError for an unknown variant."""
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    check_choice("variant", variant, VARIANTS)
    d = positive_int("degree", degree)
    units = _units(spec)
    if variant == "ddp":
        sizes = [sum(t.numel for t in u) for u in units]
    elif variant == "fsdp2":
        sizes = [sum(-(-t.shape[0] // d) * d * (t.numel // t.shape[0]) for t in u) for u in units]
    else:
        sizes = [-(-sum(t.numel for t in u) // d) * d for u in units]
    root = sizes[0] if units[0][0].layer is None else 0
    return sum(sizes), root


# ------------------------------------------------------------------------------------------------------
# ZeRO-1 as an optimizer wrapper (labkit.parallel.zero.ShardedOptimizer): state sharded by parameter
# ------------------------------------------------------------------------------------------------------
def partition_by_size(group_numels, world_size: int, *, start_sizes=None) -> list[list]:
    """The rank that owns each parameter when optimizer state is sharded *by parameter*: within each param
    group (in order), parameters sorted by size, largest first (ties keep their order), each to the rank
    holding the fewest elements so far (ties: the lowest rank), the running sizes shared across groups —
    torch's ``ZeroRedundancyOptimizer._partition_parameters``. ``group_numels``: one list of element counts per
    param group; an entry None (a frozen parameter) is owned by nobody (None).
    Returns the owners in the same nested shape. Raises ValueError for world_size < 1 or a negative count."""
    n = positive_int("world_size", world_size)
    sizes = [0] * n
    owners = []
    for numels in group_numels:
        numels = list(numels)
        own = [None] * len(numels)
        live = [i for i, x in enumerate(numels) if x is not None]
        for i in live:
            positive_int("numel", numels[i], minimum=0)
        for i in sorted(live, key=lambda i: numels[i], reverse=True):
            r = sizes.index(min(sizes))
            own[i] = r
            sizes[r] += numels[i]
        owners.append(own)
    return owners


def sharded_optimizer_bytes(model, world_size: int, rank: int, *, n_states: int = 2, bytes_per_element: int = 4,
                            step_bytes: int = 4) -> dict[str, int]:
    """Predicted optimizer-state bytes on ``rank`` when the state is sharded by parameter over
    ``world_size`` ranks (:func:`partition_by_size`; ZeRO stage 1, P_os, Rajbhandari et al. 2020): for each
    parameter it owns, ``n_states`` moments of ``bytes_per_element`` each per element (AdamW: exp_avg,
    exp_avg_sq) and one ``step_bytes`` counter (torch.optim's float32 ``step``) — convention "torch-fp32" of
    :mod:`labkit.theory.memory`.

    ``model``: a ModelSpec or preset name (its tensors from ``labkit.theory.memory.param_tensors``, one param
    group), or a list of param groups, each a list of element counts (None for a frozen parameter).
    Returns {"optimizer" (bytes, steps included), "optimizer_steps", "owned_params", "owned_numel"}.
    The sum over ranks is the unsharded optimizer state; a rank's share differs from the calculator's even
    Ψ/N_d by at most one parameter (the greedy partition's imbalance).
    Raises ValueError for world_size < 1, rank outside 0..world_size-1 or an unknown preset."""
    groups = _numel_groups(model)
    n = positive_int("world_size", world_size)
    if not (isinstance(rank, int) and 0 <= rank < n):
        raise ValueError(f"rank={rank!r} must be in 0..{n - 1} for world_size={n}")
    owners = partition_by_size(groups, n)
    mine = [x for g, o in zip(groups, owners) for x, r in zip(g, o) if r == rank]
    steps = step_bytes * len(mine)
    return {"optimizer": n_states * bytes_per_element * sum(mine) + steps, "optimizer_steps": steps,
            "owned_params": len(mine), "owned_numel": sum(mine)}


def _numel_groups(model) -> list[list]:
    if isinstance(model, (list, tuple)):
        return [list(g) for g in model]
    from labkit.theory import memory as mem
    from labkit.theory.spec import get_spec

    spec = get_spec(model) if isinstance(model, str) else model
    return [[t.numel for t in mem.param_tensors(spec)]]
