"""ParallelDims: the degrees of a composed (multi-dimensional) parallel run, their validation, the rank grid
(which ranks share a TP / CP / DP / PP / EP group) and the shape of the torch DeviceMesh built from them.

Pure Python (no torch import); :func:`labkit.parallel.mesh.device_mesh` builds the torch mesh in a rank.

World size
----------
``world_size = dp · tp · pp · cp``. Expert parallelism does not multiply the world: as in Megatron Core, the
``ep`` ranks of an expert group are carved out of the ``dp · cp`` ranks that hold the same dense shard (the
dense layers see those ranks as data/context-parallel, the MoE layers as expert-parallel), so ``ep`` must
divide ``dp · cp`` (Megatron Core ``parallel_state.initialize_model_parallel``: "expert_model_parallel_size"
splits the data-parallel ranks; the same rule is :meth:`labkit.theory.memory.ParallelConfig.check`).

Rank grid (the order of the dimensions)
---------------------------------------
Ranks are laid out with ``order`` given innermost first, default ``("tp", "cp", "dp", "pp")`` — Megatron
Core's default ``order="tp-cp-ep-dp-pp"`` (ep lives inside dp·cp here, see above)::

    rank = tp_i + tp · (cp_i + cp · (dp_i + dp · pp_i))

so the TP ranks of a group are consecutive (the same node, the fastest links: NVLink), CP groups stride
``tp``, DP groups stride ``tp·cp`` and PP groups stride ``tp·cp·dp`` (they cross nodes first). Example, 8 ranks
with dp=2, tp=2, pp=2::

    TP groups: [0, 1] [2, 3] [4, 5] [6, 7]     DP groups: [0, 2] [1, 3] [4, 6] [5, 7]
    PP groups: [0, 4] [1, 5] [2, 6] [3, 7]

:meth:`ParallelDims.grid` returns one row per rank (its coordinates and the index of each group it is in),
:meth:`ParallelDims.group_table` one row per group. The torch mesh of :func:`labkit.parallel.mesh.device_mesh` is
the same grid: ``init_device_mesh`` numbers ranks row-major over its shape, and the shape is ``order``
reversed (outermost first), so ``mesh["tp"]`` groups are exactly ``groups("tp")`` (tests/test_composed.py
checks this in a real run).

Validation rules
----------------
Each rule has an id (the ``rule`` of a :class:`Violation`, listed in :data:`RULES`). Bad input raises
:class:`MeshError` (a ValueError) naming every failing rule, the offending values and the valid choices
(the wording of :func:`labkit.checks.check_divides`). The divisibility rules are the ones a uniform split
needs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 2 and 3; Megatron-LM ``arguments.py`` checks): heads, kv heads, hidden and ffn sizes by
tp (Shoeybi et al. 2019, Sec. 3: a column split of Q/K/V by heads and of the MLP by ffn columns); experts by
ep; the global batch by dp·micro_batch_size·n_microbatches; the sequence by cp. Layers need not divide by pp:
published runs split them unevenly (Llama 3 405B: 126 layers on 16 stages, 7 + 14·8 + 7; Megatron-LM's
``--decoder-first/last-pipeline-num-layers``), so the rule is pp·vpp <= n_layers, with the split of
:func:`labkit.theory.memory.split_layers` (or a given ``layers_per_stage``). The vocabulary is not required
to divide by tp: Megatron pads it (``--make-vocab-size-divisible-by``); the lab's planner and memory
calculator do the same. Every "valid" list in a message passes every rule of its dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.checks import check_divides, divisors, positive_int
from labkit.theory.memory.conventions import MAX_BATCH, MAX_DEGREE, MAX_SEQ_LEN, bounded_int
from labkit.theory.memory.stages import resolve_split

#: dimensions of the rank grid, innermost (consecutive ranks) first: Megatron Core's default order
DEFAULT_ORDER = ("tp", "cp", "dp", "pp")
GRID_DIMS = frozenset(DEFAULT_ORDER)
#: every group kind :meth:`ParallelDims.groups` knows: the grid dimensions, ``dp_cp`` (the ranks that hold the
#: same dense shard: gradients are reduced and ZeRO shards over them), ``ep`` and ``edp`` (expert-parallel and
#: expert-data-parallel groups carved out of dp_cp)
GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")

#: rule id -> what it requires
RULES = {
    "degree": "every degree (dp, tp, pp, cp, ep, vpp) is an integer >= 1",
    "world_size": "world_size = dp * tp * pp * cp",
    "order": "order is a permutation of tp, cp, dp, pp",
    "ep_in_dp_cp": "ep divides dp * cp (expert parallelism is carved out of the data/context-parallel ranks)",
    "tp_heads": "tp divides n_heads",
    "tp_kv_heads": "tp divides n_kv_heads (heads split), or n_kv_heads divides tp (each kv head replicated)",
    "tp_hidden": "tp divides hidden_size",
    "tp_ffn": "tp divides ffn_hidden_size (and expert_ffn_hidden_size for MoE)",
    "pp_layers": "pp * vpp <= n_layers (every model chunk holds a layer; pp need not divide n_layers: the stage "
                 "split is uneven, fewer layers on the first and last stages), and a given layers_per_stage has pp "
                 "counts of >= vpp layers summing to n_layers",
    "ep_experts": "ep divides n_experts (and ep > 1 needs an MoE model)",
    "cp_seq": "cp divides seq_len",
    "global_batch": "global_batch_size = dp * micro_batch_size * n_microbatches",
    "pp_microbatches": "n_microbatches >= pp (and pp divides n_microbatches with vpp > 1)",
    "node_alignment": "every group lies in one node or has the same number of ranks on each node it spans",
}


@dataclass(frozen=True)
class Violation:
    """One failed rule: ``rule`` (a key of :data:`RULES`) and ``message`` (names the values and the fix)."""

    rule: str
    message: str


class MeshError(ValueError):
    """Invalid parallel degrees. ``violations``: every failed :class:`Violation`; ``rules``: their ids.

    The message is the first violation's message, followed by the others (one line)."""

    def __init__(self, violations: list[Violation]):
        self.violations = list(violations)
        self.rules = [v.rule for v in self.violations]
        msg = self.violations[0].message
        if len(self.violations) > 1:
            msg += "; also " + "; ".join(v.message for v in self.violations[1:])
        super().__init__(msg)


