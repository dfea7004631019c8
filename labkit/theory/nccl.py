"""Collectives priced as NCCL runs them: for each call NCCL prices every (algorithm, protocol) pair with its own
latency-bandwidth model and runs the fastest; this module does the same and says which one it picked.

Pure Python (no torch, no numpy, no pandas). Sizes in bytes, times in seconds, bandwidths in GB/s (1e9 B/s).
``S`` is the nccl-tests size (the whole buffer; nccl-tests ``doc/PERFORMANCE.md``).

Structure (NVIDIA/nccl ``src/graph/tuning.cc`` at commit b6475625, NCCL 2.19,
https://github.com/NVIDIA/nccl/blob/b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2/src/graph/tuning.cc):

* ``time = latency(algo, proto) + S / algbw(algo, proto)`` and NCCL takes the minimum (``ncclTopoGetAlgoTime``);
* algorithms: ``ring`` (every op), ``tree`` (all_reduce), ``nvls`` (all_reduce inside one node with NVLink
  SHARP), ``nvls_tree`` (all_reduce across nodes with NVLink SHARP inside each); CollNet is not modelled;
* protocols ``LL`` / ``LL128`` / ``Simple`` with NCCL's per-protocol bus-bandwidth factors (ring LL 1/4 for
  all_reduce or multi-node, else 1/3, capped at ``llMaxBw``; LL128 x 0.92 (0.7 with one rank per node); tree
  x 0.92, LL /3.8, LL128 x 7/9 in one node or 120/128 across nodes; the tree's size correction table), and
  NCCL's latency table (``baseLat`` per call, ``hwLat`` per step by link class NVLink / PCI / NET; ring steps
  ``2(n-1)`` for all_reduce with ``2 x nodes`` of them on the network, ``n-1`` for all_gather / reduce_scatter;
  tree ``2((k-1) a_intra + log2(nodes) a_net)``; the 1.4x plateau of a multi-node Simple ring all_reduce).

What is *not* NCCL's constant but fitted (:class:`NcclParams`, values in data/hardware.yaml ``nccl_model.fitted``,
fitted by :func:`fit_params` on the ``role == calibration`` rows of data/reference/published/collectives.csv
only; docs/costmodel.md has the residuals):

* ``bus_efficiency[link]``: the busbw a Simple ring reaches on a link, as a fraction of its per-direction line
  rate (NCCL's own prior is its ``SM90_NVLINK_BW`` 20.6 GB/s of a 25 GB/s NVLink 4 lane, 0.82; the NCCL
  maintainer's "~20 % protocol overhead", NVIDIA/nccl-tests#212);
* ``net_efficiency``: the same for one NIC (the maintainer's "46-48 GB/s per NIC" at NDR, nccl-tests#290);
* ``nvls_efficiency``: NVLink SHARP's bandwidth as a fraction of the line rate, and ``nvls_latency_s`` its fixed
  cost per call; NVLS all_reduce algbw = ``B_nvls * n / (n + 1)`` (each GPU sends its buffer to the switch
  once and receives 1/n of it back per phase: the data movement the NCCL maintainer describes for NVLS in
  NVIDIA/nccl#1506), so 2-4 GPUs stay on the ring and 5-8 gain (NVIDIA/nccl#1455's measurements);
* latencies: NCCL's latency table is its selection model, not a measurement (measured small-message
  latencies are 2-3x it, NVIDIA/nccl-tests#123); the model keeps its step counts and per-step link latencies
  (``hwLat``, LL column: the link's ``hop_latency_s``) times one fitted ``step_scale``, and NCCL's per-call
  ``baseLat`` of each protocol (ring row) times one fitted ``base_scale`` (``call_latency_s``).

Across nodes (``nodes > 1``, ``k`` ranks per node, ``nics`` NICs): a ring's NCCL channels each leave a node
through their own NIC (rail-optimised), so a ring's bus bandwidth is ``min(B_intra, min(k, nics) * B_nic)``;
NVLSTree's is ``min(B_nvls k/(k+1), min(k, nics) B_nic)`` on 2 nodes and half the network term beyond (a
binary tree's inner node sends and receives twice).
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass, field, replace

from labkit.checks import check_choice

GB = 1e9
PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree")
#: ops NCCL prices (the rest of labkit.theory.costmodel.OPS are point-to-point)
NCCL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

# --- NCCL's own constants (tuning.cc at b6475625; module docstring) -------------------------------------------
#: baseLat[algo][proto], us
BASE_LAT_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 0.0), "nvls": (0.0, 0.0, 0.0),
               "nvls_tree": (0.0, 0.0, 0.0)}
#: hwLat[link class][algo][proto], us per step
HW_LAT_US = {
    "nvlink": {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 28.0), "nvls": (0.0, 0.0, 23.0),
               "nvls_tree": (0.0, 0.0, 23.0)},
    "pci": {"ring": (1.0, 2.5, 5.7), "tree": (1.0, 1.9, 28.0), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "net": {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 28.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 14.0)},
}
#: llMaxBws (GB/s): one node (Ampere/Hopper row), two nodes, more (Intel CPU row)
LL_MAX_BW = (87.7, 39.0, 20.4)
#: treeCorrectionFactor[proto][log2(S / 64)], for S from 64 B to 256 MiB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
#: NCCL's ring LL per-step latency of each link class: a Link's ``hop_latency_s`` is this figure
REF_HOP_US = {"nvlink": 0.6, "pci": 1.0, "net": 2.7}
REF_BASE_US = 6.6


def link_class(name: str) -> str:
    """NCCL's hardware class of a link name: ``nvlink``, ``pci`` or ``net`` (anything not NVLink or PCIe)."""
    n = str(name).lower()
    return "nvlink" if n.startswith("nvlink") else "pci" if n.startswith("pcie") else "net"


