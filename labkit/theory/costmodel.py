"""Predict the time of collectives: bus-bandwidth factors, the alpha-beta (latency-bandwidth) model, ring vs
tree all-reduce on the links of ``data/hardware.yaml``, and the alpha-beta fit of measured sweeps.

Pure Python (no torch, no numpy, no pandas): fast enough behind a widget slider. Everything returns plain
numbers, dataclasses or lists of dicts; ``pandas.DataFrame(rows)`` turns the lists into tables.

Conventions: sizes in bytes (int), times in seconds (float), bandwidths in GB/s (1 GB/s = 1e9 bytes/s).
``S`` is the size of a collective as nccl-tests counts it: the whole buffer (for all_gather the gathered
output, for reduce_scatter the full input, for all_to_all the whole send buffer).

Sources of the formulas:

* algbw = S/t and the busbw correction factors: NVIDIA nccl-tests, ``doc/PERFORMANCE.md``
  (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md, section "Summary").
* alpha-beta cost of ring collectives: Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
  Communication Operations in MPICH", IJHPCA 19(1), section 4 (ring all-gather ``(p-1)a + (p-1)/p n b``;
  reduce-scatter the same without the reduction term; all-reduce = reduce-scatter + all-gather,
  ``2(p-1)a + 2(p-1)/p n b``); Patarasuk & Yuan 2009 (bandwidth-optimal ring all-reduce).
* tree all-reduce with full bandwidth (two pipelined binary trees): Sanders, Speck & Traeff 2009, "Two-tree
  algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 35(12); NCCL's model of it:
  ``src/graph/tuning.cc`` (latency ``2((g-1) a_intra + log2(nodes) a_inter)``, algbw = busbw / 2).
* per-hop latencies and the fixed launch latency: NCCL's own tuning model (``hwLat``, ``baseLat`` in
  ``src/graph/tuning.cc``), quoted with their URL in data/hardware.yaml.
* tensor-parallel communication per layer (two all-reduces in the forward pass, one after attention and one
  after the MLP): Shoeybi et al. 2019, "Megatron-LM", section 3 and Figure 4 (the ``g`` operator).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from labkit.checks import check_choice, positive_float, positive_int
from labkit.paths import data_dir
from labkit.yamlload import load_path

#: Operations the sweep measures, in the order tables list them.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
#: The busbw correction factor of each op, as text (nccl-tests doc/PERFORMANCE.md "Summary").
FACTOR_TEXT = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "send_recv": "1",
}
#: Ops whose buffer is split into ``n`` equal chunks (S must be a multiple of n elements).
SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")
ALGORITHMS = ("ring", "tree")
GB = 1e9


# ------------------------------------------------------------------------------------------------------
# bandwidth definitions (nccl-tests)
# ------------------------------------------------------------------------------------------------------
def min_world_size(op: str) -> int:
    """The smallest world size at which ``op`` moves data between ranks (2 for every op of :data:`OPS`).

    Raises ValueError for an unknown op."""
    check_choice("op", op, OPS)
    return 2


def check_world_size(op: str, world_size: int) -> int:
    """Return ``world_size`` if ``op`` can run on it, else ValueError saying why."""
    n = positive_int("world_size", world_size)
    need = min_world_size(op)
    if n < need:
        why = {"send_recv": "a send needs a peer"}.get(op, "with one rank nothing crosses a link")
        raise ValueError(f"world_size={n} is too small for op={op!r}: it needs at least {need} ranks ({why})")
    return n


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (nccl-tests doc/PERFORMANCE.md, "Summary"):
    all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all ``(n-1)/n``; broadcast, send_recv 1.

    Raises ValueError for an unknown op or world_size < 1."""
    check_choice("op", op, OPS)
    n = positive_int("world_size", world_size)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in SPLIT_OPS:
        return (n - 1) / n
    return 1.0


