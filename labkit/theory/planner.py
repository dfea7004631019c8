"""The mesh planner: inventory the workload, draw the topology, generate every valid mesh, estimate memory
and step time under every pipeline schedule, rank. Pure Python (no torch): scoring every mesh of 16,384 GPUs,
stage splits and schedules included, takes under a second (benchmarks/planner_speed.py).

:func:`plan` does, for ``gpus`` GPUs of one kind in nodes of ``gpus_per_node``:

1. **enumerate** every (dp, tp, pp, cp[, ep]) with dp·tp·pp·cp = gpus (:func:`labkit.theory.mesh.enumerate_dims`),
   times each micro-batch size;
2. **validate** with :meth:`labkit.theory.mesh.ParallelDims.violations` (heads, kv heads, hidden, ffn by tp; the
   stage split, pp <= n_layers; sequence by cp; global batch by dp·micro-batch; micro-batches >= pp; groups
   aligned with nodes) — a failure is a *rejection* with the rule's message;
3. **stage split**: ``layers_per_stage`` given, or derived (:func:`labkit.theory.memory.split_layers`: even when
   pp divides n_layers, else fewer layers on the first and last stages, as Llama 3 405B's 7 + 14·8 + 7);
4. **schedules**: 1F1B, ZB-H1 and interleaved with every v from 2 to :data:`MAX_VPP` the split allows, each
   with its in-flight activations (memory), bubble and p2p count (time);
5. **memory**: :func:`labkit.theory.memory.train_peaks` (the calculator's peak, heaviest stage) with headroom,
   against the GPU's program-visible memory; with ``recompute="auto"`` the least recompute with which some
   schedule fits (none, then selective, then full); nothing fits -> a rejection naming the shortfall;
6. **time**: place the grid on the nodes in Megatron Core's order (TP innermost: TP groups on NVLink inside a
   node; then CP, DP, PP, which cross nodes first), price every group's collectives with the hierarchical
   model of :func:`labkit.theory.costmodel.placed_collective_time` (NICs per node), and keep each mesh's
   fastest fitting schedule (:func:`step_time`);
7. **rank** by predicted step time (then peak memory), each with the reason for its place and the term that
   dominates its step.

Everything here is a *prediction*: label it so wherever it is shown. :func:`labkit.theory.published.validate_published`
(the layer above this one) puts the predictions beside published training runs (data/reference/published/training.csv).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

from labkit.checks import check_choice, positive_float, positive_int
from labkit.theory import costmodel
from labkit.theory import memory as mem
from labkit.theory.mesh import ParallelDims, enumerate_dims
from labkit.theory.spec import ModelSpec, get_spec
from labkit.theory.steptime import (  # noqa: F401  (re-exported: the planner's public time model)
    DEFAULT_INTER_LINK,
    DEFAULT_MFU,
    MAX_VPP,
    SCHEDULE_CHOICES,
    TIME_PARTS,
    Topology,
    _step_base,
    _step_with,
    bubble_factor,
    p2p_count,
    padded_spec,
    plannable_gpus,
    schedule_options,
    stage_imbalance,
    step_time,
)

RECOMPUTE_CHOICES = ("auto", *mem.RECOMPUTE)
PART_NAMES = {"compute_s": "compute", "bubble_s": "pipeline bubble", "tp_s": "TP comm", "cp_s": "CP comm",
              "ep_s": "EP comm", "pp_s": "PP send/recv", "dp_s": "DP comm (exposed)"}
#: Megatron-LM pads the vocabulary to a multiple of this x tp (labkit.theory.memory.padded_vocab_size)
VOCAB_MULTIPLE = mem.VOCAB_MULTIPLE
#: The planner's byte conventions, Megatron-LM's own (the planner's mesh *is* Megatron's: TP + sequence
#: parallelism, ZeRO-1 as the distributed optimizer, Megatron Core's rank order and vocabulary padding), so a
#: published Megatron-style run is sized the way its framework sizes it: 6 + 12/dp bytes per parameter with the
#: distributed optimizer (theoretical_memory_usage.py), sbh(18 + 4f/h)/t activations per layer (the same file).
#: The lab's own activation model ("lab", byte-exact for labkit.models on CPU) describes unfused torch kernels
#: and is an upper bound for fused-kernel frameworks; pass activations="lab" / "korthikanti" to compare.
DEFAULT_CONVENTION = "megatron"
DEFAULT_ACTIVATIONS = "megatron"


# ------------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One mesh with its predicted memory and time, under its fastest fitting pipeline ``schedule`` (``vpp``
    chunks per rank) and stage split ``layers_per_stage``. ``rank`` (1 = best) and ``reason`` are set by
    :func:`plan` for fitting candidates; rejected ones keep rank None and say why in ``reason``;
    ``dominant`` names the largest part of the step after compute."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    micro_batch_size: int
    n_microbatches: int | None = None
    recompute: str | None = None
    schedule: str | None = None
    vpp: int = 1
    layers_per_stage: tuple | None = None
    fits: bool = False
    peak_bytes_per_gpu: int | None = None
    peak_stage: int | None = None
    step_time_s: float | None = None
    parts: dict = field(default_factory=dict)
    predicted_mfu: float | None = None
    predicted_hfu: float | None = None
    tokens_per_s: float | None = None
    links: dict = field(default_factory=dict)
    rules: list = field(default_factory=list)
    rank: int | None = None
    reason: str = ""
    dominant: str = ""

    def mesh(self) -> str:
        s = f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp}"
        return s + (f" ep={self.ep}" if self.ep > 1 else "") + f" mbs={self.micro_batch_size}"

    def schedule_text(self) -> str:
        """``1f1b``, ``zb-h1``, ``interleaved v=4`` ("-" without a pipeline or a verdict)."""
        if self.pp == 1 or self.schedule is None:
            return "-"
        return f"{self.schedule} v={self.vpp}" if self.schedule == "interleaved" else self.schedule

    def split_text(self) -> str:
        """The stage split as short text (``7,8x14,7``), "-" without a pipeline."""
        return mem.format_split(self.layers_per_stage) if self.layers_per_stage and self.pp > 1 else "-"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("parts"))
        d["layers_per_stage"] = list(self.layers_per_stage) if self.layers_per_stage else None
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

    def find(self, *, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1, micro_batch_size: int | None = None):
        """The candidate (ranked or rejected) of that mesh, or None; with several micro-batch sizes and none
        given, the best-ranked one."""
        hits = [c for c in self.candidates + self.rejected if (c.dp, c.tp, c.pp, c.cp, c.ep) == (dp, tp, pp, cp, ep)
                and (micro_batch_size is None or c.micro_batch_size == micro_batch_size)]
        return hits[0] if hits else None

    def rows(self, top: int | None = None, *, rejected: bool = False) -> list[dict]:
        """Plain dicts (JSON-able): the ranked candidates (``top`` of them), then with ``rejected`` every
        rejected mesh."""
        out = [c.to_dict() for c in self.candidates[:top]]
        if rejected:
            out += [c.to_dict() for c in self.rejected]
        return out

    def to_json(self, top: int | None = None, *, rejected: bool = False) -> str:
        """The ranked candidates as a JSON list (each with dp, tp, pp, cp, ep, schedule, vpp, layers_per_stage,
        fits, peak_bytes_per_gpu, step_time_s, the time parts, rank and reason); ``rejected`` appends the
        rejected meshes."""
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
        i, a = self.inputs, self.assumptions
        lines = [f"PREDICTED plan: {i['model']} on {i['gpus']} x {i['gpu']} ({i['gpus_per_node']} per node, "
                 f"{a['intra_link']} inside, {i['inter_link']} x {i['nics_per_node']} NICs per node between nodes), "
                 f"seq_len={i['seq_len']}, global_batch_size={i['global_batch_size']} sequences; "
                 f"{self.n_enumerated} meshes enumerated, {self.n_scored} scored, {len(self.candidates)} fit, "
                 f"{len(self.rejected)} rejected",
                 f"assumed: compute {_compute_text(i['mfu'])}, ZeRO-{i['zero']}, bytes: convention "
                 f"{i['convention']}, activations {i['activations']}, headroom {i['headroom']:.0%}, "
                 f"{a['device_bytes'] / mem.GiB:.2f} GiB usable per GPU (program-visible; data/hardware.yaml), "
                 f"bf16, schedules {', '.join(i['schedules'])} (v <= {i['max_vpp']}), "
                 f"sequence parallel with TP={i['sequence_parallel']}, TP innermost (Megatron order tp-cp-dp-pp), "
                 "collectives hierarchical across nodes", ""]
        hdr = (f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'ep':>3} {'mbs':>3} {'m':>5} {'schedule':>14} "
               f"{'split':>10} {'recompute':>9} {'peak GiB':>8} {'step s':>8} {'compute':>8} {'bubble':>7} {'TP':>7} "
               f"{'CP':>7} {'EP':>7} {'PP':>7} {'DP exp':>7} {'MFU':>5}  reason")
        lines.append(hdr)
        for c in self.candidates[:top]:
            p = c.parts
            lines.append(f"{c.rank:>3} {c.dp:>5} {c.tp:>3} {c.pp:>3} {c.cp:>3} {c.ep:>3} {c.micro_batch_size:>3} "
                         f"{c.n_microbatches:>5} {c.schedule_text():>14} {c.split_text():>10} {c.recompute:>9} "
                         f"{c.peak_bytes_per_gpu / mem.GiB:>8.1f} {c.step_time_s:>8.4g} {p['compute_s']:>8.4g} "
                         f"{p['bubble_s']:>7.3g} {p['tp_s']:>7.3g} {p['cp_s']:>7.3g} {p['ep_s']:>7.3g} "
                         f"{p['pp_s']:>7.3g} {p['dp_s']:>7.3g} {c.predicted_mfu:>5.1%}  {c.reason}")
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


@dataclass(frozen=True)
class _Setup:
    """Everything :func:`score_mesh` needs that is the same for every mesh of a plan."""

    spec: ModelSpec
    topo: Topology
    seq_len: int
    global_batch_size: int
    zero: int
    tries: tuple
    sequence_parallel: bool
    mfu: float | None
    headroom: float
    convention: str
    activations: str
    schedules: tuple
    max_vpp: int
    layers_per_stage: tuple | None
    first_stage_layers: int | None
    last_stage_layers: int | None
    grad_bytes: float
    param_bytes: float


def _split_for(st: _Setup, pp: int) -> tuple[int, ...]:
    if st.layers_per_stage is not None:
        return mem.check_split(st.layers_per_stage, st.spec.n_layers, pp)
    if pp > 1 and (st.first_stage_layers is not None or st.last_stage_layers is not None):
        return mem.split_layers(st.spec.n_layers, pp, first=st.first_stage_layers, last=st.last_stage_layers)
    return mem.split_layers(st.spec.n_layers, pp)


def score_mesh(st: _Setup, dims: ParallelDims, mbs: int, *, schedules=None, recompute_tries=None) -> Candidate:
    """Memory and time of one mesh (already valid by the rules): for the least recompute of ``tries`` with which
    some schedule fits, the fastest fitting schedule; a memory rejection naming the shortfall otherwise.
    ``schedules`` (a list of (schedule, v)) and ``recompute_tries`` override the plan's (the validation of a
    published configuration fixes what the source states)."""
    spec = padded_spec(st.spec, dims.tp)
    cand = Candidate(dims.dp, dims.tp, dims.pp, dims.cp, dims.ep, mbs)
    m = st.global_batch_size // (dims.dp * mbs)
    cand.n_microbatches = m
    try:
        split = _split_for(st, dims.pp)
    except ValueError as e:
        cand.rules, cand.reason = ["pp_layers"], f"[pp_layers] {e}"
        return cand
    cand.layers_per_stage = split
    opts = schedules if schedules is not None else schedule_options(dims.pp, m, split, st.schedules, st.max_vpp)
    if not opts:
        cand.rules, cand.reason = ["pp_schedule"], (f"[pp_schedule] no schedule of {', '.join(st.schedules)} runs "
                                                    f"pp={dims.pp} with m={m} micro-batches and split "
                                                    f"{mem.format_split(split)}")
        return cand
    par = mem.ParallelConfig(dp=dims.dp, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, zero=st.zero,
                             sequence_parallel=st.sequence_parallel and dims.tp > 1, layers_per_stage=split)
    cap = st.topo.memory_bytes
    tries = recompute_tries or st.tries
    best, closest = None, None
    for r in tries:  # recompute and schedule chosen jointly: the fastest fitting pair, not the least recompute
        train = mem.TrainConfig(micro_batch_size=mbs, seq_len=st.seq_len, n_microbatches=m, recompute=r,
                                attention="flash", convention=st.convention, activation_model=st.activations)
        if r == "selective" and "none" in tries and _selective_saves_nothing(spec, train, par):
            continue  # the same bytes as "none" and more compute: never faster
        peaks = mem.train_peaks(spec, par, train, opts, headroom=st.headroom,
                                workspace_bytes=mem.DEFAULT_GPU_WORKSPACE_BYTES)
        fitting = [(o, pk) for o, pk in zip(opts, peaks, strict=True) if pk[0] <= cap]
        if not fitting:
            low = min(zip(opts, peaks, strict=True), key=lambda x: x[1][0])
            if closest is None or low[1][0] < closest[1][1][0]:
                closest = (r, low)
            continue
        base = _step_base(spec, dims, st.topo, seq_len=st.seq_len, global_batch_size=st.global_batch_size,
                          micro_batch_size=mbs, recompute=r, sequence_parallel=st.sequence_parallel, mfu=st.mfu,
                          act_bytes=2, split=split)
        for (sched, v), (peak, stage, n_local) in fitting:
            t = _step_with(base, dims, st.topo, sched, v, st.zero, n_local, st.grad_bytes, st.param_bytes)
            key = (t["step_time_s"], peak)
            if best is None or key < best[0]:
                best = (key, t, sched, v, peak, stage, r)
        if len(fitting) == len(opts):
            break  # every schedule fits already: more recompute only adds compute (and TP traffic)
    if best is None:
        r, ((sched, v), (peak, stage, _)) = closest
        cand.recompute = r
        cand.schedule, cand.vpp, cand.peak_bytes_per_gpu, cand.peak_stage = sched, v, peak, stage
        short = (peak - cap) / mem.GiB
        cand.rules = ["memory"]
        cand.reason = (f"[memory] does not fit even with recompute={tries[-1]}: least peak "
                       f"{peak / mem.GiB:.1f} GiB per GPU (recompute={r}, stage {stage}, {cand.schedule_text()}) > "
                       f"{cap / mem.GiB:.1f} GiB usable (short {short:.2f} GiB)")
        return cand
    _, t, cand.schedule, cand.vpp, cand.peak_bytes_per_gpu, cand.peak_stage, cand.recompute = best
    cand.fits = True
    cand.step_time_s, cand.predicted_mfu, cand.tokens_per_s = t["step_time_s"], t["predicted_mfu"], t["tokens_per_s"]
    cand.predicted_hfu = t["predicted_hfu"]
    cand.parts = {k: t[k] for k in TIME_PARTS} | {"dp_total_s": t["dp_total_s"], "imbalance": t["imbalance"]}
    cand.links = t["links"]
    dom = max((k for k in TIME_PARTS if k != "compute_s"), key=lambda k: cand.parts[k])
    cand.dominant = f"{part_name(cand, dom)} {cand.parts[dom] / cand.step_time_s:.0%} of the step"
    return cand


def _compute_text(mfu) -> str:
    """How compute is priced, for the plan's header line."""
    if mfu is None:
        return "priced kernel by kernel at each mesh's per-rank shapes (labkit.theory.kernels)"
    return f"constant efficiency: every op at {mfu:.0%} of peak"


