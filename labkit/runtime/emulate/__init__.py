"""Emulated clusters: run the real program on CPU/gloo, and time it as a named GPU cluster would.

``launch(fn, world_size, emulate="dgx-h100")`` runs the same rank functions for real (real tensors, real
collectives, real results: parity is still checked) and returns, beside the measured timeline, an
**emulated** one: every compute and communication event of the program's own execution charged what it would
cost on the profile, each rank placed on node ``rank // gpus_per_node``.

How (docs/emulation.md has the whole story):

1. **record** — inside every rank a :class:`~labkit.runtime.emulate.tracer.Tracer` records the program's
   events in order: compute operations with their FLOPs and bytes, ``time.sleep`` stand-ins, collectives and
   p2p with their groups and sizes, and where the program waits for asynchronous work;
2. **replay** — in the calling process :func:`labkit.theory.replay.replay` re-times the traces on the
   :class:`~labkit.theory.cluster.Cluster` (roofline compute, alpha-beta / hierarchical communication by
   group placement; a collective starts when its last member arrives, a recv completes after its send, async
   work overlaps until it is waited on). Deterministic: integer nanoseconds from the trace alone.
   The replay, not a virtual clock inside the ranks: the ranks run exactly as unemulated (same code path,
   same results), and the same trace can be re-priced on another profile without running again
   (:meth:`Emulation.reprice`);
3. **re-time** — every measured timeline event is mapped onto the emulated clock (:meth:`Emulation.retime`),
   so the emulated timeline has the measured one's rows (F/B/W, optimizer, ...) plus the replay's
   communication on its own stream (``stream == "comm"``).

The ``emulate`` argument: a profile name of data/hardware.yaml (:func:`labkit.theory.cluster.get_cluster`), a
:class:`~labkit.theory.cluster.Cluster`, or a dict with ``cluster`` and any of :data:`OPTIONS` — efficiencies
(``compute_efficiency``...), and to charge the run **as a named model preset**: ``model``, ``seq_len``,
``micro_batch_size`` (the preset's), ``lab_model``, ``lab_seq_len``, ``lab_micro_batch_size`` (what the ranks
really run), ``dtype`` (default ``"bf16"``), ``dims`` (a :class:`~labkit.theory.mesh.ParallelDims` or a dict
of degrees, naming each group's mesh dim) or ``group_dims`` ({tuple of ranks: dim}), ``default_dim``
(default ``"dp"``); the scaling is :func:`labkit.theory.replay.model_charge`.

Every emulated number says :attr:`Emulation.label`, ``emulated (<profile>[, as <model>])``, never measured.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from labkit.runtime.emulate import state
from labkit.runtime.emulate.variants import VARIANTS, check_emulatable, emulatable
from labkit.theory.cluster import Cluster, clusters, get_cluster, ideal_cluster
from labkit.theory.replay import Charge, ReplayError, ReplayResult, model_charge, replay, retime

__all__ = ["OPTIONS", "VARIANTS", "Cluster", "Emulation", "EmulationPlan", "ReplayError", "Session", "active",
           "charge_bytes", "check_emulatable", "clusters", "emulatable", "emulation", "get_cluster",
           "ideal_cluster", "label", "prepare", "resolve"]

#: keys of a dict ``emulate=`` argument
OPTIONS = ("cluster", "compute_efficiency", "memory_efficiency", "link_efficiency", "kernel_overhead_s",
           "model", "seq_len", "micro_batch_size", "lab_model", "lab_seq_len", "lab_micro_batch_size", "dtype",
           "lab_dtype", "dims", "group_dims", "default_dim")
_CLUSTER_OVERRIDES = ("compute_efficiency", "memory_efficiency", "link_efficiency", "kernel_overhead_s")
_DIM_ORDER = ("tp", "cp", "pp", "dp", "ep")


def label(cluster_name: str, model: str | None = None) -> str:
    """``emulated (<profile>)`` or ``emulated (<profile>, as <model>)``: the label of every emulated number."""
    return f"emulated ({cluster_name}, as {model})" if model else f"emulated ({cluster_name})"


@dataclass
class EmulationPlan:
    """A validated ``emulate=`` argument (what :func:`resolve` returns): the profile, the charge, the label."""

    cluster: Cluster
    charge: Charge
    world_size: int | None = None
    label: str = ""

    def __post_init__(self):
        if not self.label:
            model = self.charge.details.get("model") if self.charge.details else None
            self.label = label(self.cluster.name, model)

    def rank_config(self) -> dict:
        """What the ranks need to know (JSON): only that they trace; every cost is applied afterwards."""
        return {"trace": True}


def _group_dims(dims, world_size: int | None) -> dict:
    from labkit.theory.mesh import ParallelDims

    if isinstance(dims, dict):
        deg = {k: v for k, v in dims.items() if k in ("dp", "tp", "pp", "cp", "ep")}
        unknown = sorted(set(dims) - {"dp", "tp", "pp", "cp", "ep", "world_size"})
        if unknown:
            raise ValueError(f"dims has unknown key(s) {', '.join(unknown)}; valid: dp, tp, pp, cp, ep")
        n = world_size or math.prod(deg.get(k, 1) for k in ("dp", "tp", "pp", "cp"))
        dims = ParallelDims(n, **deg)
    if not isinstance(dims, ParallelDims):
        raise ValueError(f"dims={dims!r} must be a labkit.theory.mesh.ParallelDims or a dict of degrees")
    if world_size is not None and dims.world_size != world_size:
        raise ValueError(f"dims {dims} is for world_size={dims.world_size}, but the run has world_size={world_size}")
    out: dict = {}
    for dim in reversed(_DIM_ORDER):  # tp last: it wins where two dims have the same groups
        if dims.degree(dim) > 1:
            for g in dims.groups(dim):
                out[tuple(g)] = dim
    return out


def resolve(emulate, world_size: int | None = None) -> EmulationPlan:
    """Validate an ``emulate=`` argument (module docstring) and return its :class:`EmulationPlan`.

    Raises ValueError, before anything runs, for: an unknown profile (naming the valid ones), a world size the
    profile's nodes cannot hold evenly (naming the valid sizes), an unknown option, an efficiency outside
    (0, 1] or NaN, an unknown model preset, a preset charge without the lab's ``lab_seq_len`` and
    ``lab_micro_batch_size``, a seq_len beyond a model's ``max_seq_len``, or dims for another world size.
    """
    if isinstance(emulate, EmulationPlan):
        plan = emulate
        if world_size is not None:
            plan.cluster.check_world_size(world_size)
        return plan
    if isinstance(emulate, (str, Cluster)):
        emulate = {"cluster": emulate}
    if not isinstance(emulate, dict):
        raise ValueError(f"emulate={emulate!r} must be a profile name ({', '.join(clusters())}), a "
                         "labkit.theory.cluster.Cluster or a dict with 'cluster'")
    unknown = sorted(set(emulate) - set(OPTIONS))
    if unknown:
        raise ValueError(f"emulate has unknown option(s) {', '.join(unknown)}; valid: {', '.join(OPTIONS)}")
    if "cluster" not in emulate:
        raise ValueError(f"emulate needs 'cluster': one of {', '.join(clusters())} or a Cluster")
    cl = emulate["cluster"]
    if isinstance(cl, dict):
        cl = Cluster.from_dict(cl)
    overrides = {k: emulate[k] for k in _CLUSTER_OVERRIDES if k in emulate}
    cluster = get_cluster(cl, **overrides)
    if world_size is not None:
        cluster.check_world_size(world_size)
    group_dims = {}
    if emulate.get("dims") is not None:
        group_dims = _group_dims(emulate["dims"], world_size)
    for k, v in (emulate.get("group_dims") or {}).items():
        group_dims[tuple(sorted(k))] = str(v)
    default_dim = str(emulate.get("default_dim", "dp"))
    model = emulate.get("model")
    if model is None:
        for k in ("seq_len", "micro_batch_size", "lab_model", "lab_seq_len", "lab_micro_batch_size"):
            if k in emulate:
                raise ValueError(f"emulate option {k!r} only applies with 'model' (charging as a model preset)")
        dtype = emulate.get("dtype")
        if dtype is not None:
            from labkit.checks import check_choice
            from labkit.theory.cluster import DTYPES

            check_choice("dtype", dtype, DTYPES)
        charge = Charge(dtype=dtype, default_dim=default_dim, group_dims=group_dims)
        return EmulationPlan(cluster, charge, world_size)
    from labkit.theory.spec import ModelSpec, get_spec

    spec = get_spec(model) if isinstance(model, str) else model
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"model={model!r} must be a preset name or a ModelSpec")
    lab = emulate.get("lab_model", "lab-tiny-llama")
    lab = get_spec(lab) if isinstance(lab, str) else lab
    missing = [k for k in ("lab_seq_len", "lab_micro_batch_size") if k not in emulate]
    if missing:
        raise ValueError(f"charging as model {spec.name!r} needs what the ranks really run: give "
                         f"{' and '.join(missing)} (the lab model's sequence length and micro-batch size)")
    charge = model_charge(spec, emulate.get("seq_len", spec.max_seq_len), emulate.get("micro_batch_size", 1), lab,
                          emulate["lab_seq_len"], emulate["lab_micro_batch_size"],
                          dtype=emulate.get("dtype", "bf16"), lab_dtype=emulate.get("lab_dtype", "fp32"),
                          group_dims=group_dims, default_dim=default_dim)
    return EmulationPlan(cluster, charge, world_size)


def prepare(emulate, world_size: int, backend: str = "auto") -> EmulationPlan | None:
    """What ``launch`` calls before any process starts: the plan for ``emulate`` (or the innermost ambient
    :func:`emulation` block's when ``emulate`` is None), or None when nothing is emulated. Raises ValueError
    as :func:`resolve` does, and for ``backend='nccl'`` (emulation re-times a CPU/gloo run)."""
    if emulate is None:
        if not state.AMBIENT:
            return None
        emulate = state.AMBIENT[-1].emulate
    if backend not in ("auto", "gloo"):
        raise ValueError(f"backend={backend!r} cannot be emulated: emulation re-times the CPU/gloo run "
                         f"({VARIANTS['backend:nccl'][1]}); use backend='gloo' or 'auto'")
    return resolve(emulate, world_size)


# ------------------------------------------------------------------------------------------------------
# the emulated run
# ------------------------------------------------------------------------------------------------------
_COMM_COLUMNS = ["rank", "name", "kind", "start_ns", "end_ns", "step", "microbatch", "stage", "nbytes", "stream",
                 "op", "charged_nbytes", "link", "group", "dim", "async_op"]


@dataclass
class Emulation:
    """An emulated run: the plan, the replay, and the views of it (every number labelled :attr:`label`).

    Attributes:
        plan: the :class:`EmulationPlan` (profile, charge, label).
        traces: every rank's recorded trace (kept, so :meth:`reprice` can charge it on another profile).
        result: the :class:`~labkit.theory.replay.ReplayResult` (virtual integer ns from the run's start).
        offsets_ns: per rank, the clock offset its timeline frame subtracted (0 on one host).
        replay_s: seconds the replay took in this process (measured).
    """

    plan: EmulationPlan
    traces: list
    result: ReplayResult
    offsets_ns: list = field(default_factory=list)
    replay_s: float = 0.0

    @property
    def label(self) -> str:
        """:attr:`EmulationPlan.label`, plus ``"; incomplete: N% of rank r's time unpriced"`` when some rank's
        unpriced share exceeds :data:`labkit.theory.replay.INCOMPLETE_SHARE`, and ``"; K dependency
        violation(s)"`` when the program read a buffer before its transfer ended (emulated)."""
        notes = []
        r = self.result
        if r.incomplete:
            worst = max(range(len(r.unpriced_share)), key=lambda i: r.unpriced_share[i])
            notes.append(f"incomplete: {100 * r.unpriced_share[worst]:.0f}% of rank {worst}'s time unpriced")
        if r.violations:
            notes.append(f"{len(r.violations)} dependency violation{'s' if len(r.violations) > 1 else ''}")
        if not notes:
            return self.plan.label
        return self.plan.label[:-1] + "; " + "; ".join(notes) + ")"

    @property
    def incomplete(self) -> bool:
        """True when some rank's measured work the emulator could not price exceeds 5 % of its time."""
        return self.result.incomplete

    def unpriced(self):
        """What the emulator saw but could not price, one row per item: ``rank, what`` (operation / host),
        ``name``, ``measured_s``, ``share`` (the rank's whole unpriced share); ``attrs["label"]``."""
        import pandas as pd

        r = self.result
        df = pd.DataFrame([{"rank": u["rank"], "what": u["what"], "name": u["name"],
                            "measured_s": u["measured_ns"] / 1e9, "share": r.unpriced_share[u["rank"]]}
                           for u in r.unpriced], columns=["rank", "what", "name", "measured_s", "share"])
        df.attrs["label"] = self.label
        return df

    def _attrs(self, df) -> None:
        r = self.result
        df.attrs["label"] = self.label
        df.attrs["incomplete"] = r.incomplete
        df.attrs["never_waited"] = [dict(x) for x in r.never_waited]
        df.attrs["dependency_violations"] = [
            f"rank {v['rank']}: {v['name']} read at {v['used_ns'] / 1e6:.3f} ms before it completed at "
            f"{v['ready_ns'] / 1e6:.3f} ms ({self.plan.label})" for v in r.violations]

    @property
    def cluster(self) -> Cluster:
        return self.plan.cluster

    @property
    def makespan_s(self) -> float:
        """Emulated seconds from the start to the last rank's end."""
        return self.result.makespan_ns / 1e9

    def map_ns(self, rank: int, real_ns: int) -> int:
        """The emulated ns of one real timestamp of ``rank`` (on its timeline frame's clock)."""
        off = self.offsets_ns[rank] if rank < len(self.offsets_ns) else 0
        return retime(self.result.points[rank], int(real_ns) + off)

    def comm_frame(self):
        """The replay's communication, one row per collective / transfer per member rank, on the comm stream:
        timeline columns plus ``stream`` ("comm"), ``op``, ``charged_nbytes``, ``link``, ``group``, ``dim``,
        ``async_op``."""
        import pandas as pd

        rows = [{"rank": c["rank"], "name": c["name"], "kind": "comm", "start_ns": c["start_ns"],
                 "end_ns": c["end_ns"], "step": c.get("step", -1), "microbatch": c.get("microbatch", -1),
                 "stage": c.get("stage", -1), "nbytes": c["nbytes"], "stream": "comm", "op": c["op"],
                 "charged_nbytes": c["charged_nbytes"], "link": c["link"], "group": c["group"], "dim": c["dim"],
                 "async_op": c["async_op"]} for c in self.result.comm]
        df = pd.DataFrame(rows, columns=_COMM_COLUMNS)
        self._attrs(df)
        return df

    def retime(self, frame, *, comm: str = "replace", window: bool = True):
        """``frame`` (a timeline frame of this run, measured clock) on the emulated clock.

        Every row's start and end are mapped by :meth:`map_ns` (its rank's breakpoints). ``comm="replace"``
        (default) drops the measured ``comm`` rows (on CPU they time gloo, and a measured async span ends when
        gloo finished) and adds the replay's communication (:meth:`comm_frame`) that falls in the frame's
        emulated time window (every one with ``window=False``); ``"keep"`` re-times the measured comm rows
        instead. Returns a new frame with a
        ``stream`` column ("compute" for the program's rows, "comm" for the replay's) and
        ``attrs["label"]`` = :attr:`label`. Raises ValueError for another ``comm``.
        """
        import pandas as pd

        from labkit.checks import check_choice
        from labkit.runtime import timeline as tl

        check_choice("comm", comm, ("replace", "keep"))
        df = frame.copy()
        if comm == "replace":
            df = df[df["kind"] != "comm"]
        df["start_ns"] = [self.map_ns(int(r), int(s)) for r, s in zip(df["rank"], df["start_ns"])]
        df["end_ns"] = [max(self.map_ns(int(r), int(e)), s) for r, e, s in zip(df["rank"], df["end_ns"],
                                                                                  df["start_ns"])]
        df["stream"] = "compute"
        if comm == "replace":
            c = self.comm_frame()
            if window and len(df):
                lo, hi = int(df["start_ns"].min()), int(df["end_ns"].max())
                c = c[(c["end_ns"] > lo) & (c["start_ns"] < hi) & c["rank"].isin(set(df["rank"]))]
            elif window and len(frame):
                c = c.iloc[0:0]
            df = pd.concat([df, c[[k for k in c.columns if k in df.columns or k in _COMM_COLUMNS]]],
                           ignore_index=True)
        df = df.sort_values(["start_ns", "rank"], kind="stable").reset_index(drop=True)
        for col in tl.COLUMNS:
            if col in ("name", "kind"):
                continue
            df[col] = df[col].fillna(-1 if col in ("step", "microbatch", "stage") else 0).astype("int64")
        self._attrs(df)
        return df

    def totals(self):
        """Per rank (emulated seconds): ``end_s`` (its clock at its last event), ``compute_s`` (charged
        compute), ``waiting_s`` (its clock held by blocking calls and waits: exposed communication and
        synchronisation), ``comm_s`` (the union of its communication intervals), ``comm_hidden_s`` (the part
        of that during which it computed). ``attrs["label"]`` = :attr:`label`."""
        import pandas as pd

        from labkit.runtime.timeline import _overlap_ns, _union_ns

        rows = []
        r = self.result
        by_rank: dict[int, list] = {}
        for c in r.comm:
            by_rank.setdefault(c["rank"], []).append((c["start_ns"], c["end_ns"]))
        for rank in range(len(r.end_ns)):
            comm = _union_ns(by_rank.get(rank, []))
            hidden = _overlap_ns(comm, _union_ns(r.segments[rank]))
            rows.append({"rank": rank, "end_s": r.end_ns[rank] / 1e9, "compute_s": r.compute_ns[rank] / 1e9,
                         "waiting_s": r.waits[rank] / 1e9, "comm_s": sum(e - s for s, e in comm) / 1e9,
                         "comm_hidden_s": hidden / 1e9})
        df = pd.DataFrame(rows)
        self._attrs(df)
        return df

    def profile(self) -> dict:
        """Plain data for a run record: label, the profile (every number), the charge's factors."""
        ch = self.plan.charge
        return {"label": self.label, "incomplete": self.incomplete,
                "unpriced_share": list(self.result.unpriced_share),
                "never_waited": len(self.result.never_waited),
                "dependency_violations": len(self.result.violations), "cluster": self.cluster.to_dict(),
                "charge": {"label": ch.label, "flops_factor": ch.flops_factor, "bytes_factor": ch.bytes_factor,
                           "dtype": ch.dtype, "default_dim": ch.default_dim,
                           "comm": {k: list(v) for k, v in ch.comm.items()}, **dict(ch.details)},
                "makespan_s": self.makespan_s}

    def reprice(self, emulate) -> Emulation:
        """The same traces charged on another profile (name, Cluster or dict as ``launch``'s ``emulate``),
        without running anything again."""
        plan = resolve(emulate, len(self.traces))
        return _replay(plan, self.traces, self.offsets_ns)

    def __repr__(self) -> str:
        return f"Emulation({self.label}, world_size={len(self.traces)}, makespan_s={self.makespan_s:.6g})"


def _replay(plan: EmulationPlan, traces: list, offsets: list) -> Emulation:
    t0 = time.perf_counter()
    res = replay(traces, plan.cluster, plan.charge)
    return Emulation(plan, traces, res, list(offsets), time.perf_counter() - t0)


def attach(result, plan: EmulationPlan, outputs: list) -> None:
    """The launcher's parent-side hook: replay the ranks' traces (``outputs[r]["trace"]``) and set
    ``result.emulation`` (:class:`Emulation`) and ``result.emulated`` (the emulated timeline frame:
    :meth:`Emulation.retime` of ``result.timeline``). Raises ReplayError (a ValueError) when the trace cannot
    be replayed, with the LaunchResult as ``err.result``."""
    traces = [o.get("trace") or [] for o in outputs]
    offsets = [int(o.get("offset_ns", 0)) for o in outputs]
    try:
        em = _replay(plan, traces, offsets)
    except ReplayError as e:
        e.result = result
        raise
    result.emulation = em
    result.emulated = em.retime(result.timeline, window=False)
    for s in state.AMBIENT:
        s.runs.append(em)


# ------------------------------------------------------------------------------------------------------
# ambient emulation, rank-side helpers
# ------------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """An :func:`emulation` block: the ``emulate`` spec every launch inside it uses, and the
    :class:`Emulation` of each launch (``runs``, in order; ``last``)."""

    emulate: object
    runs: list = field(default_factory=list)

    @property
    def last(self) -> Emulation:
        if not self.runs:
            raise ValueError("no launch has finished inside this emulation block yet")
        return self.runs[-1]


@contextlib.contextmanager
def emulation(emulate) -> Iterator[Session]:
    """Emulate every ``launch`` inside the block (one that passes no ``emulate`` of its own), e.g. a chapter
    entry point or ``run_pipeline`` that does not take an ``emulate`` argument::

        with emulation("dgx-h100") as session:
            run = run_pipeline("1f1b", pp=4)
        emulated = session.last.retime(run.timeline)

    ``emulate`` is validated at once (ValueError as :func:`resolve`, without a world size)."""
    resolve(emulate)
    s = Session(emulate)
    state.AMBIENT.append(s)
    try:
        yield s
    finally:
        state.AMBIENT.remove(s)


def active() -> bool:
    """Inside a rank: True when this rank is being traced for emulation."""
    return state.ACTIVE is not None


@contextlib.contextmanager
def charge_bytes(nbytes: int) -> Iterator[None]:
    """Inside a rank: charge every collective and transfer issued in the block as S = ``nbytes`` (what the
    emulated run would move), whatever the tensor really holds — e.g. a 4 KiB buffer on CPU charged as the
    1 GiB all-reduce it stands for. A no-op when the rank is not being traced. Raises ValueError for
    nbytes < 0."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} must be an integer >= 0")
    tr = state.ACTIVE
    if tr is None:
        yield
        return
    old, tr.nbytes_override = tr.nbytes_override, nbytes
    try:
        yield
    finally:
        tr.nbytes_override = old


def rank_begin(config: dict | None, rank: int, world_size: int):
    """The worker's hook before the rank function: start a tracer when ``config`` asks (None otherwise)."""
    if not config:
        return None
    from labkit.runtime.emulate.tracer import start

    return start(rank, world_size)


def rank_end(tracer) -> list | None:
    """The worker's hook after the rank function: stop the tracer and return its trace (None without one)."""
    return None if tracer is None else tracer.stop()
