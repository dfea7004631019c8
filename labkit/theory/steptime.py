"""The planner's time model: a cluster's topology, the pipeline schedules it prices, and the predicted seconds
of one training step of a mesh, part by part (:func:`step_time`). Pure Python (no torch); every formula names
its source. :mod:`labkit.theory.planner` ranks meshes with it; everything here is a *prediction*.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

from labkit.checks import check_choice
from labkit.paths import data_dir
from labkit.theory import costmodel, layercost
from labkit.theory import kernels as kmodel
from labkit.theory import memory as mem
from labkit.theory.mesh import DEFAULT_ORDER, ParallelDims, dim_placement
from labkit.theory.spec import ModelSpec, flops_per_token
from labkit.yamlload import load_path

#: the pipeline schedules the planner prices (GPipe is left out: 1F1B has its bubble with less memory)
SCHEDULE_CHOICES = ("1f1b", "interleaved", "zb-h1")
#: the most model chunks per pipeline rank the planner tries for the interleaved schedule
MAX_VPP = 8
#: the parts of a predicted step, in the order they stack
TIME_PARTS = ("compute_s", "bubble_s", "tp_s", "cp_s", "ep_s", "pp_s", "dp_s")
#: the constant-efficiency model's fraction of peak (``mfu=DEFAULT_MFU``: every op at 50 %, the lab's model
#: before the kernel model; kept as the mutation the validation must reject). The default is ``mfu=None``:
#: compute priced kernel by kernel (:mod:`labkit.theory.layercost`).
DEFAULT_MFU = 0.5
DEFAULT_INTER_LINK = "ib-ndr"


#: mutations of the time model, for the checks that a wrong model fails validation (labkit.theory.mutants); the
#: real model has them all off
_MUTATION = {"no_comm": False}


@contextlib.contextmanager
def mutation(*, no_comm: bool = False):
    """Within the block, price the step with a mutated model: ``no_comm`` = every collective and send free.
    For :mod:`labkit.theory.mutants` only (a model the validation must reject)."""
    old = dict(_MUTATION)
    _MUTATION["no_comm"] = bool(no_comm)
    try:
        yield
    finally:
        _MUTATION.update(old)


def mutation_key() -> tuple:
    """The active mutation as a hashable key (caches of validation rows include it)."""
    return tuple(sorted(_MUTATION.items()))


@functools.lru_cache(maxsize=16)
def sustained_fraction(gpu: str) -> float:
    """The fitted fraction of the kernel benchmarks' rate (MAMF GEMMs, FlashAttention) that a long training run
    sustains on ``gpu`` (clocks under the power limit, communication kernels sharing the SMs, what the
    per-kernel model leaves out): ``fitted.sustained_fraction.value[gpu]`` of
    data/reference/published/validation.yaml, fitted by :func:`labkit.theory.published.fit_sustained` on the
    rows whose ``role`` is ``calibration`` only (1.0 for a GPU without calibration rows)."""
    # read here, not through labkit.theory.published (the layer above the planner: no import back up)
    spec = load_path(data_dir() / "reference" / "published" / "validation.yaml") or {}
    fit = (spec.get("fitted") or {}).get("sustained_fraction") or {}
    return float((fit.get("value") or {}).get(gpu, 1.0))


def default_inter_link(gpu: str) -> str:
    """The network between nodes for ``gpu`` when none is given: the ``inter`` link of the first cluster profile
    of data/hardware.yaml built on that GPU (dgx-h100: ib-ndr; dgx-a100: ib-hdr, the DGX A100's 200 Gb/s
    ConnectX-6 HDR ports), else :data:`DEFAULT_INTER_LINK`."""
    for prof in (costmodel.hardware().get("clusters") or {}).values():
        if prof.get("device") == gpu and prof.get("inter"):
            return prof["inter"]
    return DEFAULT_INTER_LINK


def plannable_gpus() -> list[str]:
    """GPUs of data/hardware.yaml the planner can use: those with memory, a dense bf16 peak and an NVLink."""
    return sorted(n for n, d in costmodel.devices().items()
                  if {"memory_bytes", "peak_bf16_tflops", "nvlink"} <= set(d))


def _gpu(name: str) -> dict:
    ok = plannable_gpus()
    if name in costmodel.devices() and name not in ok:
        raise ValueError(f"gpu={name!r} has no peak_bf16_tflops or nvlink entry in data/hardware.yaml, which the "
                         f"planner needs; add them there or choose one of: {', '.join(ok)}")
    check_choice("gpu", name, ok)
    return {"name": name, **costmodel.get_device(name)}


def padded_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """``spec`` with the vocabulary padded as Megatron-LM does when tp does not divide it: to the next
    multiple of 128·tp (``_vocab_size_with_padding`` in megatron/training/tokenizer); unchanged otherwise.
    The same rule as the memory calculator's (:func:`labkit.theory.memory.padded_spec`)."""
    return mem.padded_spec(spec, tp)