def _selective_saves_nothing(spec: ModelSpec, train, par) -> bool:
    """True when selective recompute keeps the same activation bytes as none for this configuration (no
    core-attention items: flash attention, or Megatron's formula), so its memory is the same."""
    from labkit.theory.memory.activations import _layer_activation_bytes
    from labkit.theory.memory.train import _act_par, _no_recompute, _one_microbatch

    act = _act_par(par.tp, par.cp, par.sequence_parallel)
    one = _one_microbatch(train)
    kinds = {spec.is_moe_layer(0), spec.is_moe_layer(spec.n_layers - 1)}
    return all(_layer_activation_bytes(spec, one, act, k) == _layer_activation_bytes(spec, _no_recompute(one), act, k)
               for k in kinds)


def _setup(model, *, gpus, global_batch_size, seq_len, gpu, gpus_per_node, micro_batch_sizes, zero, recompute,
           sequence_parallel, mfu, inter_link, headroom, convention, activations, max_tp, schedules, max_vpp,
           nics_per_node, layers_per_stage, first_stage_layers, last_stage_layers, sustained=None):
    """Validate :func:`plan`'s inputs (bounded: magnitudes first) and build the shared setup."""
    spec = model if isinstance(model, ModelSpec) else get_spec(model)
    mem.check_spec_bounds(spec)
    gpus = mem.bounded_int("gpus", gpus, mem.MAX_DEGREE, what="GPUs in the cluster")
    global_batch_size = mem.bounded_int("global_batch_size", global_batch_size, mem.MAX_BATCH)
    seq_len = mem.bounded_int("seq_len", seq_len, mem.MAX_SEQ_LEN, what="tokens per sequence")
    if max_tp is not None:
        max_tp = positive_int("max_tp", max_tp)
    topo = Topology.of(gpu, gpus_per_node, inter_link, nics_per_node, sustained)
    topo.check_whole_nodes(gpus)
    check_choice("recompute", recompute, RECOMPUTE_CHOICES)
    check_choice("zero", zero, (0, 1, 2, 3))
    headroom = mem.check_headroom(headroom)
    if mfu is not None:
        mfu = positive_float("mfu", mfu)
        if mfu > 1:
            raise ValueError(f"mfu={mfu} must be a fraction of peak in (0, 1]")
    mbs_list = sorted({mem.bounded_int("micro_batch_size", x, mem.MAX_BATCH) for x in micro_batch_sizes})
    if not mbs_list:
        raise ValueError("micro_batch_sizes is empty; give at least one, e.g. (1,)")
    schedules = tuple(schedules)
    for s_ in schedules:
        check_choice("schedule", s_, SCHEDULE_CHOICES)
    if not schedules:
        raise ValueError(f"schedules is empty; give at least one of {', '.join(SCHEDULE_CHOICES)}")
    max_vpp = mem.bounded_int("max_vpp", max_vpp, 64)
    conv = mem.get_convention(convention)
    check_choice("activations", activations, mem.ACTIVATION_MODELS)
    if layers_per_stage is not None:
        layers_per_stage = mem.check_split(layers_per_stage, spec.n_layers, len(tuple(layers_per_stage)))
    if first_stage_layers is not None:
        first_stage_layers = mem.bounded_int("first_stage_layers", first_stage_layers, spec.n_layers)
    if last_stage_layers is not None:
        last_stage_layers = mem.bounded_int("last_stage_layers", last_stage_layers, spec.n_layers)
    if layers_per_stage is not None and (first_stage_layers or last_stage_layers):
        raise ValueError("give layers_per_stage or first/last_stage_layers, not both")
    tries = tuple(mem.RECOMPUTE) if recompute == "auto" else (recompute,)
    st = _Setup(spec, topo, seq_len, global_batch_size, zero, tries, sequence_parallel, mfu, headroom, convention,
                activations, schedules, max_vpp, layers_per_stage, first_stage_layers, last_stage_layers,
                max(conv.grad_bits, 16) / 8, conv.param_bits / 8)
    return st, mbs_list, max_tp, gpus