def algbw_gbps(nbytes: int, time_s: float) -> float:
    """Algorithm bandwidth ``S / t`` in GB/s (nccl-tests doc/PERFORMANCE.md). Raises ValueError for
    nbytes < 1 or time_s <= 0."""
    nbytes = positive_int("nbytes", nbytes)
    time_s = positive_float("time_s", time_s)
    return nbytes / time_s / GB


def busbw_gbps(op: str, world_size: int, nbytes: int, time_s: float) -> float:
    """Bus bandwidth ``algbw * bus_factor(op, n)`` in GB/s, comparable with a link's peak whatever ``n``
    (nccl-tests doc/PERFORMANCE.md, "Summary").

    Raises:
        ValueError: unknown op (the message lists :data:`OPS`), world_size < 1, nbytes < 1, or time_s not a
            finite number > 0.
    """
    return algbw_gbps(nbytes, time_s) * bus_factor(op, world_size)


# ------------------------------------------------------------------------------------------------------
# alpha-beta fit
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AlphaBeta:
    """``t(S) = alpha_s + beta_s_per_byte * S`` (Hockney 1994, "The communication challenge for MPP",
    Parallel Computing 20(3): latency and inverse bandwidth).

    Attributes: ``alpha_s`` latency (s), ``beta_s_per_byte`` inverse bandwidth (s/byte), ``n_points`` the
    points fitted, ``rms_rel_residual`` the root-mean-square of ``(t_fit - t)/t`` over those points.
    """

    alpha_s: float
    beta_s_per_byte: float
    n_points: int = 0
    rms_rel_residual: float = float("nan")

    @property
    def bandwidth_gbps(self) -> float:
        """``1 / beta`` in GB/s (the algbw the op approaches for large S); inf when beta <= 0."""
        return 1.0 / self.beta_s_per_byte / GB if self.beta_s_per_byte > 0 else math.inf

    def predict(self, nbytes: int | float) -> float:
        """Predicted time in seconds for ``nbytes``."""
        return self.alpha_s + self.beta_s_per_byte * float(nbytes)


def _fit_size(value) -> float:
    """One message size of a fit, in bytes: a finite number >= 1 (ValueError naming it otherwise)."""
    if isinstance(value, bool):
        raise ValueError(f"nbytes={value!r} must be a finite number >= 1 (bytes)")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"nbytes={value!r} must be a finite number >= 1 (bytes)") from None
    if not math.isfinite(x) or x < 1:
        raise ValueError(f"nbytes={value!r} must be a finite number >= 1 (bytes)")
    return x