@dataclass(frozen=True)
class NcclParams:
    """The fitted parameters of the model (module docstring); ``source`` says where they came from."""

    bus_efficiency: dict = field(default_factory=dict)
    default_bus_efficiency: float = 0.8
    net_efficiency: float = 0.94
    nvls_efficiency: float = 0.68
    nvls_latency_s: float = 23e-6
    step_scale: float = 1.0
    call_latency_s: tuple = (6.6e-6, 14.0e-6, 8.4e-6)
    source: str = "NCCL's tuning-model priors (unfitted)"

    def efficiency(self, link_name: str) -> float:
        """Fraction of ``link_name``'s line rate a Simple ring reaches (the network's for a network link)."""
        if link_class(link_name) == "net":
            return self.net_efficiency
        return float(self.bus_efficiency.get(link_name, self.default_bus_efficiency))

    def as_vector(self) -> dict:
        """The free parameters by name (what :func:`fit_params` moves)."""
        out = {f"bus_efficiency.{k}": v for k, v in sorted(self.bus_efficiency.items())}
        out.update(net_efficiency=self.net_efficiency, nvls_efficiency=self.nvls_efficiency,
                   nvls_latency_us=self.nvls_latency_s * 1e6,
                   step_scale=self.step_scale,
                   base_scale=self.call_latency_s[0] / (BASE_LAT_US["ring"][0] * 1e-6))
        return out

    def with_value(self, name: str, value: float) -> NcclParams:
        """A copy with the free parameter ``name`` (a key of :meth:`as_vector`) set to ``value``."""
        if name.startswith("bus_efficiency."):
            return replace(self, bus_efficiency={**self.bus_efficiency, name.split(".", 1)[1]: value})
        if name == "base_scale":
            return replace(self, call_latency_s=tuple(b * 1e-6 * value for b in BASE_LAT_US["ring"]))
        if name == "nvls_latency_us":
            return replace(self, nvls_latency_s=value * 1e-6)
        return replace(self, **{name: value})