# ------------------------------------------------------------------------------------------------------
# time
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """``gpus_per_node`` GPUs joined by ``intra`` (NVLink) inside a node, nodes joined by ``inter``
    (:class:`labkit.theory.costmodel.Link`, the bandwidth of one NIC) through ``nics_per_node`` NICs per node
    (rail-optimised when nics_per_node = gpus_per_node, as DGX A100/H100 and the published clusters: every GPU
    drives its own NIC); a GPU of ``peak_flops`` (dense bf16, FLOP/s) with ``memory_bytes`` usable (the
    program-visible capacity, :func:`labkit.theory.memory.usable_bytes`) of ``device_bytes`` (datasheet)."""

    gpu: str
    gpus_per_node: int
    intra: costmodel.Link
    inter: costmodel.Link
    peak_flops: float
    memory_bytes: int
    base_latency_s: float
    nics_per_node: int = 8
    device_bytes: int = 0
    memory_gbps: float = 0.0
    kernels: kmodel.KernelParams | None = None

    @property
    def kernel_device(self) -> tuple:
        """(peak FLOP/s, memory GB/s, KernelParams): what :mod:`labkit.theory.layercost` prices kernels with."""
        bw, kp = self.memory_gbps, self.kernels
        if not bw or kp is None:  # built field by field (not by Topology.of): the device's own facts
            d = costmodel.devices().get(self.gpu, {})
            bw = bw or float(d.get("hbm_gbps", d.get("memory_gbps", 0.0))) or float("inf")
            kp = kp or (kmodel.kernel_params(self.gpu) if d else kmodel.KernelParams())
        return (self.peak_flops, bw, kp)

    @classmethod
    def of(cls, gpu: str, gpus_per_node: int = 8, inter: str | None = None,
           nics_per_node: int | None = None, sustained: float | None = None) -> Topology:
        """The topology of ``gpu`` (a name of :func:`plannable_gpus`); ``inter`` None -> the GPU's own cluster
        profile's network (:func:`default_inter_link`); ``nics_per_node`` None -> one per GPU.
        ``sustained``: the fraction of the kernels' benchmark rate (GEMM and attention efficiency) a training
        run sustains; None = the value fitted on the calibration rows (:func:`sustained_fraction`).
        Raises ValueError for an unknown GPU or link, or a count < 1 (or above :data:`mem.MAX_DEGREE`)."""
        d = _gpu(gpu)
        f = sustained_fraction(gpu) if sustained is None else float(sustained)
        if not 0 < f <= 1:
            raise ValueError(f"sustained={sustained!r} must be a fraction in (0, 1]")
        kp = kmodel.kernel_params(gpu)
        kp = kp.replace(gemm_efficiency=kp.gemm_efficiency * f, attention_efficiency=kp.attention_efficiency * f)
        g = mem.bounded_int("gpus_per_node", gpus_per_node, mem.MAX_DEGREE)
        nics = g if nics_per_node is None else mem.bounded_int("nics_per_node", nics_per_node, mem.MAX_DEGREE)
        inter = default_inter_link(gpu) if inter is None else inter
        return cls(gpu, g, costmodel.get_link(d["nvlink"]), costmodel.get_link(inter),
                   float(d["peak_bf16_tflops"]) * 1e12, mem.usable_bytes(d), costmodel.base_latency_s("ring"), nics,
                   int(d["memory_bytes"]), float(d.get("hbm_gbps", d.get("memory_gbps", 0.0))), kp)

    def check_whole_nodes(self, gpus: int, name: str = "gpus") -> None:
        """Raise ValueError (naming ``name``) unless ``gpus`` fills whole nodes of ``gpus_per_node`` (or fits
        in one node)."""
        if gpus > self.gpus_per_node and gpus % self.gpus_per_node:
            raise ValueError(f"{name}={gpus} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}; "
                             f"use a multiple of {self.gpus_per_node}")

    @functools.cached_property
    def _inter_share(self) -> costmodel.Link:
        # every group of a dimension communicates at once, so all gpus_per_node GPUs of a node cross the network
        # together: each gets min(1, nics/gpus_per_node) of a NIC (1 on a rail-optimised node)
        share = min(1.0, self.nics_per_node / self.gpus_per_node)
        return self.inter if share == 1 else replace(self.inter, bandwidth_gbps=self.inter.bandwidth_gbps * share)

    def collective_s(self, op: str, nbytes: float, degree: int, stride: int) -> float:
        """Predicted seconds of one ``op`` on a group of ``degree`` ranks ``stride`` apart in the rank order:
        :func:`labkit.theory.costmodel.placed_collective_time` (ring inside a node; across nodes hierarchical —
        intra-node reduce-scatter, inter-node ring over the node's NICs, intra-node all-gather) with the group's
        ranks per node and nodes from :func:`labkit.theory.mesh.dim_placement`. The network bandwidth a rank
        gets is one NIC's times min(1, nics_per_node / gpus_per_node): every group of a dimension communicates
        at once. ``send_recv`` is between two neighbours ``stride`` apart."""
        if degree < 2 or nbytes <= 0 or _MUTATION["no_comm"]:
            return 0.0
        n = 2 if op == "send_recv" else degree
        memo = self.__dict__.setdefault("_collective_memo", {})  # a plan prices the same group many times
        key = (op, float(nbytes), n, stride)
        if key not in memo:
            memo[key] = self._collective_uncached(op, nbytes, n, stride)
        return memo[key]

    def _collective_uncached(self, op: str, nbytes: float, n: int, stride: int) -> float:
        place = dim_placement(n, stride, self.gpus_per_node)
        k, nodes = (place["ranks_per_node"], place["nodes"]) if place else (1, n)
        # NCCL's per-call latency is the chosen protocol's (labkit.theory.nccl), as the emulator charges it
        return costmodel.placed_collective_time(
            op, float(nbytes), n, nodes, k, intra=self.intra, inter=self._inter_share, nics_per_node=k,
            include_base=True)

    def link_of(self, degree: int, stride: int) -> str:
        """The link name a group's slowest hop uses ("-" for a group of one)."""
        if degree < 2:
            return "-"
        place = dim_placement(degree, stride, self.gpus_per_node)
        return self.intra.name if place and place["within_node"] else self.inter.name