def fit_alpha_beta(nbytes: Sequence[float], times_s: Sequence[float], *, relative: bool = True) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * S`` to measured (size, time) points (Hockney 1994).

    ``relative=True`` (default) minimises the relative residuals ``sum(((alpha + beta S) - t) / t)^2``
    (weighted least squares with weights ``1/t^2``), so the microsecond times of small messages count as much
    as the millisecond times of large ones, as they do on the log-log plot; ``relative=False`` is ordinary
    least squares. Closed-form 2x2 normal equations (no numpy), solved on sizes and times scaled to at most 1
    so that no sum overflows.

    Args:
        nbytes: sizes S in bytes (finite, >= 1; at least 2 distinct values).
        times_s: measured times in seconds (finite, > 0), same length.

    Raises:
        ValueError: different lengths, fewer than 2 distinct sizes, a size that is not a finite number >= 1
            (inf, nan, 0, negative, not a number), or a time that is not a finite number > 0.
    """
    xs = [_fit_size(s) for s in nbytes]
    ts = [positive_float("time_s", t) for t in times_s]
    if len(xs) != len(ts):
        raise ValueError(f"nbytes has {len(xs)} values but times_s has {len(ts)}; give one time per size")
    if len(set(xs)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 distinct sizes, got {sorted(set(xs))}")
    x_scale, t_scale = max(xs), max(ts)
    us = [x / x_scale for x in xs]
    vs = [t / t_scale for t in ts]
    ws = [1.0 / (v * v) if relative else 1.0 for v in vs]
    sw = sum(ws)
    su = sum(w * u for w, u in zip(ws, us, strict=True))
    suu = sum(w * u * u for w, u in zip(ws, us, strict=True))
    sv = sum(w * v for w, v in zip(ws, vs, strict=True))
    suv = sum(w * u * v for w, u, v in zip(ws, us, vs, strict=True))
    det = sw * suu - su * su
    if not (math.isfinite(det) and det > 0):
        raise ValueError(f"nbytes={list(nbytes)!r}, times_s={list(times_s)!r}: the sizes are too close "
                         "together (or too far apart) to fit a line; give sizes that differ by at least 2x")
    alpha = (suu * sv - su * suv) / det * t_scale
    beta = (sw * suv - su * sv) / det * t_scale / x_scale
    rel = [((alpha + beta * x) - t) / t for x, t in zip(xs, ts, strict=True)]
    rms = math.sqrt(sum(r * r for r in rel) / len(rel))
    return AlphaBeta(alpha, beta, len(xs), rms)


# ------------------------------------------------------------------------------------------------------
# hardware facts
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One interconnect from data/hardware.yaml.

    Attributes:
        name: key in ``links:``.
        bandwidth_gbps: per GPU, per direction, GB/s (what a ring step can use).
        bidirectional_gbps: the datasheet's both-directions figure, GB/s (often the one advertised).
        hop_latency_s: latency of one ring step over this link, s (NCCL tuning model ``hwLat``, Ring/LL).
        tree_hop_latency_s: the same for one tree step (``hwLat``, Tree/LL).
        source, latency_source: public URLs of the numbers.
        nvls: the switch behind the link does NVLink SHARP (NVSwitch 3 and later), so NCCL may run NVLS.
    """

    name: str
    bandwidth_gbps: float
    bidirectional_gbps: float
    hop_latency_s: float
    tree_hop_latency_s: float
    description: str = ""
    source: str = ""
    latency_source: str = ""
    nvls: bool = False


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict:
    return load_path(path) or {}  # PyYAML (libyaml when built), else labkit.yamlload's reader


def hardware(path: str | Path | None = None) -> dict:
    """The parsed data/hardware.yaml (or ``path``): keys ``devices``, ``links``, ``nccl_model``."""
    return _load(str(path or data_dir() / "hardware.yaml"))


def links(path: str | Path | None = None) -> dict[str, Link]:
    """All links of data/hardware.yaml by name."""
    hw = hardware(path)
    base = hw.get("nccl_model", {})
    out = {}
    for name, d in (hw.get("links") or {}).items():
        out[name] = Link(name=name, bandwidth_gbps=float(d["bandwidth_gbps"]),
                         bidirectional_gbps=float(d["bidirectional_gbps"]),
                         hop_latency_s=float(d["hop_latency_us"]) * 1e-6,
                         tree_hop_latency_s=float(d.get("tree_hop_latency_us", d["hop_latency_us"])) * 1e-6,
                         description=d.get("description", ""),
                         source=d.get("source", ""), latency_source=base.get("source", ""),
                         nvls=bool(d.get("nvls", False)))
    return out


def get_link(name: str | Link, path: str | Path | None = None) -> Link:
    """The link ``name`` (a :class:`Link` is returned as is). Raises ValueError naming the known links."""
    if isinstance(name, Link):
        return name
    known = links(path)
    check_choice("link", name, known)
    return known[name]


def devices(path: str | Path | None = None) -> dict[str, dict]:
    """All GPUs of data/hardware.yaml (``devices:``) by name, each a dict of its fields."""
    return dict(hardware(path).get("devices") or {})


def get_device(name: str, path: str | Path | None = None) -> dict:
    """One GPU's fields. Raises ValueError naming the known devices."""
    known = devices(path)
    check_choice("device", name, known)
    return known[name]


def base_latency_s(algorithm: str = "ring", path: str | Path | None = None) -> float:
    """Fixed latency of one collective call (NCCL tuning model ``baseLat``, LL protocol), seconds.

    Raises ValueError for an algorithm not in :data:`ALGORITHMS`."""
    check_choice("algorithm", algorithm, ALGORITHMS)
    return float(hardware(path).get("nccl_model", {}).get(f"base_latency_{algorithm}_us", 0.0)) * 1e-6