def plan(model, *, gpus: int, global_batch_size: int, seq_len: int = 4096, gpu: str = "h100-80gb",
         gpus_per_node: int = 8, micro_batch_sizes=(1,), zero: int = 1, recompute: str = "auto",
         sequence_parallel: bool = True, mfu: float | None = None, inter_link: str | None = None,
         headroom: float = mem.DEFAULT_HEADROOM, convention: str = DEFAULT_CONVENTION,
         activations: str = DEFAULT_ACTIVATIONS, max_tp: int | None = None, ep_choices=None,
         schedules=SCHEDULE_CHOICES, max_vpp: int = MAX_VPP, nics_per_node: int | None = None,
         layers_per_stage=None, first_stage_layers: int | None = None, last_stage_layers: int | None = None,
         sustained: float | None = None) -> Plan:
    """Enumerate, validate, estimate and rank every mesh of ``gpus`` GPUs for training ``model``.

    Args:
        model: a ModelSpec or a preset name (data/models.yaml).
        gpus: world size. global_batch_size: sequences per step. seq_len: tokens per sequence.
        gpu: a GPU of data/hardware.yaml with memory, peak bf16 FLOP/s and NVLink (:func:`plannable_gpus`).
        gpus_per_node: GPUs joined by NVLink; nodes are joined by ``inter_link`` (None: the GPU's own cluster
            profile's network, :func:`labkit.theory.steptime.default_inter_link`: ib-hdr for A100, ib-ndr for
            H100) through ``nics_per_node`` NICs (None: one per GPU, rail-optimised).
        micro_batch_sizes: micro-batch sizes to try for every mesh.
        zero: ZeRO stage over dp·cp (1 = Megatron's distributed optimizer). recompute: ``auto`` (least that
            fits) or one of none / selective / full. sequence_parallel: with tp > 1.
        mfu: None (default): compute priced kernel by kernel at each mesh's per-rank shapes
            (:mod:`labkit.theory.kernels`); a number: the constant-efficiency model, every op at that fraction of
            the peak (:func:`step_time`).
        headroom: allocator headroom for the memory verdict. convention / activations: the calculator's
            bytes-per-parameter convention and activation model (defaults :data:`DEFAULT_CONVENTION`,
            :data:`DEFAULT_ACTIVATIONS`: Megatron-LM's, see there).
        schedules: pipeline schedules to consider (:data:`SCHEDULE_CHOICES`); max_vpp: most interleaved chunks.
        layers_per_stage: a fixed stage split (only meshes with pp = its length are then scored), or
            first_stage_layers / last_stage_layers (Megatron's options; the other stages split the rest evenly);
            default: derived per pp (:func:`labkit.theory.memory.split_layers`).
        sustained: the fraction of the kernel benchmarks' rate a training run sustains (None: the value fitted on
            the calibration rows, :func:`labkit.theory.steptime.sustained_fraction`).
        max_tp: cap on tp (default None: no cap; an integer >= 1 otherwise). ep_choices: expert-parallel
            degrees to try for MoE models (default: every divisor of n_experts).

    Returns a :class:`Plan`. Raises ValueError for bad input (unknown model or GPU, gpus < 1 or absurdly large,
    a world that is not a whole number of nodes, a bad split, NaN or out-of-range efficiencies, ...) before any
    search, and when no mesh fits: the message names the closest mesh and its shortfall, or the rules that
    rejected every mesh.
    """
    st, mbs_list, max_tp, gpus = _setup(
        model, gpus=gpus, global_batch_size=global_batch_size, seq_len=seq_len, gpu=gpu, gpus_per_node=gpus_per_node,
        micro_batch_sizes=micro_batch_sizes, zero=zero, recompute=recompute, sequence_parallel=sequence_parallel,
        mfu=mfu, inter_link=inter_link, headroom=headroom, convention=convention, activations=activations,
        max_tp=max_tp, schedules=schedules, max_vpp=max_vpp, nics_per_node=nics_per_node,
        layers_per_stage=layers_per_stage, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        sustained=sustained)
    spec, topo = st.spec, st.topo
    if ep_choices is None:
        ep_choices = [d for d in range(1, spec.n_experts + 1) if spec.n_experts % d == 0] if spec.is_moe else [1]
    inputs = {"model": spec.name, "gpus": gpus, "gpu": gpu, "gpus_per_node": topo.gpus_per_node,
              "seq_len": st.seq_len, "global_batch_size": st.global_batch_size, "micro_batch_sizes": mbs_list,
              "zero": zero, "recompute": recompute, "sequence_parallel": sequence_parallel, "mfu": st.mfu,
              "inter_link": topo.inter.name, "nics_per_node": topo.nics_per_node, "headroom": st.headroom,
              "convention": convention, "activations": st.activations, "schedules": list(st.schedules),
              "max_vpp": st.max_vpp, "layers_per_stage": list(st.layers_per_stage) if st.layers_per_stage else None}
    assumptions = {"intra_link": topo.intra.name, "inter_link": topo.inter.name, "peak_flops": topo.peak_flops,
                   "device_bytes": topo.memory_bytes, "datasheet_bytes": topo.device_bytes,
                   "device_capacity": mem.capacity_note(costmodel.get_device(gpu)),
                   "attention": "flash", "order": "tp-cp-dp-pp (innermost first)",
                   "collectives": "ring inside a node, hierarchical across nodes over nics_per_node NICs "
                                  "(labkit.theory.costmodel.placed_collective_time)",
                   "stage_split": "given" if st.layers_per_stage else (
                       "first/last given, the rest even" if (st.first_stage_layers or st.last_stage_layers)
                       else "derived: even when pp divides n_layers, else embedding and loss counted as a layer"),
                   "vocab_padding": f"to a multiple of {VOCAB_MULTIPLE}*tp when tp does not divide vocab_size"}
    fitting, rejected = [], []
    n_enum = n_scored = 0
    for dims in enumerate_dims(gpus, max_tp=max_tp, max_pp=spec.n_layers, ep_choices=ep_choices):
        if st.layers_per_stage is not None and dims.pp != len(st.layers_per_stage):
            continue
        for mbs in mbs_list:
            n_enum += 1
            bad = dims.violations(spec, seq_len=st.seq_len, global_batch_size=st.global_batch_size,
                                  micro_batch_size=mbs, gpus_per_node=topo.gpus_per_node)
            if bad:
                cand = Candidate(dims.dp, dims.tp, dims.pp, dims.cp, dims.ep, mbs)
                cand.rules = [v.rule for v in bad]
                cand.reason = "; ".join(v.message for v in bad)
                rejected.append(cand)
                continue
            n_scored += 1
            cand = score_mesh(st, dims, mbs)
            (fitting if cand.fits else rejected).append(cand)
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
    bigger = [g for g in plannable_gpus() if mem.usable_bytes(costmodel.get_device(g)) >= best.peak_bytes_per_gpu]
    fixes = ["more GPUs"] + (["ZeRO-3 (--zero 3)"] if i["zero"] < 3 else []) + ["a shorter sequence"]
    if bigger:
        fixes.append(f"a GPU with more memory ({', '.join(bigger)})")
    return (f"{spec.name} fits on no mesh of {where} (seq_len={i['seq_len']}, global_batch_size="
            f"{i['global_batch_size']}): the smallest shortfall is {short:.1f} GiB per GPU, at {best.mesh()} with "
            f"recompute={best.recompute} (peak {best.peak_bytes_per_gpu / mem.GiB:.1f} GiB > "
            f"{topo.memory_bytes / mem.GiB:.1f} GiB usable); use {', '.join(fixes[:-1])} or {fixes[-1]}")


def _explain(ranked: list[Candidate]) -> None:
    """Set rank and reason: #1 by its breakdown; the others by what costs them most against #1; every reason
    ends with the term that dominates the candidate's own step."""
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
        c.reason = why + (f"; dominant overhead: {c.dominant}" if c.dominant else "")


def part_name(c: Candidate, part: str) -> str:
    """The name of a time part of ``c`` for a reason: :data:`PART_NAMES`, except ``dp_s``, which is the gradient
    sync over the dp*cp group (see :func:`step_time`), named after the dimensions that really form that group:
    "DP comm" when cp=1, "CP gradient sync" when dp=1, "DP x CP gradient sync" when both are > 1; and the bubble,
    named with its schedule."""
    if part == "bubble_s" and c.schedule and c.pp > 1:
        return f"pipeline bubble ({c.schedule_text()})"
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
        if part == "compute_s" and c.parts.get("imbalance", 1) > 1.001:
            return f"; stage imbalance x{c.parts['imbalance']:.2f}" if short else ""
        return ""
    link = c.links.get(dim, "-")
    return f", over {link}" if short else f" over {link}"