def schedule_options(pp: int, n_microbatches: int, layers_per_stage, schedules=SCHEDULE_CHOICES,
                     max_vpp: int = MAX_VPP) -> list[tuple[str, int]]:
    """The (schedule, v) pairs the planner prices for a pipeline of ``pp`` stages running ``n_microbatches``
    with ``layers_per_stage``: pp = 1 -> [("1f1b", 1)] (no pipeline); else 1F1B and ZB-H1 (v = 1), and the
    interleaved schedule with every v in 2..max_vpp that leaves each stage at least one layer per chunk when
    pp divides the micro-batches (Megatron-LM's rule for interleaving; Narayanan et al. 2021, Sec. 2.2.2)."""
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name in schedules:
        if name == "interleaved":
            if n_microbatches % pp == 0:
                out += [("interleaved", v) for v in range(2, min(max_vpp, min(layers_per_stage)) + 1)]
        else:
            out.append((name, 1))
    return out


def bubble_factor(schedule: str, vpp: int = 1) -> float:
    """Bubble time per unit of (compute · (pp-1)/m), with equal F, B and W (the papers' own drawing):
    1F1B 1 (Narayanan et al. 2021, Sec. 2.2.1: (p-1)/m), interleaved 1/v (Sec. 2.2.2: (p-1)/(v·m)), ZB-H1 1/3
    (Qi et al. 2023, Sec. 3.1: (p-1)(T_F + T_B - T_W) against 1F1B's (p-1)(T_F + T_B + T_W), T_F = T_B =
    T_W). :func:`labkit.theory.simulate.bubble_formula` gives the same closed forms (tests/test_planner.py)."""
    check_choice("schedule", schedule, SCHEDULE_CHOICES)
    return {"1f1b": 1.0, "interleaved": 1.0 / vpp, "zb-h1": 1.0 / 3.0}[schedule]


def p2p_count(schedule: str, pp: int, m: int, vpp: int = 1) -> int:
    """Sends on the critical path of one step: 2(m + pp - 1) for 1F1B and ZB-H1 (one activation and one
    gradient per micro-batch, plus the fill and drain), 2(v·m + pp - 1) interleaved (each micro-batch crosses
    every rank v times: "the amount of communication also increases by v", Narayanan et al. 2021, Sec. 2.2.2);
    0 without a pipeline."""
    if pp == 1:
        return 0
    return 2 * ((vpp if schedule == "interleaved" else 1) * m + pp - 1)