def bandwidth_ladder(path: str | Path | None = None) -> list[dict]:
    """One row per memory and link bandwidth of data/hardware.yaml, fastest first: ``what``, ``kind``
    (``memory`` | ``link``), ``bandwidth_gbps`` (per direction for links), ``source``."""
    rows = []
    for name, d in devices(path).items():
        if "hbm_gbps" in d:
            rows.append({"what": f"{name} {d.get('memory_type', 'HBM')}", "kind": "memory",
                         "bandwidth_gbps": float(d["hbm_gbps"]), "source": d.get("source", "")})
    for link in links(path).values():
        rows.append({"what": link.name, "kind": "link", "bandwidth_gbps": link.bandwidth_gbps,
                     "source": link.source})
    return sorted(rows, key=lambda r: -r["bandwidth_gbps"])


# ------------------------------------------------------------------------------------------------------
# predictions
# ------------------------------------------------------------------------------------------------------
def _nodes(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) for a world of ``world_size`` ranks packed ``gpus_per_node`` to a node."""
    g = min(world_size, gpus_per_node)
    if world_size % g:
        raise ValueError(f"world_size={world_size} is not a whole number of nodes of gpus_per_node="
                         f"{gpus_per_node}; use a multiple of {gpus_per_node} or at most {gpus_per_node}")
    return world_size // g, g


def collective_time(op: str, nbytes: int, world_size: int, intra: str | Link = "nvlink4",
                    inter: str | Link | None = "ib-ndr", *, gpus_per_node: int = 8, algorithm: str | None = None,
                    include_base: bool = True, nvls: bool | None = None) -> float:
    """Predicted seconds for one collective of S = ``nbytes`` on ``world_size`` GPUs packed ``gpus_per_node``
    to a node, priced as NCCL runs it (:mod:`labkit.theory.nccl`: every algorithm and protocol NCCL would
    consider, the fastest taken; :func:`collective_choice` says which). ``algorithm`` ``"ring"`` / ``"tree"``
    forces one as ``NCCL_ALGO`` does (None: NCCL's pick); ``nvls`` None = the intra link's NVLink SHARP
    capability; ``include_base=False`` drops NCCL's per-call ``baseLat``. One NIC per GPU across nodes.

    Raises:
        ValueError: unknown op/algorithm/link, nbytes < 1, world_size below what op needs, world_size not
            a whole number of nodes, a multi-node world without ``inter``, or tree for an op but all_reduce.
    """
    if algorithm is not None:
        check_choice("algorithm", algorithm, ALGORITHMS)
    n = check_world_size(op, world_size)
    nbytes = positive_int("nbytes", nbytes)
    gpus_per_node = positive_int("gpus_per_node", gpus_per_node)
    nodes, g = _nodes(n, gpus_per_node)
    if algorithm == "tree" and op != "all_reduce":
        raise ValueError(f"algorithm='tree' is modelled for op='all_reduce' only, got op={op!r}; "
                         "use algorithm='ring'")
    if nodes > 1 and inter is None:
        raise ValueError(f"world_size={n} spans {nodes} nodes of {gpus_per_node} GPUs: give an inter-node "
                         f"link (inter=...), one of: {', '.join(links())}")
    return placed_collective_time(op, nbytes, n, nodes, g, intra=intra, inter=inter if nodes > 1 else None,
                                  nics_per_node=g, include_base=include_base, nvls=nvls, algorithm=algorithm)


def collective_choice(op: str, nbytes: float, n: int, nodes: int, ranks_per_node: int, *, intra: str | Link,
                      inter: str | Link | None = None, nics_per_node: int = 1, nvls: bool | None = None,
                      link_efficiency: float = 1.0) -> dict:
    """Which algorithm and protocol NCCL would run for ``op`` (:data:`labkit.theory.nccl.NCCL_OPS`) on a
    placed group (as :func:`placed_collective_time`), and its time: ``{"algorithm", "protocol", "time_s",
    "latency_s", "algbw_gbps"}``, all *predicted* (:func:`labkit.theory.nccl.choose`). Raises ValueError as
    that function does."""
    from labkit.theory import nccl

    a = get_link(intra)
    e = get_link(inter) if inter is not None else None
    c = nccl.choose(op, float(nbytes), n, nodes, ranks_per_node, intra=a, inter=e, nics=nics_per_node,
                    nvls=a.nvls if nvls is None else bool(nvls), link_efficiency=link_efficiency)
    return {"algorithm": c.algorithm, "protocol": c.protocol, "time_s": c.time_s, "latency_s": c.latency_s,
            "algbw_gbps": c.algbw_gbps}


def ring_vs_tree(nbytes_list: Sequence[int], world_sizes: Sequence[int] = (8, 64, 1024),
                 intra: str = "nvlink4", inter: str = "ib-ndr", gpus_per_node: int = 8) -> list[dict]:
    """Predicted all-reduce time, ring vs tree (each forced, as ``NCCL_ALGO`` does), for each size and world size
    (rows of a table).

    Each row: ``world_size, nodes, bytes, ring_s, tree_s, faster`` (``'ring'`` or ``'tree'``), all
    *predicted* by :func:`collective_time`, and ``source`` = ``"predicted"`` so a table of them says so.

    Raises ValueError as :func:`collective_time` does (unknown link, sizes < 1, a world that is not a whole
    number of nodes)."""
    rows = []
    for n in world_sizes:
        for s in nbytes_list:
            ring = collective_time("all_reduce", s, n, intra, inter, gpus_per_node=gpus_per_node,
                                   algorithm="ring")
            tree = collective_time("all_reduce", s, n, intra, inter, gpus_per_node=gpus_per_node,
                                   algorithm="tree")
            rows.append({"world_size": n, "nodes": _nodes(n, gpus_per_node)[0], "bytes": int(s),
                         "ring_s": ring, "tree_s": tree, "faster": "ring" if ring <= tree else "tree",
                         "source": "predicted"})
    return rows


def tp_forward_comm(n_layers: int, hidden_size: int, seq_len: int, micro_batch_size: int, tp: int,
                    link: str | Link, *, bytes_per_element: int = 2, include_base: bool = True) -> dict:
    """Predicted communication time of one forward pass of a tensor-parallel transformer, all ranks of the
    TP group joined by ``link`` (one GPU per node when the link is a network: every hop crosses it).

    Per layer the forward pass does 2 all-reduces of the activations, ``b * s * h`` elements each
    (Shoeybi et al. 2019, Megatron-LM, sec. 3, Fig. 4: the ``g`` operator after attention and after the MLP).

    Returns a dict: ``allreduce_bytes`` (S of one all-reduce), ``n_allreduce`` (2 * n_layers),
    ``allreduce_s`` (one, predicted), ``forward_comm_s`` (all of them, predicted), ``link``, and ``source`` =
    ``"predicted"`` (every number is the model's, none measured).

    Raises ValueError for non-positive sizes, tp < 2, or an unknown link.
    """
    for name, v in (("n_layers", n_layers), ("hidden_size", hidden_size), ("seq_len", seq_len),
                    ("micro_batch_size", micro_batch_size), ("bytes_per_element", bytes_per_element)):
        positive_int(name, v)
    tp = positive_int("tp", tp, minimum=2)
    lk = get_link(link)
    s = micro_batch_size * seq_len * hidden_size * bytes_per_element
    one = collective_time("all_reduce", s, tp, lk, lk, gpus_per_node=tp, include_base=include_base)
    return {"link": lk.name, "allreduce_bytes": s, "n_allreduce": 2 * n_layers, "allreduce_s": one,
            "forward_comm_s": 2 * n_layers * one, "source": "predicted"}


# ------------------------------------------------------------------------------------------------------
# a collective on an arbitrary group of global ranks: placement and the hierarchical model
# ------------------------------------------------------------------------------------------------------
#: ops :func:`group_collective_time` prices: :data:`OPS` plus ``barrier`` (latency only)
GROUP_OPS = (*OPS, "barrier")


def group_placement(ranks: Sequence[int], gpus_per_node: int) -> dict:
    """Where a group of global ranks sits when rank r lives on node ``r // gpus_per_node``.

    Returns ``{"n": ranks in the group, "nodes": nodes it touches, "ranks_per_node": the most ranks of the
    group on one node, "within_node": bool}``. Raises ValueError for an empty group, a negative or repeated
    rank, or gpus_per_node < 1.
    """
    g = positive_int("gpus_per_node", gpus_per_node)
    rs = list(ranks)
    if not rs:
        raise ValueError("ranks is empty; a group needs at least one global rank")
    if len(set(rs)) != len(rs) or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rs):
        raise ValueError(f"ranks={rs!r} must be distinct global ranks (ints >= 0)")
    per: dict[int, int] = {}
    for r in rs:
        per[r // g] = per.get(r // g, 0) + 1
    return {"n": len(rs), "nodes": len(per), "ranks_per_node": max(per.values()), "within_node": len(per) == 1}


def group_collective_time(op: str, nbytes: int, ranks: Sequence[int], *, gpus_per_node: int,
                          intra: str | Link, inter: str | Link | None = None, nics_per_node: int = 1,
                          link_efficiency: float = 1.0, include_base: bool = True, nvls: bool | None = None) -> float:
    """Predicted seconds of one collective of S = ``nbytes`` (nccl-tests convention) on the group of global
    ``ranks``, each rank r on node ``r // gpus_per_node`` (the placement of :func:`group_placement`), priced as
    NCCL runs it (:func:`placed_collective_time`: n ranks, N nodes, k ranks per node).

    * all_reduce, all_gather, reduce_scatter, broadcast: the fastest of NCCL's algorithms (ring, tree, NVLS,
      NVLSTree) and protocols (LL, LL128, Simple), each with NCCL's latency table and per-protocol bandwidth
      factors on bus bandwidths below line rate (fitted ``bus_efficiency`` / ``net_efficiency``); across nodes
      a ring's channels leave through the node's NICs, so its bus bandwidth is ``min(B_intra, min(k, NICs) x
      B_nic)`` (:mod:`labkit.theory.nccl`, whose docstring gives every formula and source);
    * all_to_all: ``max((k-1)/n * S/B_i, (n-k)/n * S/B_e)`` (intra and network traffic in parallel, each rank's
      network share ``B_e = B_nic min(1, NICs/k)``) plus one point-to-point latency;
    * send_recv: one transfer (:func:`labkit.theory.nccl.p2p_time`), over a NIC across nodes;
    * barrier: the latency of an all_reduce of nothing.

    ``link_efficiency`` (default 1.0) derates every bandwidth further; ``nvls`` None = the intra link's NVLink
    SHARP capability. No contention between groups (labkit.theory.replay shares links). ``ranks`` of one rank
    cost 0.

    Raises:
        ValueError: unknown op (listing :data:`GROUP_OPS`), nbytes < 0, bad ranks, a multi-node group without
            ``inter``, nics_per_node < 1, send_recv on a group that is not 2 ranks, or link_efficiency
            outside (0, 1].
    """
    place = group_placement(ranks, gpus_per_node)
    if op == "send_recv" and place["n"] not in (1, 2):
        raise ValueError(f"op='send_recv' is between 2 ranks, got a group of {place['n']}: {list(ranks)!r}")
    return placed_collective_time(op, nbytes, place["n"], place["nodes"], place["ranks_per_node"], intra=intra,
                                  inter=inter, nics_per_node=nics_per_node, link_efficiency=link_efficiency,
                                  include_base=include_base, gpus_per_node=gpus_per_node, nvls=nvls)


def placed_collective_time(op: str, nbytes: float, n: int, nodes: int, ranks_per_node: int, *, intra: str | Link,
                           inter: str | Link | None = None, nics_per_node: int = 1, link_efficiency: float = 1.0,
                           include_base: bool = True, gpus_per_node: int | None = None, nvls: bool | None = None,
                           algorithm: str | None = None, prm=None) -> float:
    """:func:`group_collective_time` for a group given by its placement instead of its ranks: ``n`` ranks on
    ``nodes`` nodes, at most ``ranks_per_node`` on one (what :func:`group_placement` returns). The same
    formulas, in O(1) whatever the group's size (a fixed number of NCCL candidates), so a planner scoring
    thousands of meshes of 10**4 ranks can price every group (:mod:`labkit.theory.planner`). ``algorithm``
    forces one (``NCCL_ALGO``); ``prm`` replaces the fitted :class:`labkit.theory.nccl.NcclParams`. Raises
    ValueError as :func:`group_collective_time` does, and for a placement that cannot exist (n < 1, nodes < 1,
    ranks_per_node outside 1..n, nodes x ranks_per_node < n)."""
    from labkit.theory import nccl

    n, nodes, k = positive_int("n", n), positive_int("nodes", nodes), positive_int("ranks_per_node", ranks_per_node)
    if k > n or nodes * k < n or nodes > n:
        raise ValueError(f"a group of n={n} ranks cannot sit on nodes={nodes} with at most ranks_per_node={k}")
    if gpus_per_node is not None and k > positive_int("gpus_per_node", gpus_per_node):
        raise ValueError(f"ranks_per_node={k} exceeds gpus_per_node={gpus_per_node}")
    check_choice("op", op, GROUP_OPS)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
        raise ValueError(f"nbytes={nbytes!r} must be a number of bytes >= 0")
    nics = positive_int("nics_per_node", nics_per_node)
    eff = positive_float("link_efficiency", link_efficiency)
    if eff > 1:
        raise ValueError(f"link_efficiency={link_efficiency!r} must be in (0, 1] (a fraction of the line rate)")
    if n == 1:
        return 0.0
    if op == "send_recv" and n != 2:
        raise ValueError(f"op='send_recv' is between 2 ranks, got a group of {n}")
    a = get_link(intra)
    if nodes > 1 and inter is None:
        raise ValueError(f"a group of {n} ranks spans {nodes} nodes: give an inter-node link (inter=...), one of: "
                         f"{', '.join(links())}")
    e = get_link(inter) if nodes > 1 else None
    prm = prm or nccl.params()
    base = 1.0 if include_base else 0.0
    s = float(nbytes)
    if op == "send_recv":
        return nccl.p2p_time(s, nodes > 1, intra=a, inter=e, prm=prm, link_efficiency=eff, base_scale=base).time_s
    if op == "all_to_all":
        lat = nccl.p2p_time(0.0, nodes > 1, intra=a, inter=e, prm=prm, base_scale=base).latency_s
        b_i = a.bandwidth_gbps * GB * prm.efficiency(a.name) * eff
        if nodes == 1:
            return lat + (k - 1) / n * s / b_i
        b_e = e.bandwidth_gbps * GB * prm.efficiency(e.name) * eff * min(1.0, nics / k)
        return lat + max((k - 1) / n * s / b_i, (n - k) / n * s / b_e)
    kind = "all_reduce" if op == "barrier" else op
    c = nccl.choose(kind, 0.0 if op == "barrier" else s, n, nodes, k, intra=a, inter=e, nics=nics,
                    nvls=a.nvls if nvls is None else bool(nvls), prm=prm, link_efficiency=eff, base_scale=base,
                    algorithm=algorithm)
    return c.time_s


def group_link(ranks: Sequence[int], gpus_per_node: int, intra: str | Link, inter: str | Link | None) -> str:
    """The name of the slowest link a group's collective crosses: the intra-node link when the group is
    inside one node, else the inter-node one; ``"-"`` for a group of one rank. Raises ValueError as
    :func:`group_placement` does."""
    place = group_placement(ranks, gpus_per_node)
    if place["n"] == 1:
        return "-"
    lk = intra if place["within_node"] else inter
    return lk.name if isinstance(lk, Link) else str(lk)