def _divides(rule: str, degree_name: str, degree: int, size_name: str, size: int, hint: str = "") -> list:
    try:
        check_divides(degree_name, degree, size_name, size, hint=hint)
    except ValueError as e:
        return [Violation(rule, f"[{rule}] {e}")]
    return []


def _merge_by_rule(violations: list[Violation]) -> list[Violation]:
    """One :class:`Violation` per rule, in first-seen order: two failures of the same rule (tp_ffn for the dense
    and the expert ffn of a MoE model) become one whose message joins both."""
    merged: dict[str, Violation] = {}
    for v in violations:
        if v.rule in merged:
            merged[v.rule] = Violation(v.rule, f"{merged[v.rule].message}; {v.message}")
        else:
            merged[v.rule] = v
    return list(merged.values())


def dim_placement(degree: int, stride: int, gpus_per_node: int) -> dict | None:
    """How the groups of one grid dimension sit on nodes of ``gpus_per_node`` ranks, from the group's
    ``degree`` and its rank ``stride`` (ranks ``base + k·stride``, k < degree; groups start at multiples of
    ``degree·stride`` or inside such a block).

    Returns ``{"ranks_per_node": r, "nodes": n, "within_node": n == 1}`` (every group of the dimension has r
    ranks on each of the n nodes it spans), or None when the groups straddle node boundaries unevenly (some
    nodes hold more of a group than others: the rule ``node_alignment``). Pure arithmetic, O(1).
    """
    d, s, g = degree, stride, gpus_per_node
    span = d * s
    if d == 1 or g % span == 0:
        return {"ranks_per_node": d, "nodes": 1, "within_node": True}
    if s >= g:  # neighbours are at least a node apart: one rank of the group per node
        return {"ranks_per_node": 1, "nodes": d, "within_node": False}
    if span % g == 0 and g % s == 0:
        return {"ranks_per_node": g // s, "nodes": span // g, "within_node": False}
    return None


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a composed run and their rank grid.

    Args:
        world_size: number of ranks; must equal dp·tp·pp·cp.
        dp, tp, pp, cp: data, tensor, pipeline and context parallel degrees (>= 1).
        ep: expert parallel degree (>= 1), carved out of dp·cp (module docstring).
        vpp: model chunks per pipeline rank (interleaved schedule; 1 = one chunk).
        order: grid dimensions innermost first (default :data:`DEFAULT_ORDER`, Megatron Core's).

    Raises:
        MeshError (a ValueError): a degree < 1 (rule ``degree``), the product not equal to world_size
            (``world_size``, the message says which dp would fit), ep not dividing dp·cp (``ep_in_dp_cp``), or
            an order that is not a permutation of tp, cp, dp, pp (``order``). Model-dependent rules are checked
            by :meth:`check`.
    """

    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    _strides: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        bad = []
        for name in ("world_size", "dp", "tp", "pp", "cp", "ep", "vpp"):
            try:
                object.__setattr__(self, name, bounded_int(name, getattr(self, name), MAX_DEGREE))
            except ValueError as e:
                bad.append(Violation("degree", f"[degree] {e}"))
        object.__setattr__(self, "order", tuple(self.order))
        if sorted(self.order) != sorted(DEFAULT_ORDER):
            bad.append(Violation("order", f"[order] order={'-'.join(map(str, self.order))} must be a permutation "
                                          f"of {', '.join(DEFAULT_ORDER)} (innermost first), e.g. "
                                          f"{'-'.join(DEFAULT_ORDER)}"))
        if bad:
            raise MeshError(bad)
        product = self.dp * self.tp * self.pp * self.cp
        if product != self.world_size:
            rest = self.tp * self.pp * self.cp
            if self.world_size % rest == 0:
                fix = f"set dp={self.world_size // rest} (world_size / (tp*pp*cp)) or world_size={product}"
            else:
                fix = (f"tp*pp*cp={rest} does not divide world_size={self.world_size}; valid tp*pp*cp: "
                       f"{', '.join(map(str, divisors(self.world_size)))}")
            bad.append(Violation("world_size", f"[world_size] world_size={self.world_size} != dp*tp*pp*cp = "
                                               f"{self.dp}*{self.tp}*{self.pp}*{self.cp} = {product}; {fix}"))
        else:
            bad += _divides("ep_in_dp_cp", "ep", self.ep, "dp*cp", self.dp * self.cp,
                            hint="expert parallelism is carved out of the data/context-parallel ranks")
        if bad:
            raise MeshError(bad)
        strides, s = {}, 1
        for dim in self.order:
            strides[dim] = s
            s *= self.degree(dim)
        object.__setattr__(self, "_strides", strides)

    # -- construction helpers ------------------------------------------------------------------------
    @classmethod
    def infer_dp(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, **kwargs) -> ParallelDims:
        """The dims with ``dp = world_size / (tp·pp·cp)``. Raises MeshError when tp·pp·cp does not divide
        world_size (rule ``world_size``, listing the valid products)."""
        world_size = bounded_int("world_size", world_size, MAX_DEGREE)
        rest = 1
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp)):
            try:
                rest *= positive_int(name, v)
            except ValueError as e:
                raise MeshError([Violation("degree", f"[degree] {e}")]) from None
        if world_size % rest:
            raise MeshError(_divides("world_size", "tp*pp*cp", rest, "world_size", world_size,
                                     hint=f"tp={tp} x pp={pp} x cp={cp}; dp = world_size / (tp*pp*cp)"))
        return cls(world_size, dp=world_size // rest, tp=tp, pp=pp, cp=cp, **kwargs)

    def degree(self, dim: str) -> int:
        """The degree of ``dim`` (one of :data:`GROUP_KINDS`: dp_cp = dp·cp, edp = dp·cp/ep)."""
        if dim == "dp_cp":
            return self.dp * self.cp
        if dim == "edp":
            return self.dp * self.cp // self.ep
        if dim not in GROUP_KINDS:
            raise ValueError(f"dim={dim!r} is not valid; choose one of: {', '.join(GROUP_KINDS)}")
        return getattr(self, dim)

    def __str__(self) -> str:
        parts = [f"{d}={self.degree(d)}" for d in ("dp", "tp", "pp", "cp") if self.degree(d) > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        return f"{' x '.join(parts) or 'single rank'} (world_size={self.world_size})"

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                "ep": self.ep, "vpp": self.vpp, "order": "-".join(self.order)}

    def parallel_config(self, **kwargs):
        """The matching :class:`labkit.theory.memory.ParallelConfig` (``kwargs``: zero, sequence_parallel, schedule)
        for the memory calculator."""
        from labkit.theory.memory import ParallelConfig

        if self.vpp > 1:
            kwargs.setdefault("schedule", "interleaved")
        return ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, vpp=self.vpp, **kwargs)

    # -- validation against a model and a batch ------------------------------------------------------
    def violations(self, spec=None, *, seq_len: int | None = None, global_batch_size: int | None = None,
                   micro_batch_size: int = 1, n_microbatches: int | None = None,
                   gpus_per_node: int | None = None, layers_per_stage=None) -> list[Violation]:
        """Every rule of :data:`RULES` these dims break for ``spec`` (a :class:`~labkit.theory.spec.ModelSpec`, or None
        to skip the model rules), ``seq_len`` (rule cp_seq), the batch (``global_batch_size`` sequences per
        step = dp · micro_batch_size · n_microbatches; n_microbatches None -> derived) and ``gpus_per_node``
        (node_alignment); ``layers_per_stage`` a stage split to check (rule pp_layers; None: the derived one).
        Empty when valid; each rule appears at most once (its message names every dimension or size that breaks
        it, and lists only values that pass every rule of that dimension). Raises ValueError only for a
        non-positive (or absurdly large) size argument, in bounded time."""
        out: list[Violation] = []
        if spec is not None:
            from labkit.theory.memory.config import valid_tp

            tp_bad = []
            for rule, size_name in (("tp_heads", "n_heads"), ("tp_hidden", "hidden_size"),
                                    ("tp_ffn", "ffn_hidden_size")):
                if getattr(spec, size_name) % self.tp:
                    tp_bad.append((rule, f"tp={self.tp} does not divide {size_name}={getattr(spec, size_name)}"))
            if spec.n_kv_heads % self.tp and self.tp % spec.n_kv_heads:
                # the rule of labkit.theory.memory.kv_heads_per_rank (the TP layers use it too): split or replicate
                tp_bad.append(("tp_kv_heads", f"tp={self.tp} neither divides n_kv_heads={spec.n_kv_heads} (to split "
                                              "the kv heads) nor is a multiple of it (to replicate them)"))
            if spec.is_moe and spec.expert_ffn_hidden_size != spec.ffn_hidden_size \
                    and spec.expert_ffn_hidden_size % self.tp:
                tp_bad.append(("tp_ffn", f"tp={self.tp} does not divide expert_ffn_hidden_size="
                                         f"{spec.expert_ffn_hidden_size}"))
            if tp_bad:  # every tp message lists the tp that pass every tp rule
                ok = ", ".join(map(str, valid_tp(spec)))
                out += [Violation(rule, f"[{rule}] {msg}; valid tp: {ok}") for rule, msg in tp_bad]
            try:
                resolve_split(spec.n_layers, self.pp, self.vpp, layers_per_stage)
            except ValueError as e:
                out.append(Violation("pp_layers", f"[pp_layers] {e}"))
            if self.ep > 1:
                if not spec.is_moe:
                    out.append(Violation("ep_experts", f"[ep_experts] ep={self.ep} needs a mixture-of-experts "
                                                       f"model; {spec.name!r} is dense (n_experts=0); valid ep: 1"))
                else:
                    out += _divides("ep_experts", "ep", self.ep, "n_experts", spec.n_experts)
        if seq_len is not None:
            out += _divides("cp_seq", "cp", self.cp, "seq_len", bounded_int("seq_len", seq_len, MAX_SEQ_LEN))
        if global_batch_size is not None:
            out += self._batch_violations(bounded_int("global_batch_size", global_batch_size, MAX_BATCH),
                                          bounded_int("micro_batch_size", micro_batch_size, MAX_BATCH), n_microbatches)
        if gpus_per_node is not None:
            out += self._node_violations(positive_int("gpus_per_node", gpus_per_node))
        return _merge_by_rule(out)

    def check(self, spec=None, **kwargs) -> ParallelDims:
        """Raise :class:`MeshError` listing every violation of :meth:`violations` (same arguments); return self."""
        bad = self.violations(spec, **kwargs)
        if bad:
            raise MeshError(bad)
        return self

    def n_microbatches(self, global_batch_size: int, micro_batch_size: int = 1) -> int:
        """Micro-batches per step: global_batch_size / (dp · micro_batch_size). Raises MeshError (rule
        global_batch) when that is not a whole number."""
        bad = self._batch_violations(global_batch_size, micro_batch_size, None, pp_rule=False)
        if bad:
            raise MeshError(bad)
        return global_batch_size // (self.dp * micro_batch_size)

    def _batch_violations(self, gbs: int, mbs: int, m: int | None, pp_rule: bool = True) -> list[Violation]:
        per = self.dp * mbs
        if m is None:
            if gbs % per:
                lo, hi = (gbs // per) * per, (gbs // per + 1) * per
                near = f"{lo} or {hi}" if lo else f"{hi}"
                return [Violation("global_batch", f"[global_batch] global_batch_size={gbs} is not a multiple of "
                                                  f"dp*micro_batch_size = {self.dp}*{mbs} = {per}; use a multiple "
                                                  f"of {per} (e.g. {near}) or another dp / micro_batch_size")]
            m = gbs // per
        else:
            m = positive_int("n_microbatches", m)
            if per * m != gbs:
                fit = f"n_microbatches={gbs // per}" if gbs % per == 0 else f"a global_batch_size multiple of {per}"
                return [Violation("global_batch", f"[global_batch] dp*micro_batch_size*n_microbatches = {self.dp}*"
                                                  f"{mbs}*{m} = {per * m} != global_batch_size={gbs}; use {fit}")]
        if not pp_rule or self.pp == 1:
            return []
        if m < self.pp:
            return [Violation("pp_microbatches", f"[pp_microbatches] n_microbatches={m} < pp={self.pp}: some "
                                                 f"stages would never overlap; use global_batch_size >= dp*"
                                                 f"micro_batch_size*pp = {per * self.pp} or a smaller pp")]
        if self.vpp > 1 and m % self.pp:
            return _divides("pp_microbatches", "pp", self.pp, "n_microbatches", m,
                            hint="the interleaved schedule runs micro-batches in groups of pp")
        return []

    def _node_violations(self, g: int) -> list[Violation]:
        if self.world_size > g and self.world_size % g:
            return [Violation("node_alignment", f"[node_alignment] world_size={self.world_size} is not a whole "
                                                f"number of nodes of gpus_per_node={g}; use a multiple of {g}")]
        bad = [f"{dim}={self.degree(dim)} (rank stride {self._strides[dim]})" for dim in self.order
               if self.degree(dim) > 1 and dim_placement(self.degree(dim), self._strides[dim], g) is None]
        if not bad:
            return []
        # one violation for the rule, naming every dimension that breaks it (a rule is listed once)
        return [Violation("node_alignment", f"[node_alignment] the groups of {', '.join(bad)} straddle nodes of "
                                            f"{g} unevenly; use degrees whose products with the inner dims divide "
                                            f"or are multiples of {g}")]

    # -- the rank grid ---------------------------------------------------------------------------------
    def stride(self, dim: str) -> int:
        """Rank distance between neighbours of a ``dim`` group (a grid dimension)."""
        if dim not in GRID_DIMS:
            raise ValueError(f"dim={dim!r} is not a grid dimension; choose one of: {', '.join(self.order)}")
        return self._strides[dim]

    def coords(self, rank: int) -> dict[str, int]:
        """The grid coordinates of ``rank``: {"tp": i, "cp": j, "dp": k, "pp": l}. ValueError if out of range."""
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise ValueError(f"rank={rank!r} must be in 0..{self.world_size - 1}")
        return {dim: (rank // self._strides[dim]) % self.degree(dim) for dim in self.order}

    def rank_of(self, **coords: int) -> int:
        """The rank at grid coordinates (missing dims are 0). ValueError for an unknown dim or out-of-range index."""
        r = 0
        for dim, i in coords.items():
            if dim not in GRID_DIMS:
                raise ValueError(f"{dim!r} is not a grid dimension; choose from: {', '.join(self.order)}")
            if not 0 <= i < self.degree(dim):
                raise ValueError(f"{dim}={i} must be in 0..{self.degree(dim) - 1}")
            r += i * self._strides[dim]
        return r

    def groups(self, dim: str) -> list[list[int]]:
        """The groups of kind ``dim`` (:data:`GROUP_KINDS`), each a sorted list of ranks; the groups are sorted
        by their first rank and together hold every rank once.

        tp / cp / dp / pp: the ranks that differ only in that coordinate. dp_cp: ranks with the same tp and
        pp coordinates (they hold the same dense shard). ep: consecutive runs of ``ep`` ranks of each dp_cp
        group; edp: the ranks of a dp_cp group ``ep`` apart (same expert shard) — Megatron Core's layout.
        """
        if dim not in GROUP_KINDS:
            raise ValueError(f"dim={dim!r} is not valid; choose one of: {', '.join(GROUP_KINDS)}")
        if dim in GRID_DIMS:
            varying = (dim,)
        else:
            varying = ("dp", "cp")
        fixed_dims = [d for d in self.order if d not in varying]
        out = []
        for base in self._bases(fixed_dims):
            ranks = [base]
            for d in varying:
                ranks = [r + k * self._strides[d] for r in ranks for k in range(self.degree(d))]
            out.append(sorted(ranks))
        if dim == "ep":
            out = [g[i:i + self.ep] for g in out for i in range(0, len(g), self.ep)]
        elif dim == "edp":
            out = [g[i::self.ep] for g in out for i in range(self.ep)]
        return sorted(out)

    def _bases(self, dims: list[str]) -> list[int]:
        bases = [0]
        for d in dims:
            bases = [b + k * self._strides[d] for b in bases for k in range(self.degree(d))]
        return bases

    def grid(self, gpus_per_node: int | None = None) -> list[dict]:
        """One row per rank: ``rank``, ``node`` (with gpus_per_node), its coordinates ``pp, dp, cp, tp`` and,
        for every group kind, the index of its group in :meth:`groups` (``tp_group``, ``cp_group``,
        ``dp_group``, ``pp_group``, ``dp_cp_group``, and ``ep_group``/``edp_group`` when ep > 1).
        ``pandas.DataFrame(dims.grid())`` shows it as a table."""
        kinds = ["tp", "cp", "dp", "pp", "dp_cp"] + (["ep", "edp"] if self.ep > 1 else [])
        index = {}
        for kind in kinds:
            for gi, ranks in enumerate(self.groups(kind)):
                for r in ranks:
                    index[(kind, r)] = gi
        rows = []
        for r in range(self.world_size):
            row = {"rank": r}
            if gpus_per_node:
                row["node"] = r // positive_int("gpus_per_node", gpus_per_node)
            c = self.coords(r)
            row.update({d: c[d] for d in ("pp", "dp", "cp", "tp")})
            row.update({f"{k}_group": index[(k, r)] for k in kinds})
            rows.append(row)
        return rows

    def group_table(self, gpus_per_node: int | None = None) -> list[dict]:
        """One row per group of every dimension of degree > 1 (dp_cp when both dp and cp are > 1; ep, edp
        when ep > 1): ``dim``, ``group`` (index), ``ranks`` (list), ``size``, and with gpus_per_node the
        ``nodes`` the group spans and ``link`` ("intra-node" or "inter-node")."""
        rows = []
        kinds = [d for d in ("tp", "cp", "dp", "pp") if self.degree(d) > 1]
        kinds += (["dp_cp"] if self.cp > 1 and self.dp > 1 else []) + (["ep", "edp"] if self.ep > 1 else [])
        for kind in kinds:
            for gi, ranks in enumerate(self.groups(kind)):
                row = {"dim": kind, "group": gi, "ranks": ranks, "size": len(ranks)}
                if gpus_per_node:
                    nodes = sorted({r // gpus_per_node for r in ranks})
                    row["nodes"] = nodes
                    row["link"] = "intra-node" if len(nodes) == 1 else "inter-node"
                rows.append(row)
        return rows

    def placement(self, gpus_per_node: int) -> dict[str, dict]:
        """Per grid dimension: ``degree``, ``stride`` and :func:`dim_placement` on nodes of ``gpus_per_node``
        (``ranks_per_node``, ``nodes``, ``within_node``). Raises MeshError (rule node_alignment) when a
        dimension's groups straddle nodes unevenly."""
        g = positive_int("gpus_per_node", gpus_per_node)
        bad = self._node_violations(g)
        if bad:
            raise MeshError(bad)
        return {dim: {"degree": self.degree(dim), "stride": self._strides[dim],
                      **dim_placement(self.degree(dim), self._strides[dim], g)} for dim in self.order}

    # -- the torch mesh's shape ----------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the torch DeviceMesh: the degrees in ``order`` reversed (outermost first)."""
        return tuple(self.degree(d) for d in reversed(self.order))

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(reversed(self.order))


def enumerate_dims(world_size: int, *, max_tp: int | None = None, max_pp: int | None = None,
                   max_cp: int | None = None, ep_choices=(1,)) -> list[ParallelDims]:
    """Every (dp, tp, pp, cp, ep) with dp·tp·pp·cp = world_size and ep dividing dp·cp (ep from ``ep_choices``),
    tp/pp/cp optionally capped. Model rules are not checked here (see :meth:`ParallelDims.violations`).
    O(d(world)^3) candidates: 680 for 16,384 ranks with ep=1. Raises ValueError for a cap < 1 (None: no cap)."""
    world_size = bounded_int("world_size", world_size, MAX_DEGREE)
    max_tp, max_pp, max_cp = (None if v is None else positive_int(n, v)
                              for n, v in (("max_tp", max_tp), ("max_pp", max_pp), ("max_cp", max_cp)))
    out = []
    divs = divisors(world_size)
    for tp in divs:
        if max_tp and tp > max_tp:
            break
        for pp in divisors(world_size // tp):
            if max_pp and pp > max_pp:
                break
            for cp in divisors(world_size // (tp * pp)):
                if max_cp and cp > max_cp:
                    break
                dp = world_size // (tp * pp * cp)
                for ep in ep_choices:
                    if (dp * cp) % ep == 0:
                        out.append(ParallelDims(world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep))
    return out


def grid_text(dims: ParallelDims) -> str:
    """The groups of every grid dimension as text, e.g. ``TP groups: [0, 1] [2, 3]`` (one line each)."""
    lines = []
    for dim in ("tp", "cp", "dp", "pp", "ep"):
        if dims.degree(dim) > 1:
            lines.append(f"{dim.upper()} groups: " + " ".join(str(g) for g in dims.groups(dim)))
    return "\n".join(lines) or "single rank: no groups"
