"""Cluster profiles: what a named GPU cluster charges for compute and communication (used by the emulator,
:mod:`labkit.runtime.emulate`, and usable by any prediction).

Pure Python (no torch). A :class:`Cluster` is a :class:`Device` (peak FLOP/s per dtype, memory bandwidth and
size), ``gpus_per_node``, the link inside a node, the network between nodes and its NICs per node, plus the
emulator's named efficiency parameters. :func:`get_cluster` reads the profiles of ``data/hardware.yaml``
(``clusters:``, every number with its source); ``Cluster(...)`` builds a custom one.

Rank r sits on node ``r // gpus_per_node`` (the launcher's order: consecutive ranks fill a node first, as
``torchrun`` assigns them).

Costs (each a documented formula; sizes in bytes, times in seconds, bandwidths in GB/s = 1e9 B/s):

* compute of one operation (:meth:`Cluster.compute_s`), the roofline model (Williams, Waterman & Patterson
  2009, "Roofline", CACM 52(4)): ``max(flops / (peak[dtype] * compute_efficiency),
  bytes / (memory_bandwidth * memory_efficiency)) + kernel_overhead_s``;
* one kernel priced by its shape (:meth:`Cluster.kernel_s`): GEMMs, flash attention and memory-bound kernels
  by :mod:`labkit.theory.kernels` with the profile's ``kernels`` (:class:`~labkit.theory.kernels.KernelParams`,
  defaults per device from data/hardware.yaml, each with its source); unshaped operations fall back to the
  roofline above;
* a collective on a group of global ranks (:meth:`Cluster.collective_s`):
  :func:`labkit.theory.costmodel.group_collective_time` (ring inside a node, hierarchical across nodes);
* a point-to-point transfer (:meth:`Cluster.p2p_s`): the same function for ``send_recv`` on the pair.

``nvls`` (None = the intra link's capability) lets NCCL use NVLink SHARP; ``comm_compute_share`` is the share of
the GPU's compute a communication kernel occupies while it overlaps compute (NCCL runs on SMs: DeepSeek-V3
dedicates 20 of 132 H100 SMs to communication, arXiv 2412.19437 sec. 3.2.2); the emulator's replay applies it.

Default efficiencies, each a named parameter (the emulator states the values it used):

* ``compute_efficiency`` = 0.5: the fraction of the dense peak the compute kernels reach, the planner's
  ``DEFAULT_MFU`` (Megatron-LM reaches 52 % of A100 peak end to end for a 1T-parameter GPT, Narayanan et al.
  2021, "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 5.1); one factor for every op,
  so small, memory-bound kernels are charged by their bytes, not by this factor;
* ``memory_efficiency`` = 0.8: the fraction of the memory bandwidth a streaming kernel reaches (an assumption
  of the lab; STREAM-like copy kernels reach 80-90 % of HBM peak);
* ``link_efficiency`` = 1.0: no derating beyond the NCCL model's own (:mod:`labkit.theory.nccl` already prices
  bus bandwidth below line rate: its fitted ``bus_efficiency``, about 0.82 of NVLink 4 for a ring);
* ``kernel_overhead_s`` = 0.0: no per-operation launch cost (a GPU kernel launch costs a few microseconds; set
  it to charge small, launch-bound operations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from labkit.checks import check_choice, positive_int
from labkit.theory import costmodel
from labkit.theory import kernels as kmodel

#: dtypes a device's peak is given for, as the emulator names them (torch dtype names map onto these)
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16")
#: torch dtype name (``str(torch.float32)`` without ``torch.``) -> :data:`DTYPES` entry; anything else is fp32
TORCH_DTYPES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: bytes per element of each dtype
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
EFFICIENCIES = ("compute_efficiency", "memory_efficiency", "link_efficiency")


def _fraction(name: str, value) -> float:
    """A number in (0, 1] (ValueError naming ``name`` otherwise: 0, negative, > 1, NaN, not a number)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number in (0, 1]") from None
    if isinstance(value, bool) or math.isnan(x) or not 0 < x <= 1:
        raise ValueError(f"{name}={value!r} must be a number in (0, 1] (a fraction of the peak)")
    return x


def _positive(name: str, value, *, allow_inf: bool = True) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number > 0") from None
    if isinstance(value, bool) or math.isnan(x) or x <= 0 or (math.isinf(x) and not allow_inf):
        raise ValueError(f"{name}={value!r} must be a number > 0")
    return x