@functools.lru_cache(maxsize=2)
def _params_from(path: str | None) -> NcclParams:
    from labkit.theory import costmodel

    d = (costmodel.hardware(path).get("nccl_model") or {}).get("fitted") or {}
    if not d:
        return NcclParams()
    return NcclParams(bus_efficiency={k: float(v) for k, v in (d.get("bus_efficiency") or {}).items()},
                      default_bus_efficiency=float(d.get("default_bus_efficiency", 0.8)),
                      net_efficiency=float(d["net_efficiency"]), nvls_efficiency=float(d["nvls_efficiency"]),
                      nvls_latency_s=float(d["nvls_latency_us"]) * 1e-6,
                      step_scale=float(d["step_scale"]),
                      call_latency_s=tuple(b * 1e-6 * float(d["base_scale"]) for b in BASE_LAT_US["ring"]),
                      source=str(d.get("source", "fit")))


def params(path=None) -> NcclParams:
    """The fitted :class:`NcclParams` of data/hardware.yaml (``nccl_model.fitted``); NCCL's priors if absent."""
    return _params_from(str(path) if path else None)


@dataclass(frozen=True)
class Choice:
    """One priced (algorithm, protocol): ``time_s`` = ``latency_s`` + S / ``algbw_gbps``."""

    algorithm: str
    protocol: str
    time_s: float
    latency_s: float
    algbw_gbps: float


def _tree_corr(p: int, nbytes: float) -> float:
    x = int(nbytes) >> 6
    log = x.bit_length() - 1 if x > 0 else 0
    return TREE_CORRECTION[p][log] if log < len(TREE_CORRECTION[p]) else 1.0


