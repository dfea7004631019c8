"""The mesh planner: inventory the workload, draw the topology, generate every valid mesh, estimate memory
and step time, rank. Pure Python (no torch): scoring every mesh of 16,384 GPUs takes well under a second
(benchmarks/planner_speed.py).

:func:`plan` does, for ``gpus`` GPUs of one kind in nodes of ``gpus_per_node``:

1. **enumerate** every (dp, tp, pp, cp[, ep]) with dp·tp·pp·cp = gpus (:func:`labkit.theory.mesh.enumerate_dims`),
   times each micro-batch size;
2. **validate** with :meth:`labkit.theory.mesh.ParallelDims.violations` (heads, kv heads, hidden, ffn by tp; layers by
   pp; sequence by cp; global batch by dp·micro-batch; micro-batches >= pp; groups aligned with nodes) —
   a failure is a *rejection* with the rule's message;
3. **memory**: :func:`labkit.theory.memory.train_memory` on the most loaded pipeline stage, with headroom, against
   the GPU's memory; with ``recompute="auto"`` the least recompute that fits (none, then selective, then
   full); nothing fits -> a rejection naming the shortfall;
4. **time**: place the grid on the nodes in Megatron Core's order (TP innermost: TP groups on the fastest
   domain, NVLink inside a node; then CP, DP, PP, which cross nodes first) and estimate one step
   (:func:`step_time`);
5. **rank** by predicted step time (then peak memory), each with the reason for its place.

Everything here is a *prediction*: label it so wherever it is shown.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from labkit.checks import check_choice, positive_float, positive_int
from labkit.theory import costmodel
from labkit.theory import memory as mem
from labkit.theory.mesh import DEFAULT_ORDER, ParallelDims, dim_placement, enumerate_dims
from labkit.theory.spec import ModelSpec, flops_per_token, get_spec

RECOMPUTE_CHOICES = ("auto", *mem.RECOMPUTE)
#: the parts of a predicted step, in the order they stack
TIME_PARTS = ("compute_s", "bubble_s", "tp_s", "cp_s", "ep_s", "pp_s", "dp_s")
PART_NAMES = {"compute_s": "compute", "bubble_s": "pipeline bubble", "tp_s": "TP comm", "cp_s": "CP comm",
              "ep_s": "EP comm", "pp_s": "PP send/recv", "dp_s": "DP comm (exposed)"}
#: Megatron-LM pads the vocabulary to a multiple of this x tp (``--make-vocab-size-divisible-by``, default 128)
VOCAB_MULTIPLE = 128
DEFAULT_MFU = 0.5
DEFAULT_INTER_LINK = "ib-ndr"


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
    multiple of 128·tp (``_vocab_size_with_padding`` in megatron/training/tokenizer); unchanged otherwise."""
    if spec.vocab_size % tp == 0:
        return spec
    m = VOCAB_MULTIPLE * tp
    return spec.replace(vocab_size=-(-spec.vocab_size // m) * m)


# ------------------------------------------------------------------------------------------------------
# time
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """``gpus_per_node`` GPUs joined by ``intra`` (NVLink) inside a node, nodes joined by ``inter``
    (:class:`labkit.theory.costmodel.Link`); a GPU of ``peak_flops`` (dense bf16, FLOP/s) with ``memory_bytes``;
    ``base_latency_s`` the fixed cost of one collective call (NCCL's ``baseLat``, ring)."""

    gpu: str
    gpus_per_node: int
    intra: costmodel.Link
    inter: costmodel.Link
    peak_flops: float
    memory_bytes: int
    base_latency_s: float

    @classmethod
    def of(cls, gpu: str, gpus_per_node: int = 8, inter: str = DEFAULT_INTER_LINK) -> Topology:
        """The topology of ``gpu`` (a name of :func:`plannable_gpus`). Raises ValueError for an unknown GPU or
        link, naming the valid ones."""
        d = _gpu(gpu)
        return cls(gpu, positive_int("gpus_per_node", gpus_per_node), costmodel.get_link(d["nvlink"]),
                   costmodel.get_link(inter), float(d["peak_bf16_tflops"]) * 1e12, int(d["memory_bytes"]),
                   costmodel.base_latency_s("ring"))

    def check_whole_nodes(self, gpus: int, name: str = "gpus") -> None:
        """Raise ValueError (naming ``name``) unless ``gpus`` fills whole nodes of ``gpus_per_node`` (or fits
        in one node)."""
        if gpus > self.gpus_per_node and gpus % self.gpus_per_node:
            raise ValueError(f"{name}={gpus} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}; "
                             f"use a multiple of {self.gpus_per_node}")

    def collective_s(self, op: str, nbytes: float, degree: int, stride: int) -> float:
        """Predicted seconds of one ``op`` on a group of ``degree`` ranks ``stride`` apart in the rank order:
        :func:`labkit.theory.costmodel.collective_time` (ring) with the group's ranks per node from
        :func:`labkit.theory.mesh.dim_placement` (all hops on NVLink when the group is inside a node)."""
        if degree < 2 or nbytes <= 0:
            return 0.0
        place = dim_placement(degree, stride, self.gpus_per_node)
        per_node = place["ranks_per_node"] if place else 1
        return self.base_latency_s + costmodel.collective_time(
            op, max(1, int(nbytes)), degree, self.intra, self.inter, gpus_per_node=per_node, include_base=False)

    def link_of(self, degree: int, stride: int) -> str:
        """The link name a group's slowest hop uses ("-" for a group of one)."""
        if degree < 2:
            return "-"
        place = dim_placement(degree, stride, self.gpus_per_node)
        return self.intra.name if place and place["within_node"] else self.inter.name


def step_time(spec: ModelSpec, dims: ParallelDims, topo: Topology, *, seq_len: int, global_batch_size: int,
              micro_batch_size: int = 1, recompute: str = "none", zero: int = 1, sequence_parallel: bool = True,
              mfu: float = DEFAULT_MFU, n_params_local: int | None = None, grad_bytes: float = 2.0,
              param_bytes: float = 2.0, act_bytes: int = 2) -> dict:
    """Predicted seconds of one training step, by part (all *predicted*), for the mesh ``dims`` on ``topo``.

    With m = global_batch_size / (dp·micro_batch_size) micro-batches, b = micro_batch_size, s = seq_len,
    h = hidden_size, e = ``act_bytes``, L = n_layers, and ``coll(op, S, group)`` the alpha-beta time of
    :meth:`Topology.collective_s` (ring; Thakur et al. 2005) on that group's links:

    * ``compute_s`` = F / (gpus · peak · mfu), F = flops_per_token(s) · global_batch_size · s (PaLM, App. B),
      plus one more forward of the layers with full recompute (F/3) or of the attention core with selective
      recompute (4·L·a·d·s per token; Korthikanti et al. 2022, Sec. 5). ``mfu`` is the assumed fraction of
      peak that compute kernels reach; the *predicted* end-to-end MFU (``predicted_mfu``) is lower.
    * ``bubble_s`` = compute_s · (pp - 1)/m: the 1F1B bubble (Narayanan et al. 2021, Sec. 2.2.1).
    * ``tp_s`` = m · L/pp · k · coll(all_reduce, b·s/cp·h·e, tp): k = 4 all-reduces per layer (two forward, two
      backward; Shoeybi et al. 2019, Sec. 3), 6 with full recompute; with sequence parallelism each all-reduce
      becomes an all-gather + reduce-scatter of the same ring volume (Korthikanti et al. 2022, Sec. 4.2.2).
      The vocabulary-parallel loss's small all-reduces are left out. Not overlapped.
    * ``cp_s`` = m · L/pp · (coll(all_gather, 2·b·s·kv/tp·e, cp) + coll(reduce_scatter, same, cp)): K and V
      gathered in forward, their gradients reduce-scattered in backward (all-gather context parallelism, Llama
      Team 2024, "The Llama 3 Herd of Models", Sec. 3.3.2). Not overlapped.
    * ``ep_s`` = m · (MoE layers)/pp · 4 · coll(all_to_all, b·s/cp·top_k·h·e, ep): dispatch and combine,
      forward and backward (Lepikhin et al. 2021, GShard, Sec. 2.2). Not overlapped.
    * ``pp_s`` = 2·(m + pp - 1) · coll(send_recv, b·s/cp·h·e / (tp with SP), 2): one activation send per
      forward slot and one gradient send per backward slot on the 1F1B critical path.
    * ``dp_s`` (exposed) = max(0, t_dp - t_overlap) over the dp·cp group, for the rank's n_params_local
      parameters. ZeRO-0: one gradient all-reduce; ZeRO-1/2: gradient reduce-scatter + parameter all-gather
      (the same ring volume, Rajbhandari et al. 2020, Sec. 7); both overlap only the backward of the last
      micro-batch, t_overlap = 2/3 · compute_s/m (bucketed reduction overlaps the backward it follows; Li et
      al. 2020, "PyTorch Distributed", Sec. 3.2.3). ZeRO-3: gradient reduce-scatter + a parameter all-gather
      per micro-batch in forward and again in backward (2m), prefetched behind the compute of the previous
      layer, so t_overlap = compute_s (Zhao et al. 2023, "PyTorch FSDP", prefetching).

    Returns a dict with every part, ``step_time_s`` (their sum), ``dp_total_s`` (before overlap),
    ``predicted_mfu`` (F without recompute / (gpus · peak · step_time_s)), ``tokens_per_s``, ``links`` (the
    link each dimension's groups use) and ``n_microbatches``.
    """
    if dims.order != DEFAULT_ORDER:
        raise ValueError(f"step_time places the grid in the default order {'-'.join(DEFAULT_ORDER)}, got "
                         f"order={'-'.join(dims.order)}")
    b, s = micro_batch_size, seq_len
    m = global_batch_size // (dims.dp * b)
    gpus = dims.world_size
    h, e, L = spec.hidden_size, act_bytes, spec.n_layers
    tokens = global_batch_size * s
    f_model = flops_per_token(spec, s) * tokens
    extra = 0.0
    if recompute == "full":
        extra = flops_per_token(spec, s, training=False) * tokens
    elif recompute == "selective":
        extra = 4 * L * spec.n_heads * spec.head_dim * s * tokens
    peak = topo.peak_flops
    compute = (f_model + extra) / (gpus * peak * mfu)
    bubble = compute * (dims.pp - 1) / m
    layers = L // dims.pp
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
        moe_layers = spec.n_moe_layers / dims.pp
        a2a = local_tokens * spec.top_k * h * e
        ep_s = m * moe_layers * 4 * topo.collective_s("all_to_all", a2a, dims.ep, stride["cp"])
    send = act / (dims.tp if sequence_parallel and dims.tp > 1 else 1)
    pp_s = 2 * (m + dims.pp - 1) * topo.collective_s("send_recv", send, dims.pp, stride["pp"]) if dims.pp > 1 else 0.0
    n_local = n_params_local if n_params_local is not None else spec.n_params() / (dims.tp * dims.pp)
    dpc = dims.dp * dims.cp
    dp_stride = stride["cp"]  # the dp*cp ranks holding one dense shard: cp sits just inside dp in the order
    gather = topo.collective_s("all_gather", n_local * param_bytes, dpc, dp_stride)
    if zero == 0:
        dp_total = topo.collective_s("all_reduce", n_local * grad_bytes, dpc, dp_stride)
    else:
        dp_total = topo.collective_s("reduce_scatter", n_local * grad_bytes, dpc, dp_stride)
        dp_total += 2 * m * gather if zero >= 3 else gather
    overlap = compute if zero >= 3 else (2 / 3) * compute / m
    dp_s = max(0.0, dp_total - overlap)
    parts = {"compute_s": compute, "bubble_s": bubble, "tp_s": tp_s, "cp_s": cp_s, "ep_s": ep_s, "pp_s": pp_s,
             "dp_s": dp_s}
    total = sum(parts.values())
    links = {"tp": topo.link_of(dims.tp, stride["tp"]), "cp": topo.link_of(dims.cp, stride["cp"]),
             "dp": topo.link_of(dpc, dp_stride), "pp": topo.link_of(dims.pp, stride["pp"]),
             "ep": topo.link_of(dims.ep, stride["cp"])}
    return {**parts, "step_time_s": total, "dp_total_s": dp_total, "n_microbatches": m,
            "predicted_mfu": f_model / (gpus * peak * total), "tokens_per_s": tokens / total, "links": links}


# ------------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One mesh with its predicted memory and time. ``rank`` (1 = best) and ``reason`` are set by :func:`plan`
    for fitting candidates; rejected ones keep rank None and say why in ``reason``."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch_size: int
    n_microbatches: int | None = None
    recompute: str | None = None
    fits: bool = False
    peak_bytes_per_gpu: int | None = None
    step_time_s: float | None = None
    parts: dict = field(default_factory=dict)
    predicted_mfu: float | None = None
    tokens_per_s: float | None = None
    links: dict = field(default_factory=dict)
    rules: list = field(default_factory=list)
    rank: int | None = None
    reason: str = ""

    def mesh(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}"
        return s + (f" ep={self.ep}" if self.ep > 1 else "") + f" mbs={self.micro_batch_size}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("parts"))
        return d


@dataclass
class Plan:
    """What :func:`plan` returns: ``candidates`` (fitting meshes, best first), ``rejected`` (with reasons),
    ``inputs`` and ``assumptions``, ``n_scored`` (meshes whose memory and time were estimated)."""

    candidates: list[Candidate]
    rejected: list[Candidate]
    inputs: dict
    assumptions: dict
    n_enumerated: int = 0
    n_scored: int = 0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def rows(self, top: int | None = None, *, rejected: bool = False) -> list[dict]:
        """Plain dicts (JSON-able): the ranked candidates (``top`` of them), then with ``rejected`` every
        rejected mesh."""
        out = [c.to_dict() for c in self.candidates[:top]]
        if rejected:
            out += [c.to_dict() for c in self.rejected]
        return out

    def to_json(self, top: int | None = None, *, rejected: bool = False) -> str:
        """The ranked candidates as a JSON list (each with dp, tp, pp, cp, ep, fits, peak_bytes_per_gpu,
        step_time_s, the time parts, rank and reason); ``rejected`` appends the rejected meshes."""
        return json.dumps(self.rows(top, rejected=rejected), indent=2)

    def rejection_summary(self) -> dict[str, int]:
        """How many meshes each rule (or ``memory``) rejected."""
        c = Counter()
        for r in self.rejected:
            for rule in dict.fromkeys(r.rules):
                c[rule] += 1
        return dict(c.most_common())

    def table(self, top: int = 10, n_rejected: int = 10) -> str:
        """The ranked table (predicted), then rejections with their reasons, as aligned text."""
        i = self.inputs
        lines = [f"PREDICTED plan: {i['model']} on {i['gpus']} x {i['gpu']} ({i['gpus_per_node']} per node, "
                 f"{self.assumptions['intra_link']} inside, {i['inter_link']} between nodes), seq_len={i['seq_len']}, "
                 f"global_batch_size={i['global_batch_size']} sequences; {self.n_enumerated} meshes enumerated, "
                 f"{self.n_scored} scored, {len(self.candidates)} fit, {len(self.rejected)} rejected",
                 f"assumed: MFU of compute kernels {i['mfu']:.0%}, ZeRO-{i['zero']}, headroom "
                 f"{i['headroom']:.0%}, bf16, 1F1B, sequence parallel with TP={i['sequence_parallel']}, TP innermost "
                 "(Megatron order tp-cp-dp-pp)", ""]
        hdr = (f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'mbs':>3} {'m':>5} {'recompute':>9} "
               f"{'peak GiB':>8} {'step s':>8} {'compute':>8} {'bubble':>7} {'TP':>7} {'CP':>7} {'EP':>7} {'PP':>7} "
               f"{'DP exp':>7} {'MFU':>5}  reason")
        lines.append(hdr)
        for c in self.candidates[:top]:
            p = c.parts
            lines.append(f"{c.rank:>3} {c.dp:>5} {c.tp:>3} {c.pp:>3} {c.cp:>3} {c.ep:>3} {c.micro_batch_size:>3} "
                         f"{c.n_microbatches:>5} {c.recompute:>9} {c.peak_bytes_per_gpu / mem.GiB:>8.1f} "
                         f"{c.step_time_s:>8.4g} {p['compute_s']:>8.4g} {p['bubble_s']:>7.3g} {p['tp_s']:>7.3g} "
                         f"{p['cp_s']:>7.3g} {p['ep_s']:>7.3g} {p['pp_s']:>7.3g} {p['dp_s']:>7.3g} "
                         f"{c.predicted_mfu:>5.1%}  {c.reason}")
        if len(self.candidates) > top:
            lines.append(f"... {len(self.candidates) - top} more fitting meshes (--top N to see them)")
        if self.rejected:
            lines += ["", f"rejected ({len(self.rejected)}; by rule: "
                      + ", ".join(f"{k} {v}" for k, v in self.rejection_summary().items()) + "):"]
            for c in self.rejected[:n_rejected]:
                lines.append(f"  {c.mesh():<40s} {c.reason}")
            if len(self.rejected) > n_rejected:
                lines.append(f"  ... {len(self.rejected) - n_rejected} more (--rejected N shows more, --all "
                             "lists all)")
        return "\n".join(lines)


def _memory(spec, dims, topo, *, seq_len, mbs, m, recompute, zero, sp, headroom, convention):
    """labkit.theory.memory.train_memory with the GPU's workspace; the verdict against ``topo.memory_bytes`` is the
    caller's (the same rule as MemoryEstimate.fits, without a data/hardware.yaml lookup per mesh)."""
    par = dims.parallel_config(zero=zero, sequence_parallel=sp and dims.tp > 1)
    train = mem.TrainConfig(micro_batch_size=mbs, seq_len=seq_len, n_microbatches=m, recompute=recompute,
                            attention="flash", convention=convention)
    return mem.train_memory(spec, par, train, headroom=headroom, workspace_bytes=mem.DEFAULT_GPU_WORKSPACE_BYTES)


def plan(model, *, gpus: int, global_batch_size: int, seq_len: int = 4096, gpu: str = "h100-80gb",
         gpus_per_node: int = 8, micro_batch_sizes=(1,), zero: int = 1, recompute: str = "auto",
         sequence_parallel: bool = True, mfu: float = DEFAULT_MFU, inter_link: str = DEFAULT_INTER_LINK,
         headroom: float = mem.DEFAULT_HEADROOM, convention: str = "zero", max_tp: int | None = None,
         ep_choices=None) -> Plan:
    """Enumerate, validate, estimate and rank every mesh of ``gpus`` GPUs for training ``model``.

    Args:
        model: a ModelSpec or a preset name (data/models.yaml).
        gpus: world size. global_batch_size: sequences per step. seq_len: tokens per sequence.
        gpu: a GPU of data/hardware.yaml with memory, peak bf16 FLOP/s and NVLink (:func:`plannable_gpus`).
        gpus_per_node: GPUs joined by NVLink; nodes are joined by ``inter_link``.
        micro_batch_sizes: micro-batch sizes to try for every mesh.
        zero: ZeRO stage over dp·cp (1 = Megatron's distributed optimizer). recompute: ``auto`` (least that
            fits) or one of none / selective / full. sequence_parallel: with tp > 1.
        mfu: assumed fraction of peak FLOP/s reached by compute kernels (:func:`step_time`).
        headroom: allocator headroom for the memory verdict (labkit.theory.memory). convention: bytes per parameter.
        max_tp: cap on tp (default None: no cap; an integer >= 1 otherwise). ep_choices: expert-parallel
            degrees to try for MoE models (default: every divisor of n_experts).

    Returns a :class:`Plan`. Raises ValueError for bad input (unknown model or GPU, gpus < 1, a world that is
    not a whole number of nodes, ...) and when no mesh fits: the message names the closest mesh and its
    shortfall, or the rules that rejected every mesh.
    """
    spec = model if isinstance(model, ModelSpec) else get_spec(model)
    gpus = positive_int("gpus", gpus)
    global_batch_size = positive_int("global_batch_size", global_batch_size)
    seq_len = positive_int("seq_len", seq_len)
    if max_tp is not None:
        max_tp = positive_int("max_tp", max_tp)
    topo = Topology.of(gpu, gpus_per_node, inter_link)
    topo.check_whole_nodes(gpus)
    check_choice("recompute", recompute, RECOMPUTE_CHOICES)
    check_choice("zero", zero, (0, 1, 2, 3))
    headroom = positive_float("headroom", headroom, allow_zero=True)
    mfu = positive_float("mfu", mfu)
    if mfu > 1:
        raise ValueError(f"mfu={mfu} must be a fraction of peak in (0, 1]")
    mbs_list = sorted({positive_int("micro_batch_size", x) for x in micro_batch_sizes})
    if not mbs_list:
        raise ValueError("micro_batch_sizes is empty; give at least one, e.g. (1,)")
    if ep_choices is None:
        ep_choices = [d for d in range(1, spec.n_experts + 1) if spec.n_experts % d == 0] if spec.is_moe else [1]
    tries = list(mem.RECOMPUTE) if recompute == "auto" else [recompute]
    conv = mem.get_convention(convention)
    grad_bytes, param_bytes = max(conv.grad_bits, 16) / 8, conv.param_bits / 8
    inputs = {"model": spec.name, "gpus": gpus, "gpu": gpu, "gpus_per_node": topo.gpus_per_node,
              "seq_len": seq_len, "global_batch_size": global_batch_size, "micro_batch_sizes": mbs_list,
              "zero": zero, "recompute": recompute, "sequence_parallel": sequence_parallel, "mfu": mfu,
              "inter_link": topo.inter.name, "headroom": headroom, "convention": convention}
    assumptions = {"intra_link": topo.intra.name, "inter_link": topo.inter.name, "peak_flops": topo.peak_flops,
                   "device_bytes": topo.memory_bytes, "schedule": "1f1b", "attention": "flash",
                   "order": "tp-cp-dp-pp (innermost first)",
                   "vocab_padding": f"to a multiple of {VOCAB_MULTIPLE}*tp when tp does not divide vocab_size"}
    fitting, rejected = [], []
    n_enum = n_scored = 0
    specs = {}
    for dims in enumerate_dims(gpus, max_tp=max_tp, ep_choices=ep_choices):
        for mbs in mbs_list:
            n_enum += 1
            cand = Candidate(dims.dp, dims.tp, dims.pp, dims.cp, dims.ep, mbs)
            bad = dims.violations(spec, seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=mbs,
                                  gpus_per_node=topo.gpus_per_node)
            if bad:
                cand.rules = [v.rule for v in bad]
                cand.reason = "; ".join(v.message for v in bad)
                rejected.append(cand)
                continue
            n_scored += 1
            m = global_batch_size // (dims.dp * mbs)
            cand.n_microbatches = m
            sp = specs.setdefault(dims.tp, padded_spec(spec, dims.tp))
            for r in tries:
                est = _memory(sp, dims, topo, seq_len=seq_len, mbs=mbs, m=m, recompute=r, zero=zero,
                              sp=sequence_parallel, headroom=headroom, convention=convention)
                if est.total_bytes <= topo.memory_bytes:
                    break
            cand.recompute, cand.peak_bytes_per_gpu = r, est.total_bytes
            cand.fits = est.total_bytes <= topo.memory_bytes
            t = step_time(sp, dims, topo, seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=mbs,
                          recompute=r, zero=zero, sequence_parallel=sequence_parallel, mfu=mfu,
                          n_params_local=est.n_params_local, grad_bytes=grad_bytes, param_bytes=param_bytes)
            cand.step_time_s, cand.predicted_mfu, cand.tokens_per_s = t["step_time_s"], t["predicted_mfu"], \
                t["tokens_per_s"]
            cand.parts = {k: t[k] for k in TIME_PARTS} | {"dp_total_s": t["dp_total_s"]}
            cand.links = t["links"]
            if cand.fits:
                fitting.append(cand)
            else:
                short = (est.total_bytes - topo.memory_bytes) / mem.GiB
                cand.rules = ["memory"]
                cand.reason = (f"[memory] does not fit even with recompute={r}: peak {est.total_bytes / mem.GiB:.1f} "
                               f"GiB per GPU > {topo.memory_bytes / mem.GiB:.1f} GiB (short {short:.2f} GiB)")
                rejected.append(cand)
    result = Plan(fitting, rejected, inputs, assumptions, n_enum, n_scored)
    if not fitting:
        raise ValueError(_nothing_fits(spec, result, topo))
    fitting.sort(key=lambda c: (c.step_time_s, c.peak_bytes_per_gpu, c.pp, c.tp))
    _explain(fitting)
    rejected.sort(key=lambda c: (c.rules != ["memory"], c.peak_bytes_per_gpu or 0))
    return result


def _nothing_fits(spec, result: Plan, topo: Topology) -> str:
    i = result.inputs
    where = f"{i['gpus']} x {i['gpu']}"
    mem_rej = [c for c in result.rejected if c.rules == ["memory"]]
    if not mem_rej:
        rules = ", ".join(f"{k} ({v})" for k, v in result.rejection_summary().items())
        first = result.rejected[0].reason if result.rejected else "no mesh enumerated"
        return (f"no valid mesh of {where} for {spec.name} (seq_len={i['seq_len']}, global_batch_size="
                f"{i['global_batch_size']}): every mesh breaks a rule: {rules}; e.g. {first}")
    best = min(mem_rej, key=lambda c: c.peak_bytes_per_gpu)
    short = (best.peak_bytes_per_gpu - topo.memory_bytes) / mem.GiB
    bigger = [g for g in plannable_gpus() if costmodel.get_device(g)["memory_bytes"] >= best.peak_bytes_per_gpu]
    fixes = ["more GPUs"] + (["ZeRO-3 (--zero 3)"] if i["zero"] < 3 else []) + ["a shorter sequence"]
    if bigger:
        fixes.append(f"a GPU with more memory ({', '.join(bigger)})")
    return (f"{spec.name} fits on no mesh of {where} (seq_len={i['seq_len']}, global_batch_size="
            f"{i['global_batch_size']}): the smallest shortfall is {short:.1f} GiB per GPU, at {best.mesh()} with "
            f"recompute={best.recompute} (peak {best.peak_bytes_per_gpu / mem.GiB:.1f} GiB > "
            f"{topo.memory_bytes / mem.GiB:.1f} GiB); use {', '.join(fixes[:-1])} or {fixes[-1]}")


def _explain(ranked: list[Candidate]) -> None:
    """Set rank and reason: #1 by its breakdown; the others by what costs them most against #1."""
    top = ranked[0]
    for i, c in enumerate(ranked, 1):
        c.rank = i
        if i == 1:
            biggest = max((k for k in TIME_PARTS if k != "compute_s"), key=lambda k: c.parts[k])
            c.reason = (f"fastest predicted step; largest overhead: {part_name(c, biggest)} "
                        f"{c.parts[biggest]:.3g} s" + _link_note(c, biggest))
            continue
        diff = {k: c.parts[k] - top.parts[k] for k in TIME_PARTS}
        worst = max(diff, key=diff.get)
        pct = (c.step_time_s / top.step_time_s - 1) * 100
        why = f"+{c.step_time_s - top.step_time_s:.3g} s (+{pct:.1f}%) vs #1, mostly {part_name(c, worst)} " \
              f"({c.parts[worst]:.3g} s vs {top.parts[worst]:.3g} s{_link_note(c, worst, short=True)})"
        if c.recompute != top.recompute and worst == "compute_s":
            why += f"; needs recompute={c.recompute} to fit"
        c.reason = why


def part_name(c: Candidate, part: str) -> str:
    """The name of a time part of ``c`` for a reason: :data:`PART_NAMES`, except ``dp_s``, which is the gradient
    sync over the dp*cp group (see :func:`step_time`), named after the dimensions that really form that group:
    "DP comm" when cp=1, "CP gradient sync" when dp=1, "DP x CP gradient sync" when both are > 1."""
    if part != "dp_s" or c.cp == 1:
        return PART_NAMES[part]
    if c.dp == 1:
        return f"CP gradient sync (exposed; dp=1, the dp*cp group is cp={c.cp})"
    return f"DP x CP gradient sync (exposed; dp*cp = {c.dp}*{c.cp})"


def _link_note(c: Candidate, part: str, short: bool = False) -> str:
    dim = {"tp_s": "tp", "cp_s": "cp", "ep_s": "ep", "pp_s": "pp", "dp_s": "dp"}.get(part)
    if dim is None:
        if part == "bubble_s":
            return f"; pp={c.pp}, m={c.n_microbatches}" if short else f" (pp={c.pp}, {c.n_microbatches} micro-batches)"
        return ""
    link = c.links.get(dim, "-")
    return f", over {link}" if short else f" over {link}"