@functools.lru_cache(maxsize=256)
def _flops(spec: ModelSpec, seq_len: int) -> dict:
    """Per-token FLOPs (PaLM App. B, as :func:`flops_per_token`), split into one layer (dense and MoE) and the
    output head, with the extra forward of each recompute mode (cached: every mesh of a plan shares them)."""
    total = flops_per_token(spec, seq_len)
    head = 6 * spec.vocab_size * spec.hidden_size
    attn = 12 * spec.n_heads * spec.head_dim * seq_len
    if spec.is_moe:
        dense = spec.layer_params(next((i for i in range(spec.n_layers) if not spec.is_moe_layer(i)), 0))
        moe_active = spec.layer_params(next(i for i in range(spec.n_layers) if spec.is_moe_layer(i))) - (
            spec.n_experts - spec.top_k) * spec.mlp_params(spec.expert_ffn_hidden_size)
        per_layer = {False: 6 * dense + attn, True: 6 * moe_active + attn}
    else:
        per_layer = {False: 6 * spec.layer_params(0) + attn, True: 6 * spec.layer_params(0) + attn}
    return {"total": total, "head": head, "layer": per_layer, "attn_core_fwd": attn / 3}


def stage_imbalance(spec: ModelSpec, seq_len: int, layers_per_stage, recompute: str = "none") -> float:
    """max over stages of the stage's FLOPs / their mean (>= 1): the pipeline runs at its slowest stage. A
    stage's FLOPs are its layers' plus, on the last stage, the output head's 6·v·h per token (the embedding
    lookup has none); recompute adds each stage's extra forward. 1 for pp = 1."""
    split = tuple(layers_per_stage)
    if len(split) == 1:
        return 1.0
    f = _flops(spec, seq_len)
    frac_moe = spec.n_moe_layers / spec.n_layers if spec.is_moe else 0.0
    layer = (1 - frac_moe) * f["layer"][False] + frac_moe * f["layer"][True]
    head = f["head"]
    if recompute == "full":
        layer, head = layer * 4 / 3, head * 4 / 3
    elif recompute == "selective":
        layer += f["attn_core_fwd"]
    work = [n * layer for n in split]
    work[-1] += head
    return max(work) / (sum(work) / len(work))