def choices(op: str, nbytes: float, n: int, nodes: int, k: int, *, intra, inter=None, nics: int = 1,
            nvls: bool = False, prm: NcclParams | None = None, link_efficiency: float = 1.0,
            base_scale: float = 1.0, algorithm: str | None = None, protocol: str | None = None) -> list[Choice]:
    """Every (algorithm, protocol) NCCL would price for ``op`` of S = ``nbytes`` on ``n`` ranks over ``nodes``
    nodes (``k`` ranks per node), ``intra`` / ``inter`` :class:`~labkit.theory.costmodel.Link` objects, ``nics``
    NICs per node. ``nvls`` allows NVLink SHARP; ``algorithm`` / ``protocol`` restrict the set as ``NCCL_ALGO`` /
    ``NCCL_PROTO`` do; ``base_scale`` multiplies NCCL's per-call ``baseLat`` (0 drops it); ``link_efficiency``
    derates every bandwidth further. Each latency is NCCL's table times the link's ``hop_latency_s`` relative to
    NCCL's ring-LL figure of its class, times the fitted ``step_scale``. Formulas: module docstring.

    Raises ValueError for an op outside :data:`NCCL_OPS`, an unknown algorithm or protocol, or an empty result
    (e.g. ``algorithm='nvls'`` without NVLS)."""
    check_choice("op", op, NCCL_OPS)
    if algorithm is not None:
        check_choice("algorithm", algorithm, ALGORITHMS)
    if protocol is not None:
        check_choice("protocol", protocol, PROTOCOLS)
    prm = prm or params()
    s = float(nbytes)
    ci = link_class(intra.name)
    ce = link_class(inter.name) if (inter is not None and nodes > 1) else ci
    b_i = intra.bandwidth_gbps * prm.efficiency(intra.name) * link_efficiency
    hop_i = intra.hop_latency_s / (REF_HOP_US[ci] * 1e-6) if REF_HOP_US[ci] else 0.0
    if nodes > 1:
        b_nic = inter.bandwidth_gbps * prm.efficiency(inter.name) * link_efficiency
        b_ring = min(b_i, min(k, nics) * b_nic)
        hop_e = inter.hop_latency_s / (REF_HOP_US[ce] * 1e-6)
    else:
        b_nic, b_ring, hop_e = math.inf, b_i, 0.0
    ppn = k
    out: list[Choice] = []

    def lat(algo: str, p: int, intra_steps: float, net_steps: float) -> float:
        steps_us = intra_steps * HW_LAT_US[ci][algo][0] * hop_i + net_steps * HW_LAT_US["net"][algo][0] * hop_e
        return prm.call_latency_s[p] * base_scale + steps_us * 1e-6 * prm.step_scale

    def add(algo: str, p: int, latency: float, algbw: float) -> None:
        if (algorithm and algo != algorithm) or (protocol and PROTOCOLS[p] != protocol) or not algbw > 0:
            return
        t = latency + (s / (algbw * GB) if math.isfinite(algbw) else 0.0)
        out.append(Choice(algo, PROTOCOLS[p], t, latency, algbw))

    ll_max = LL_MAX_BW[min(nodes, 3) - 1]
    # ring
    if op == "all_reduce":
        steps, net_steps, ratio = 2 * (n - 1), (2 * nodes if nodes > 1 else 0), n / (2.0 * (n - 1))
    elif op == "broadcast":
        steps, net_steps, ratio = n - 1, nodes - 1, 1.0
    else:
        steps, net_steps, ratio = n - 1, nodes - 1, n / (n - 1.0)
    net_steps = min(net_steps, steps)  # one rank per node: every step is a network step
    for p in range(3):
        bus = b_ring
        if p == 0:
            bus = min(ll_max, bus * (0.25 if (nodes > 1 or op == "all_reduce") else 1 / 3))
        elif p == 1:
            bus = bus * (0.7 if ppn < 2 else 0.92)
        la = lat("ring", p, steps - net_steps, net_steps)
        if p == 2 and nodes > 1 and op == "all_reduce":
            la *= 1.4  # "plateau effect of ring" (tuning.cc, ncclTopoGetAlgoTime)
        add("ring", p, la, bus * ratio)
    if op != "all_reduce":
        return _nonempty(out, op, algorithm, protocol)
    # tree
    b_tree = b_ring * 0.92
    for p in range(3):
        bus = b_tree
        if p == 0:
            bus = min(bus / 3.8, ll_max)
        elif p == 1:
            bus = bus * (7 / 9 if nodes == 1 else 120 / 128)
        la = lat("tree", p, 2 * (k - 1), 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0)
        add("tree", p, la, bus * 0.5 * _tree_corr(p, s))
    # NVLink SHARP
    if nvls and ci == "nvlink" and k >= 2:
        b_nvls = intra.bandwidth_gbps * prm.nvls_efficiency * link_efficiency * k / (k + 1.0)
        if nodes == 1:
            add("nvls", 2, prm.nvls_latency_s, b_nvls)
        else:
            net = min(k, nics) * b_nic * (1.0 if nodes <= 2 else 0.5)
            la = prm.nvls_latency_s + 2 * math.ceil(math.log2(nodes)) * HW_LAT_US["net"]["nvls_tree"][2] * hop_e * 1e-6
            add("nvls_tree", 2, la, min(b_nvls, net))
    return _nonempty(out, op, algorithm, protocol)


def _nonempty(out: list[Choice], op, algorithm, protocol) -> list[Choice]:
    if not out:
        raise ValueError(f"no NCCL algorithm for op={op!r} with algorithm={algorithm!r}, protocol={protocol!r}: "
                         "NVLS needs an NVLink profile with nvls on, tree is all_reduce only")
    return out


def choose(op: str, nbytes: float, n: int, nodes: int, k: int, **kw) -> Choice:
    """The fastest of :func:`choices` (what NCCL runs). Same arguments; same errors."""
    return min(choices(op, nbytes, n, nodes, k, **kw), key=lambda c: c.time_s)