@dataclass(frozen=True)
class Device:
    """One GPU as the emulator charges it.

    Attributes:
        name: the ``devices:`` key of data/hardware.yaml (or any name for a custom device).
        peak_tflops: dense peak per dtype (keys of :data:`DTYPES`), TFLOP/s = 1e12 FLOP/s; ``fp32`` is required,
            a missing dtype falls back to fp32. ``math.inf`` is allowed (compute that costs nothing).
        memory_gbps: memory bandwidth, GB/s (HBM or GDDR); ``math.inf`` allowed.
        memory_bytes: capacity, bytes (0 = unknown).
        source: public URL of the numbers.

    Raises ValueError for a missing fp32 peak, an unknown dtype key or a value that is not > 0.
    """

    name: str
    peak_tflops: dict
    memory_gbps: float
    memory_bytes: int = 0
    source: str = ""

    def __post_init__(self):
        peaks = dict(self.peak_tflops or {})
        for k, v in peaks.items():
            check_choice("peak_tflops dtype", k, DTYPES)
            peaks[k] = _positive(f"peak_tflops[{k!r}]", v)
        if "fp32" not in peaks:
            raise ValueError(f"device {self.name!r}: peak_tflops needs an 'fp32' entry (the fallback for every "
                             f"dtype), got {sorted(peaks)}")
        object.__setattr__(self, "peak_tflops", peaks)
        object.__setattr__(self, "memory_gbps", _positive("memory_gbps", self.memory_gbps))

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (a :data:`DTYPES` name or a torch dtype name such as ``float32``),
        falling back to fp32."""
        d = TORCH_DTYPES.get(dtype, dtype)
        return self.peak_tflops.get(d, self.peak_tflops["fp32"]) * 1e12

    @classmethod
    def from_hardware(cls, name: str) -> Device:
        """The device ``name`` of data/hardware.yaml. Raises ValueError for an unknown device or one without
        peak FLOP/s or memory bandwidth data (naming the devices that have them)."""
        d = costmodel.get_device(name)
        peaks = {dt: float(d[f"peak_{dt}_tflops"]) for dt in DTYPES if f"peak_{dt}_tflops" in d}
        bw = d.get("hbm_gbps", d.get("memory_gbps"))
        if "fp32" not in peaks or bw is None:
            ok = [n for n, e in costmodel.devices().items() if "peak_fp32_tflops" in e
                  and ("hbm_gbps" in e or "memory_gbps" in e)]
            raise ValueError(f"device {name!r} has no peak_fp32_tflops or memory bandwidth in data/hardware.yaml; "
                             f"choose one of: {', '.join(sorted(ok))}")
        return cls(name, peaks, float(bw), int(d.get("memory_bytes", 0)), d.get("source", ""))


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster profile: what each compute and communication event of an emulated run costs.

    Attributes:
        device: a :class:`Device` or a device name of data/hardware.yaml.
        gpus_per_node: GPUs (ranks) per node; rank r is on node ``r // gpus_per_node``.
        intra: the link between GPUs of one node (a :class:`~labkit.theory.costmodel.Link` or a link name).
        inter: the network between nodes (Link, name, or None for a single-node profile).
        name: profile name (``dgx-h100`` ...; default ``"custom"``), the ``<profile>`` of the label.
        nics_per_node: network ports per node (8 on a rail-optimised DGX: one per GPU).
        rail_optimized: every GPU's NIC on its own switch rail (descriptive: the model has no contention).
        compute_efficiency, memory_efficiency, link_efficiency: fractions in (0, 1] (module docstring).
        kernel_overhead_s: seconds added to every charged operation (>= 0).
        base_latency_s: fixed seconds of every collective call; None = NCCL's ``baseLat`` (ring, LL) of
            data/hardware.yaml (:func:`labkit.theory.costmodel.base_latency_s`).
        description, source: what the profile is, and the public URL of its numbers.

    Raises ValueError (at construction) for an unknown device or link, gpus_per_node or nics_per_node < 1, an
    efficiency outside (0, 1] or NaN, or a negative kernel overhead.
    """

    device: Device | str
    gpus_per_node: int
    intra: costmodel.Link | str
    inter: costmodel.Link | str | None = None
    name: str = "custom"
    nics_per_node: int = 1
    rail_optimized: bool = True
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    link_efficiency: float = 1.0
    kernel_overhead_s: float = 0.0
    base_latency_s: float | None = None
    nvls: bool | None = None
    comm_compute_share: float = 0.0
    description: str = ""
    source: str = field(default="", compare=False)
    kernels: kmodel.KernelParams | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Cluster name={self.name!r} must be a non-empty string")
        dev = self.device if isinstance(self.device, Device) else Device.from_hardware(self.device)
        object.__setattr__(self, "device", dev)
        object.__setattr__(self, "gpus_per_node", positive_int("gpus_per_node", self.gpus_per_node))
        object.__setattr__(self, "nics_per_node", positive_int("nics_per_node", self.nics_per_node))
        object.__setattr__(self, "intra", costmodel.get_link(self.intra))
        if self.inter is not None:
            object.__setattr__(self, "inter", costmodel.get_link(self.inter))
        for name in EFFICIENCIES:
            object.__setattr__(self, name, _fraction(name, getattr(self, name)))
        k = self.kernel_overhead_s
        if isinstance(k, bool) or not isinstance(k, (int, float)) or math.isnan(k) or k < 0 or math.isinf(k):
            raise ValueError(f"kernel_overhead_s={k!r} must be a number of seconds >= 0")
        object.__setattr__(self, "kernel_overhead_s", float(k))
        b = costmodel.base_latency_s("ring") if self.base_latency_s is None else self.base_latency_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b < 0 or math.isinf(b):
            raise ValueError(f"base_latency_s={b!r} must be a number of seconds >= 0")
        object.__setattr__(self, "base_latency_s", float(b))
        object.__setattr__(self, "nvls", bool(self.intra.nvls if self.nvls is None else self.nvls))
        c = self.comm_compute_share
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < 1:
            raise ValueError(f"comm_compute_share={c!r} must be a fraction in [0, 1) of the compute a communication "
                             "kernel takes while it overlaps compute")
        object.__setattr__(self, "comm_compute_share", float(c))
        if self.kernels is None:
            known = self.device.name in costmodel.devices()
            object.__setattr__(self, "kernels", kmodel.kernel_params(self.device.name) if known
                               else kmodel.KernelParams(source="class defaults (custom device)"))
        elif isinstance(self.kernels, dict):
            object.__setattr__(self, "kernels", kmodel.KernelParams.from_dict(self.kernels))
        elif not isinstance(self.kernels, kmodel.KernelParams):
            raise ValueError(f"kernels={self.kernels!r} must be a KernelParams, a dict of its fields or None")

    # -- placement -----------------------------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank``: ``rank // gpus_per_node``."""
        return int(rank) // self.gpus_per_node

    def valid_world_sizes(self, up_to: int = 64) -> list[int]:
        """World sizes this profile's nodes hold evenly, up to ``up_to``: 1..gpus_per_node, then whole nodes
        (multi-node sizes only when the profile has an inter-node link)."""
        g = self.gpus_per_node
        sizes = list(range(1, min(g, up_to) + 1))
        if self.inter is not None:
            sizes += list(range(2 * g, up_to + 1, g))
        return sizes

    def check_world_size(self, world_size: int) -> int:
        """Return ``world_size`` if the profile's nodes hold it evenly (at most ``gpus_per_node``, or a multiple
        of it with an inter-node link); ValueError naming the valid sizes otherwise."""
        n = positive_int("world_size", world_size)
        g = self.gpus_per_node
        if n <= g or (n % g == 0 and self.inter is not None):
            return n
        why = (f"it is not a whole number of nodes of {g} GPUs" if self.inter is not None
               else f"profile {self.name!r} is one node of {g} GPUs (no inter-node link)")
        sizes = ", ".join(map(str, self.valid_world_sizes(max(4 * g, n))))
        raise ValueError(f"world_size={n} cannot be placed on {self.name!r}: {why}; valid world sizes: {sizes}")

    def placement(self, ranks: Sequence[int]) -> dict:
        """:func:`labkit.theory.costmodel.group_placement` of ``ranks`` on this profile."""
        return costmodel.group_placement(ranks, self.gpus_per_node)

    def link_of(self, ranks: Sequence[int]) -> str:
        """The name of the slowest link a collective on ``ranks`` crosses (``"-"`` for one rank)."""
        return costmodel.group_link(ranks, self.gpus_per_node, self.intra, self.inter)

    # -- costs -----------------------------------------------------------------------------------------------
    def compute_s(self, flops: float, nbytes: float, dtype: str = "fp32") -> float:
        """Seconds of one operation: ``max(flops / (peak[dtype] * compute_efficiency), nbytes /
        (memory_bandwidth * memory_efficiency)) + kernel_overhead_s`` (roofline; module docstring). ``flops``
        and ``nbytes`` >= 0; an infinite peak or bandwidth makes its term 0."""
        peak = self.device.peak_flops(dtype) * self.compute_efficiency
        bw = self.device.memory_gbps * 1e9 * self.memory_efficiency
        return max(flops / peak if flops else 0.0, nbytes / bw if nbytes else 0.0) + self.kernel_overhead_s

    def kernel_s(self, kind: str, *, flops: float, nbytes: float, dtype: str = "fp32", shape=None) -> float:
        """Seconds of one kernel priced by its shape (:mod:`labkit.theory.kernels`, with this profile's
        ``kernels`` parameters), plus ``kernel_overhead_s``:

        * ``kind="gemm"``, ``shape=(batch, m, n, k)``: :func:`~labkit.theory.kernels.gemm_s` (tile and wave
          quantisation on the SMs, efficiency falling for small or skinny shapes);
        * ``kind="attention"``, ``shape=(batch, heads, q_len, kv_len, head_dim, causal)``:
          :func:`~labkit.theory.kernels.attention_s` (flash attention forward: its own FLOPs and traffic);
        * ``kind="memory"``: :func:`~labkit.theory.kernels.memory_s` of ``nbytes`` and ``flops`` (bandwidth
          efficiency and launch cost);
        * ``kind="other"`` or ``shape=None``: the roofline :meth:`compute_s` of ``flops`` and ``nbytes``.

        ``flops`` and ``nbytes`` >= 0 (used by the roofline and the memory kind; a shaped kernel's own FLOPs and
        bytes come from its shape). Raises ValueError for an unknown kind or a shape of the wrong length."""
        check_choice("kind", kind, kmodel.KINDS)
        if kind == "other" or (shape is None and kind != "memory"):
            return self.compute_s(flops, nbytes, dtype)
        dev, p = self.device, self.kernels
        peak = dev.peak_flops(dtype)
        e = DTYPE_BYTES.get(TORCH_DTYPES.get(dtype, dtype), 4)
        if kind == "memory":
            return kmodel.memory_s(nbytes, flops, peak_flops=peak, memory_gbps=dev.memory_gbps,
                                   params=p) + self.kernel_overhead_s
        shape = tuple(shape)
        if kind == "gemm":
            if len(shape) != 4:
                raise ValueError(f"gemm shape={shape!r} must be (batch, m, n, k)")
            b, m, n, k = shape
            t = kmodel.gemm_s(m, n, k, batch=b, peak_flops=peak, memory_gbps=dev.memory_gbps, params=p,
                              dtype_bytes=e)
        else:
            if len(shape) != 6:
                raise ValueError(f"attention shape={shape!r} must be (batch, heads, q_len, kv_len, head_dim, causal)")
            b, h, q, kv, d, causal = shape
            t = kmodel.attention_s(b, h, q, kv, d, causal=bool(causal), peak_flops=peak,
                                   memory_gbps=dev.memory_gbps, params=p, dtype_bytes=e)
        return t + self.kernel_overhead_s

    def collective_s(self, op: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Seconds of one collective of S = ``nbytes`` on the global ``ranks``, priced as NCCL runs it
        (:func:`labkit.theory.costmodel.group_collective_time`: NCCL's algorithm and protocol choice, NVLS when
        the profile's ``nvls`` is on, with this profile's links, NICs and ``link_efficiency``); NCCL's per-call
        latencies when ``base_latency_s`` is the default, else ``base_latency_s`` instead of them. Raises
        ValueError as that function does."""
        default = self.base_latency_s == costmodel.base_latency_s("ring")
        t = costmodel.group_collective_time(op, nbytes, ranks, gpus_per_node=self.gpus_per_node,
                                            intra=self.intra, inter=self.inter, nics_per_node=self.nics_per_node,
                                            link_efficiency=self.link_efficiency, include_base=default,
                                            nvls=self.nvls)
        return t + (0.0 if default else self.base_latency_s) if len(ranks) > 1 else 0.0

    def collective_choice(self, op: str, nbytes: float, ranks: Sequence[int]) -> dict:
        """The algorithm and protocol NCCL would run for ``op`` (all_reduce, all_gather, reduce_scatter,
        broadcast) on ``ranks`` of this profile, with its predicted time
        (:func:`labkit.theory.costmodel.collective_choice`). Raises ValueError as that function does."""
        p = self.placement(ranks)
        return costmodel.collective_choice(op, nbytes, p["n"], p["nodes"], p["ranks_per_node"], intra=self.intra,
                                           inter=self.inter, nics_per_node=self.nics_per_node, nvls=self.nvls,
                                           link_efficiency=self.link_efficiency)

    def p2p_s(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds of one point-to-point transfer of ``nbytes`` from global rank ``src`` to ``dst``."""
        if src == dst:
            return 0.0
        return self.collective_s("send_recv", nbytes, (src, dst))

    # -- plain data ----------------------------------------------------------------------------------------------
    def replace(self, **changes) -> Cluster:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data (JSON-serialisable: infinities become the string ``"inf"``); :meth:`from_dict` reads it."""
        d = asdict(self)
        d["intra"] = asdict(self.intra)
        d["inter"] = asdict(self.inter) if self.inter is not None else None
        d["kernels"] = self.kernels.to_dict()
        return _jsonable(d)

    @classmethod
    def from_dict(cls, d: dict) -> Cluster:
        """The Cluster :meth:`to_dict` wrote."""
        d = _unjson(dict(d))
        d["device"] = Device(**d["device"])
        d["intra"] = costmodel.Link(**d["intra"])
        d["inter"] = costmodel.Link(**d["inter"]) if d.get("inter") else None
        return cls(**d)

    def describe(self) -> str:
        """One line: the device, the node, the links."""
        inter = (f"; nodes joined by {self.nics_per_node} x {self.inter.name} ({self.inter.bandwidth_gbps:g} GB/s "
                 "per direction each)" if self.inter is not None else "; one node")
        return (f"{self.name}: {self.gpus_per_node} x {self.device.name} per node on {self.intra.name} "
                f"({self.intra.bandwidth_gbps:g} GB/s per direction){inter}")


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return x


def _unjson(x):
    if isinstance(x, dict):
        return {k: _unjson(v) for k, v in x.items()}
    if x == "inf":
        return math.inf
    return x


def clusters(path=None) -> dict[str, Cluster]:
    """Every cluster profile of data/hardware.yaml (``clusters:``) by name, with the default efficiencies."""
    out = {}
    for name, d in (costmodel.hardware(path).get("clusters") or {}).items():
        out[name] = Cluster(name=name, device=d["device"], gpus_per_node=d["gpus_per_node"], intra=d["intra"],
                            inter=d.get("inter"), nics_per_node=d.get("nics_per_node", 1), nvls=d.get("nvls"),
                            comm_compute_share=float(d.get("comm_compute_share", 0.0)),
                            rail_optimized=bool(d.get("rail_optimized", False)),
                            description=d.get("description", ""), source=d.get("source", ""))
    return out


def get_cluster(name: str | Cluster, **overrides) -> Cluster:
    """The profile ``name`` of data/hardware.yaml (a :class:`Cluster` is returned as is), with ``overrides``
    (e.g. ``compute_efficiency=0.6``) applied. Raises ValueError for an unknown name, listing the profiles."""
    if isinstance(name, Cluster):
        return name.replace(**overrides) if overrides else name
    known = clusters()
    if isinstance(name, str) and name not in known:  # a profile fitted by labkit calibrate (theory/calibrate.py)
        from labkit.theory.calibrate import fitted_cluster, fitted_names

        fitted = fitted_cluster(name)
        if fitted is not None:
            return fitted.replace(**overrides) if overrides else fitted
        known = {**known, **dict.fromkeys(fitted_names())}
    check_choice("cluster", name, known)
    return known[name].replace(**overrides) if overrides else known[name]


def ideal_cluster(gpus_per_node: int = 1024, **overrides) -> Cluster:
    """A cluster on which nothing costs anything (infinite peak, memory and link bandwidth, zero latency): the
    emulated timeline then holds only what the program itself charges (``time.sleep`` stand-ins), which is
    how the emulator is checked against :mod:`labkit.theory.simulate`."""
    inf = math.inf
    link = costmodel.Link("ideal", inf, inf, 0.0, 0.0, "infinitely fast, zero latency")
    dev = Device("ideal", {"fp32": inf}, inf)
    overrides.setdefault("kernels", kmodel.KernelParams(launch_s=0.0, source="ideal: no launch cost"))
    return Cluster(dev, gpus_per_node, link, link, name="ideal", nics_per_node=gpus_per_node, base_latency_s=0.0,
                   **overrides)