def step_time(spec: ModelSpec, dims: ParallelDims, topo: Topology, *, seq_len: int, global_batch_size: int,
              micro_batch_size: int = 1, recompute: str = "none", zero: int = 1, sequence_parallel: bool = True,
              mfu: float | None = None, n_params_local: int | None = None, grad_bytes: float = 2.0,
              param_bytes: float = 2.0, act_bytes: int = 2, schedule: str = "1f1b", vpp: int = 1,
              layers_per_stage=None) -> dict:
    """Predicted seconds of one training step, by part (all *predicted*), for the mesh ``dims`` on ``topo``
    under pipeline ``schedule`` with ``vpp`` chunks per rank and the stage split ``layers_per_stage`` (None:
    derived, :func:`labkit.theory.memory.split_layers`).

    With m = global_batch_size / (dp·micro_batch_size) micro-batches, b = micro_batch_size, s = seq_len,
    h = hidden_size, e = ``act_bytes``, L_max = the most layers on one stage, and ``coll(op, S, group)`` the
    time of :meth:`Topology.collective_s` (hierarchical across nodes; Thakur et al. 2005) on that group:

    * ``compute_s`` (``mfu=None``, the default) = m · (the slowest stage's seconds of one micro-batch) + one
      optimizer step, every kernel priced at the mesh's per-rank shapes (:func:`labkit.theory.layercost.
      microbatch_costs`, :func:`~labkit.theory.layercost.stage_seconds`, :mod:`labkit.theory.kernels`: GEMMs
      with tile and wave quantisation, flash attention, memory-bound kernels; recompute included). With a number
      ``mfu`` (the constant-efficiency model, every op at that fraction of peak): F / (gpus · peak · mfu) ·
      imbalance, F = flops_per_token(s) · global_batch_size · s (PaLM, App. B), plus one more forward of the
      layers with full recompute (F/3) or of the attention core with selective recompute (4·L·a·d·s per token;
      Korthikanti et al. 2022, Sec. 5); imbalance = :func:`stage_imbalance`.
    * ``bubble_s`` = compute_s · (pp - 1)/m · :func:`bubble_factor` (1F1B 1, interleaved 1/v, ZB-H1 1/3).
    * ``tp_s`` = m · L_max · k · coll(all_reduce, b·s/cp·h·e, tp): k = 4 all-reduces per layer (two forward, two
      backward; Shoeybi et al. 2019, Sec. 3), 6 with full recompute; with sequence parallelism each all-reduce
      becomes an all-gather + reduce-scatter of the same ring volume (Korthikanti et al. 2022, Sec. 4.2.2).
      The vocabulary-parallel loss's small all-reduces are left out. Not overlapped.
    * ``cp_s`` = m · L_max · (coll(all_gather, 2·b·s·kv/tp·e, cp) + coll(reduce_scatter, same, cp)): K and V
      gathered in forward, their gradients reduce-scattered in backward (all-gather context parallelism, Llama
      Team 2024, "The Llama 3 Herd of Models", Sec. 3.3.2). Not overlapped.
    * ``ep_s`` = m · (MoE layers on the slowest stage) · 4 · coll(all_to_all, b·s/cp·top_k·h·e, ep): dispatch
      and combine, forward and backward (Lepikhin et al. 2021, GShard, Sec. 2.2). Not overlapped.
    * ``pp_s`` = :func:`p2p_count` · coll(send_recv, b·s/cp·h·e / (tp with SP), 2 neighbours).
    * ``dp_s`` (exposed) = max(0, t_dp - t_overlap) over the dp·cp group, for the rank's n_params_local
      parameters. ZeRO-0: one gradient all-reduce; ZeRO-1/2: gradient reduce-scatter + parameter all-gather
      (the same ring volume, Rajbhandari et al. 2020, Sec. 7); both overlap only the backward of the last
      micro-batch, t_overlap = 2/3 · compute_s/m (bucketed reduction overlaps the backward it follows; Li et
      al. 2020, "PyTorch Distributed", Sec. 3.2.3). ZeRO-3: gradient reduce-scatter + a parameter all-gather
      per micro-batch in forward and again in backward (2m), prefetched behind the compute of the previous
      layer, so t_overlap = compute_s (Zhao et al. 2023, "PyTorch FSDP", prefetching).

    Returns a dict with every part, ``step_time_s`` (their sum), ``dp_total_s`` (before overlap),
    ``predicted_mfu`` (F without recompute / (gpus · peak · step_time_s)), ``predicted_hfu`` (with the
    recomputed FLOPs: what Megatron-LM's and BLOOM's TFLOP/s count), ``tokens_per_s``, ``links`` (the link each
    dimension's groups use) and ``n_microbatches``.
    """
    if dims.order != DEFAULT_ORDER:
        raise ValueError(f"step_time places the grid in the default order {'-'.join(DEFAULT_ORDER)}, got "
                         f"order={'-'.join(dims.order)}")
    check_choice("schedule", schedule, SCHEDULE_CHOICES)
    split = mem.resolve_split(spec.n_layers, dims.pp, vpp, layers_per_stage)
    base = _step_base(spec, dims, topo, seq_len=seq_len, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, recompute=recompute, sequence_parallel=sequence_parallel,
                      mfu=mfu, act_bytes=act_bytes, split=split)
    n_local = n_params_local if n_params_local is not None else spec.n_params() / (dims.tp * dims.pp)
    return _step_with(base, dims, topo, schedule, vpp, zero, n_local, grad_bytes, param_bytes)