def p2p_time(nbytes: float, cross_node: bool, *, intra, inter=None, prm: NcclParams | None = None,
             link_efficiency: float = 1.0, base_scale: float = 1.0) -> Choice:
    """One send/recv of S bytes between two ranks: the fastest protocol of a one-step ring (NCCL's p2p runs
    the same protocols): ``scale_p (baseLat_p + hwLat_p) + S / (B * f_p)`` with f = 1/3, 0.92, 1 for LL,
    LL128, Simple and B the intra-node link or one NIC (``cross_node``). Raises nothing for S >= 0."""
    prm = prm or params()
    link = inter if cross_node else intra
    c = link_class(link.name)
    b = link.bandwidth_gbps * prm.efficiency(link.name) * link_efficiency
    hop = link.hop_latency_s / (REF_HOP_US[c] * 1e-6)
    best = None
    for p, f in enumerate((1 / 3, 0.92, 1.0)):
        la = prm.call_latency_s[p] * base_scale + HW_LAT_US[c]["ring"][0] * hop * 1e-6 * prm.step_scale
        bw = min(LL_MAX_BW[0], b * f) if p == 0 else b * f
        t = la + (float(nbytes) / (bw * GB) if math.isfinite(bw) and bw > 0 else 0.0)
        if best is None or t < best.time_s:
            best = Choice("p2p", PROTOCOLS[p], t, la, bw)
    return best


# ------------------------------------------------------------------------------------------------------
# published rows: the model's prediction of one, and the fit
# ------------------------------------------------------------------------------------------------------
def profile_for(row: dict) -> str:
    """The cluster profile of data/hardware.yaml that stands for a published row: ``dgx-a100`` for an A100,
    ``dgx-h100-nonvls`` for an H100/H200 whose row says NVLS was disabled (``NCCL_NVLS_ENABLE=0`` or 'NVLS
    disabled'), ``dgx-h100`` for every other H100/H200 (NCCL's default: NVLS on). Raises ValueError for other
    GPUs."""
    gpu = str(row.get("gpu", ""))
    words = (str(row.get("interconnect", "")) + " " + str(row.get("what", ""))).upper()
    if "A100" in gpu:
        return "dgx-a100"
    if "H100" in gpu or "H200" in gpu:
        return "dgx-h100-nonvls" if ("NVLS DISABLED" in words or "NVLS_ENABLE=0" in words) else "dgx-h100"
    raise ValueError(f"gpu={gpu!r}: no cluster profile stands for it (H100, H200 or A100)")


@functools.lru_cache(maxsize=8)
def _cluster(name: str):
    from labkit.theory.cluster import get_cluster

    return get_cluster(name)


#: size at which a peak row without a size is priced (the model's busbw is still rising below it)
PEAK_BYTES = 4 * 2**30


def _int(x, default=None):
    try:
        return int(float(x))
    except (TypeError, ValueError):
        return default


def predict_row(row: dict, prm: NcclParams | None = None) -> dict:
    """The model's busbw (and ``value``: busbw, or the time in us for a ``metric == time`` row) for one
    collectives.csv row: the row's op, size (:data:`PEAK_BYTES` for a peak),
    world size, nodes and NICs on :func:`profile_for`'s profile, the algorithm the row forced (NCCL_ALGO=RING
    in ``what``) respected. Returns ``{"profile", "bytes", "time_s", "busbw_gbps", "value", "algorithm", "protocol"}``.
    Raises ValueError for a row without world size / gpus_per_node or an op the model does not price."""
    from labkit.theory import costmodel

    prof = profile_for(row)
    cl = _cluster(prof)
    n, g = _int(row.get("world_size")), _int(row.get("gpus_per_node"))
    if not n or not g:
        raise ValueError(f"row {row.get('source')!r} has no world_size / gpus_per_node to price")
    nodes = _int(row.get("nodes"), 1) or 1
    k = n // nodes
    s = _int(row.get("bytes")) or PEAK_BYTES
    nics = _int(row.get("nics_per_node")) or cl.nics_per_node
    what = str(row.get("what", "")).upper()
    algo = "ring" if "NCCL_ALGO=RING" in what else None
    op = row["op"]
    lk_inter = costmodel.get_link("ib-hdr" if "HDR" in str(row.get("interconnect", "")) else cl.inter.name)
    if op in NCCL_OPS:
        c = choose(op, s, n, nodes, k, intra=cl.intra, inter=lk_inter, nics=nics, nvls=cl.nvls, prm=prm,
                   algorithm=algo)
    else:
        t = costmodel.placed_collective_time(op, s, n, nodes, k, intra=cl.intra, inter=lk_inter, nics_per_node=nics,
                                             nvls=cl.nvls, prm=prm)
        c = Choice("p2p", "-", t, 0.0, s / t / GB)
    bus = s / c.time_s / GB * costmodel.bus_factor(op, n)
    value = c.time_s * 1e6 if row.get("metric") == "time" else bus
    return {"profile": prof, "bytes": s, "time_s": c.time_s, "algorithm": c.algorithm, "protocol": c.protocol,
            "busbw_gbps": bus, "value": value}


def load_rows(path=None) -> list[dict]:
    """The rows of data/reference/published/collectives.csv (or ``path``) as dicts of strings."""
    from labkit.paths import data_dir

    p = path or data_dir() / "reference" / "published" / "collectives.csv"
    with open(p, newline="") as f:
        return list(csv.DictReader(f))


def usable(row: dict) -> bool:
    """A row the model is compared with: not ``excluded``, with a world size and gpus per node."""
    return not str(row.get("excluded") or "").strip() and bool(_int(row.get("world_size"))) and bool(
        _int(row.get("gpus_per_node")))


def _loss(rows: list[dict], prm: NcclParams) -> float:
    tot = 0.0
    for r in rows:
        pred = predict_row(r, prm)["value"]
        tot += math.log(pred / float(r["value"])) ** 2
    return tot


#: each free parameter's search interval
BOUNDS = {"net_efficiency": (0.5, 1.0), "nvls_efficiency": (0.3, 1.0), "nvls_latency_us": (0.0, 300.0),
          "step_scale": (0.2, 10.0), "base_scale": (0.0, 10.0)}


#: rows at or above this size (and peaks) fit the bandwidth parameters; the latency parameters fit on all rows
ASYMPTOTE_BYTES = 256 * 2**20
BANDWIDTH_PARAMS = ("bus_efficiency.", "net_efficiency", "nvls_efficiency")


def fit_params(rows: list[dict] | None = None, start: NcclParams | None = None, sweeps: int = 3) -> tuple:
    """Fit :class:`NcclParams` on the ``role == calibration`` rows only (:func:`labkit.theory.calibrate.
    calibration_rows` is the gate; excluded and unpriceable rows are skipped), in two stages, each a coordinate
    descent (a golden-section search per parameter on its :data:`BOUNDS`, bus efficiencies in [0.5, 1])
    minimising the sum of squared log ratios predicted/published:

    1. the bandwidth parameters (``bus_efficiency``, ``net_efficiency``, ``nvls_efficiency``) on the rows of
       S >= :data:`ASYMPTOTE_BYTES` and the peaks (where latency is a few percent at most);
    2. the latency parameters (``step_scale``, ``base_scale``, ``nvls_latency_us``) on every calibration
       row, the bandwidths held.

    Returns ``(params, {"rows": n, "bandwidth_rows": m, "rms_log": r})``. Raises ValueError (from the gate) for
    a row without a valid role."""
    from labkit.theory.calibrate import calibration_rows

    cal = [r for r in calibration_rows(load_rows() if rows is None else rows) if usable(r)]
    big = [r for r in cal if r.get("metric") != "time" and (_int(r.get("bytes")) or PEAK_BYTES) >= ASYMPTOTE_BYTES]
    prm = start or NcclParams(bus_efficiency={"nvlink3": 0.8, "nvlink4": 0.824})
    names = list(prm.as_vector())
    bw_names = [n for n in names if n.startswith(BANDWIDTH_PARAMS)]
    lat_names = [n for n in names if n not in bw_names]
    for subset, stage_rows in ((bw_names, big), (lat_names, cal)):
        if not stage_rows:
            continue
        for _ in range(sweeps):
            for name in subset:
                lo, hi = BOUNDS.get(name, (0.5, 1.0))
                prm = prm.with_value(name, _golden(lambda v, nm=name, p0=prm, rs=stage_rows: _loss(
                    rs, p0.with_value(nm, v)), lo, hi))
    rms = math.sqrt(_loss(cal, prm) / len(cal)) if cal else float("nan")
    return replace(prm, source="fit (labkit.theory.nccl.fit_params, calibration rows)"), {
        "rows": len(cal), "bandwidth_rows": len(big), "rms_log": rms}