def _step_base(spec, dims, topo, *, seq_len, global_batch_size, micro_batch_size, recompute, sequence_parallel, mfu,
               act_bytes, split) -> dict:
    """The schedule-independent parts of :func:`step_time` (compute, TP, CP, EP, one p2p send)."""
    b, s = micro_batch_size, seq_len
    m = global_batch_size // (dims.dp * b)
    gpus = dims.world_size
    h, e, L = spec.hidden_size, act_bytes, spec.n_layers
    tokens = global_batch_size * s
    fl = _flops(spec, s)
    f_model = fl["total"] * tokens
    extra = 0.0
    if recompute == "full":
        extra = f_model / 3
    elif recompute == "selective":
        extra = 4 * L * spec.n_heads * spec.head_dim * s * tokens
    peak = topo.peak_flops
    if mfu is None:  # priced kernel by kernel at this mesh's per-rank shapes
        costs = layercost.microbatch_costs(spec, topo.kernel_device, b, s, dims.tp, dims.cp, dims.ep,
                                           bool(sequence_parallel and dims.tp > 1), act_bytes)
        stages = layercost.stage_seconds(spec, costs, split, recompute)
        imbalance = max(stages) / (sum(stages) / len(stages))
        compute = m * max(stages)
    else:
        imbalance = stage_imbalance(spec, s, split, recompute)
        compute = (f_model + extra) / (gpus * peak * mfu) * imbalance
    layers = max(split)
    local_tokens = b * s // dims.cp
    stride = {d: dims.stride(d) for d in ("tp", "cp", "dp", "pp")}
    act = local_tokens * h * e
    k_tp = 6 if recompute == "full" else 4
    tp_s = m * layers * k_tp * topo.collective_s("all_reduce", act, dims.tp, stride["tp"])
    kv_bytes = 2 * b * s * spec.kv_size / dims.tp * e
    cp_s = m * layers * (topo.collective_s("all_gather", kv_bytes, dims.cp, stride["cp"])
                         + topo.collective_s("reduce_scatter", kv_bytes, dims.cp, stride["cp"]))
    ep_s = 0.0
    if dims.ep > 1:
        moe_layers = spec.n_moe_layers / L * layers
        a2a = local_tokens * spec.top_k * h * e
        ep_s = m * moe_layers * 4 * topo.collective_s("all_to_all", a2a, dims.ep, stride["cp"])
    send = act / (dims.tp if sequence_parallel and dims.tp > 1 else 1)
    one_send = topo.collective_s("send_recv", send, dims.pp, stride["pp"]) if dims.pp > 1 else 0.0
    links = {"tp": topo.link_of(dims.tp, stride["tp"]), "cp": topo.link_of(dims.cp, stride["cp"]),
             "dp": topo.link_of(dims.dp * dims.cp, stride["cp"]), "pp": topo.link_of(dims.pp, stride["pp"]),
             "ep": topo.link_of(dims.ep, stride["cp"])}
    return {"compute_s": compute, "tp_s": tp_s, "cp_s": cp_s, "ep_s": ep_s, "one_send_s": one_send, "m": m,
            "kernel_model": mfu is None,
            "f_model": f_model, "extra": extra, "tokens": tokens, "gpus": gpus, "peak": peak, "links": links,
            "imbalance": imbalance, "split": split, "stride_cp": stride["cp"]}


def _step_with(base, dims, topo, schedule, vpp, zero, n_local, grad_bytes, param_bytes) -> dict:
    m, compute = base["m"], base["compute_s"]
    bubble = compute * (dims.pp - 1) / m * bubble_factor(schedule, vpp) if dims.pp > 1 else 0.0
    if base.get("kernel_model"):  # one optimizer step over the rank's (ZeRO-sharded) parameters
        compute += layercost.optimizer_seconds(n_local, dims.dp * dims.cp if zero >= 1 else 1, topo.kernel_device)
    pp_s = p2p_count(schedule, dims.pp, m, vpp) * base["one_send_s"]
    dpc, dp_stride = dims.dp * dims.cp, base["stride_cp"]  # the dp*cp ranks holding one dense shard
    gather = topo.collective_s("all_gather", n_local * param_bytes, dpc, dp_stride)
    if zero == 0:
        dp_total = topo.collective_s("all_reduce", n_local * grad_bytes, dpc, dp_stride)
    else:
        dp_total = topo.collective_s("reduce_scatter", n_local * grad_bytes, dpc, dp_stride)
        dp_total += 2 * m * gather if zero >= 3 else gather
    overlap = compute if zero >= 3 else (2 / 3) * compute / m
    dp_s = max(0.0, dp_total - overlap)
    parts = {"compute_s": compute, "bubble_s": bubble, "tp_s": base["tp_s"], "cp_s": base["cp_s"],
             "ep_s": base["ep_s"], "pp_s": pp_s, "dp_s": dp_s}
    total = sum(parts.values())
    denom = base["gpus"] * base["peak"] * total
    return {**parts, "step_time_s": total, "dp_total_s": dp_total, "n_microbatches": m,
            "predicted_mfu": base["f_model"] / denom, "predicted_hfu": (base["f_model"] + base["extra"]) / denom,
            "tokens_per_s": base["tokens"] / total, "links": base["links"], "imbalance": base["imbalance"],
            "schedule": schedule, "vpp": vpp}