def _golden(f, lo: float, hi: float, iters: int = 30) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


#: the collectives goal (issue 26): busbw within 10 % from 1 MiB up, small-message latency within 30 %
BANDWIDTH_TOLERANCE = 0.10
LATENCY_TOLERANCE = 0.30
#: below this size a row is judged as a small-message latency
SMALL_BYTES = 2**20


def validation_table(rows: list[dict] | None = None, prm: NcclParams | None = None) -> list[dict]:
    """Every ``role == validation`` row that is not excluded, beside the model: ``source, op, world_size,
    nodes, bytes, metric, published, predicted`` (busbw in GB/s, or time in us for a ``time`` row; ``predicted
    (labkit.theory.nccl)`` on the row's profile), ``ratio`` = predicted/published, ``regime`` (``bandwidth`` for
    S >= :data:`SMALL_BYTES` or a peak, else ``latency``), ``tolerance``, ``passed``, ``algorithm``, ``protocol``,
    ``profile``. A latency row passes when the predicted *time* is within :data:`LATENCY_TOLERANCE` of the
    published one (busbw ratio inverted), a bandwidth row when its busbw is within :data:`BANDWIDTH_TOLERANCE`.
    Raises ValueError (the role gate) for a row without a valid role."""
    from labkit.theory.calibrate import validation_rows

    out = []
    for r in validation_rows(load_rows() if rows is None else rows):
        if not usable(r):
            continue
        p = predict_row(r, prm)
        pub = float(r["value"])
        ratio = p["value"] / pub
        small = r.get("metric") == "time" or p["bytes"] < SMALL_BYTES
        time_ratio = ratio if r.get("metric") == "time" else 1.0 / ratio
        tol = LATENCY_TOLERANCE if small else BANDWIDTH_TOLERANCE
        ok = abs((time_ratio if small else ratio) - 1.0) <= tol
        out.append({"source": r["source"], "op": r["op"], "world_size": _int(r["world_size"]),
                    "nodes": _int(r.get("nodes"), 1), "bytes": p["bytes"], "metric": r.get("metric"),
                    "published": pub, "predicted": p["value"], "ratio": ratio,
                    "regime": "latency" if small else "bandwidth", "tolerance": tol, "passed": ok,
                    "algorithm": p["algorithm"], "protocol": p["protocol"], "profile": p["profile"]})
    return out


def line_rate_params() -> NcclParams:
    """The old model as parameters, for mutation tests: every link at line rate, no NVLS, NCCL's latency table
    unscaled (what labkit priced before this model)."""
    return NcclParams(bus_efficiency={}, default_bus_efficiency=1.0, net_efficiency=1.0, nvls_efficiency=0.0,
                      nvls_latency_s=0.0, step_scale=1.0, source="mutation: line rate")


def constant_efficiency_params(eff: float = 0.8) -> NcclParams:
    """A one-number model, for mutation tests: every link at ``eff`` of line rate, no NVLS, unscaled latencies."""
    return NcclParams(bus_efficiency={}, default_bus_efficiency=eff, net_efficiency=eff, nvls_efficiency=0.0,
                      nvls_latency_s=0.0, step_scale=1.0, source=f"mutation: constant {eff}")
