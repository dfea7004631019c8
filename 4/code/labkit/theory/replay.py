"""Replay a recorded run on a cluster profile: the pure, deterministic half of the emulator.

Pure Python (no torch, no pandas). :mod:`labkit.runtime.emulate` records, inside every rank, the program's
own sequence of events (compute operations with their FLOPs and bytes, ``time.sleep`` stand-ins, collectives
with their group and size, point-to-point sends and receives, and the places the program waits for
asynchronous work). :func:`replay` re-times that trace on a :class:`~labkit.theory.cluster.Cluster`, so the
same trace can be priced on any profile without running it again, and the result depends on nothing but the
trace and the profile (integer nanoseconds: the same trace gives the same timeline to the nanosecond).

Trace format (one list per rank, in program order; times are the rank's real clock, ns):

* ``("c", t0, t1, flops, nbytes, dtype)`` — one compute operation;
* ``("s", t0, t1, seconds)`` — ``time.sleep(seconds)``: charged ``seconds`` on any profile, never scaled;
* ``("coll", t0, t1, uid, op, ranks, nbytes, is_async, info)`` — a collective on the global ``ranks``
  (a sorted tuple), S = ``nbytes`` (nccl-tests convention); ``info`` a dict of tags (``name``, ``step``, ...);
* ``("p2p", t0, t1, uid, "send"|"recv", peer, tag, nbytes, is_async, info)``;
* ``("wait", t0, t1, uid)`` — the program waits for the asynchronous event ``uid`` of this rank.

Rules of the replay (each rank has a compute clock; a collective runs on its group's stream):

* compute: ``clock += cost`` (:class:`Charge` and :meth:`~labkit.theory.cluster.Cluster.compute_s`);
* collectives: the k-th collective a rank issues on a group (the same sorted tuple of global ranks) is the same
  instance on every member. It starts when the last member has issued it *and* every member's stream for that
  group is free (collectives on one group run in order), and lasts
  :meth:`~labkit.theory.cluster.Cluster.collective_s` for its op, S and the group's placement. A blocking call
  moves the caller's clock to the end; an asynchronous one leaves it, and the ``wait`` moves it to
  ``max(clock, end)``. Different groups' streams run concurrently with no contention;
* point-to-point: the k-th send from a to b with tag t matches the k-th receive at b from a with tag t; the
  transfer starts when both are posted and lasts :meth:`~labkit.theory.cluster.Cluster.p2p_s`; transfers are
  independent of each other (no per-pair ordering);
* a trace that cannot progress (a rank waits for a collective some member never issues) raises
  :class:`ReplayError` naming the ranks and what they wait for — the real run would have hung.

The replay also returns, per rank, breakpoints (real ns, virtual ns) for :func:`retime`, which maps any
real timestamp of that rank (a timeline event) onto the emulated clock: linearly inside a compute operation,
flat between operations (host-side Python costs nothing on the emulated GPU) and across a wait.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from labkit.checks import positive_float
from labkit.theory.cluster import DTYPE_BYTES, TORCH_DTYPES, Cluster

#: mesh dimensions whose collectives carry parameters or gradients (scaled by the parameter ratio)
PARAM_DIMS = ("dp", "dp_cp", "edp", "fsdp")
#: mesh dimensions whose collectives carry activations (scaled by the activation ratio, once per layer)
ACT_DIMS = ("tp", "sp", "cp", "ep", "pp")


class ReplayError(ValueError):
    """The trace cannot be replayed: a deadlock, mismatched collectives, or an event the emulator cannot
    represent (a receive from any source)."""


@dataclass(frozen=True)
class Charge:
    """How a trace is charged beyond the profile's own costs: the "as a model" scaling.

    Attributes:
        label: ``"as llama-3-8b"`` or ``""`` (charged as recorded).
        flops_factor, bytes_factor: every compute operation's FLOPs and bytes are multiplied by these.
        dtype: charge every floating-point operation at this dtype's peak (``"bf16"``...); None = the dtype the
            operation ran in.
        comm: mesh dim -> (bytes factor, repeat): a collective on a group of that dim is charged ``repeat``
            times the cost of ``bytes factor * S``.
        default_dim: the dim of a group :attr:`group_dims` does not name.
        group_dims: sorted tuple of global ranks -> mesh dim.
        details: plain data explaining the factors (recorded with the run).
    """

    label: str = ""
    flops_factor: float = 1.0
    bytes_factor: float = 1.0
    dtype: str | None = None
    comm: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    default_dim: str = "dp"
    group_dims: Mapping[tuple, str] = field(default_factory=dict)
    details: Mapping = field(default_factory=dict)

    def dim_of(self, ranks: tuple) -> str:
        return self.group_dims.get(tuple(ranks), self.default_dim)

    def comm_factor(self, ranks: tuple, p2p: bool = False) -> tuple[float, float]:
        """(bytes factor, repeat) for a collective on ``ranks`` (a point-to-point pair is dim ``pp``)."""
        dim = "pp" if p2p and tuple(ranks) not in self.group_dims else self.dim_of(ranks)
        return tuple(self.comm.get(dim, (1.0, 1.0)))


def model_charge(spec, seq_len: int, micro_batch_size: int, lab_spec, lab_seq_len: int,
                 lab_micro_batch_size: int, *, dtype: str = "bf16", lab_dtype: str = "fp32",
                 group_dims: Mapping[tuple, str] | None = None, default_dim: str = "dp") -> Charge:
    """The :class:`Charge` that makes a run of the lab's model ``lab_spec`` cost what ``spec`` would.

    With F(m, s) = :func:`labkit.theory.spec.flops_per_token` (PaLM App. B), b/s/h the micro-batch size,
    sequence length and hidden size, e the bytes per element of ``dtype`` (target) and of ``lab_dtype`` (what
    the lab ran), N = ``n_params()`` and L = ``n_layers``:

    * compute FLOPs x ``F(spec, s) b s / (F(lab, s_l) b_l s_l)`` (one factor: the lab model's mix of matmul,
      attention and elementwise work is kept, not the preset's), charged at ``dtype``'s peak;
    * compute bytes x ``(b s h e) / (b_l s_l h_l e_l)`` (memory-bound operations scale with the activations);
    * data-parallel collectives (dims :data:`PARAM_DIMS`): bytes x ``(N e) / (N_l e_l)``, once;
    * activation collectives (tp, sp, ep, pp): bytes x ``(b s h e) / (b_l s_l h_l e_l)``; cp: with the kv size
      instead of h; tp, sp, cp and ep run once per layer, so each is charged ``L / L_l`` times (pp once);
    * ``time.sleep`` stand-ins and ``kernel_overhead_s`` are never scaled.

    ``group_dims`` maps each group (sorted tuple of global ranks) to its mesh dim; others are ``default_dim``.
    Raises ValueError for a bad size, an unknown dtype, or a seq_len beyond a model's ``max_seq_len``.
    """
    from labkit.checks import check_choice, positive_int
    from labkit.theory.spec import flops_per_token

    b, bl = positive_int("micro_batch_size", micro_batch_size), positive_int("lab_micro_batch_size",
                                                                             lab_micro_batch_size)
    s = spec.check_seq_len(seq_len, "seq_len")
    sl = lab_spec.check_seq_len(lab_seq_len, "lab_seq_len")
    check_choice("dtype", dtype, DTYPE_BYTES)
    check_choice("lab_dtype", lab_dtype, DTYPE_BYTES)
    e, el = DTYPE_BYTES[dtype], DTYPE_BYTES[lab_dtype]
    f_flops = flops_per_token(spec, s) * b * s / (flops_per_token(lab_spec, sl) * bl * sl)
    f_act = (b * s * spec.hidden_size * e) / (bl * sl * lab_spec.hidden_size * el)
    f_kv = (b * s * spec.kv_size * e) / (bl * sl * lab_spec.kv_size * el)
    f_par = (spec.n_params() * e) / (lab_spec.n_params() * el)
    layers = spec.n_layers / lab_spec.n_layers
    comm = {d: (f_par, 1.0) for d in PARAM_DIMS}
    comm.update({"tp": (f_act, layers), "sp": (f_act, layers), "ep": (f_act, layers), "cp": (f_kv, layers),
                 "pp": (f_act, 1.0)})
    details = {"model": spec.name, "seq_len": s, "micro_batch_size": b, "dtype": dtype,
               "lab_model": lab_spec.name, "lab_seq_len": sl, "lab_micro_batch_size": bl, "lab_dtype": lab_dtype,
               "flops_factor": f_flops, "bytes_factor": f_act, "param_bytes_factor": f_par,
               "activation_bytes_factor": f_act, "kv_bytes_factor": f_kv, "layer_repeat": layers}
    return Charge(f"as {spec.name}", f_flops, f_act, dtype, comm, default_dim, dict(group_dims or {}), details)


# ------------------------------------------------------------------------------------------------------
# the replay
# ------------------------------------------------------------------------------------------------------
class _Inst:
    """One collective or p2p instance: who has posted it, and when it runs once everyone has."""

    __slots__ = ("key", "op", "ranks", "nbytes", "posted", "start", "end", "cost", "info", "kind", "link")

    def __init__(self, key, op, ranks, kind):
        self.key, self.op, self.ranks, self.kind = key, op, ranks, kind
        self.nbytes = 0
        self.posted: dict[int, int] = {}
        self.start = self.end = None
        self.cost = 0
        self.info: dict = {}
        self.link = "-"


@dataclass
class ReplayResult:
    """What :func:`replay` returns (all times virtual ns from the run's start, integers).

    Attributes:
        end_ns: per rank, its clock after its last event.
        compute_ns: per rank, the compute it was charged (sum of operation and sleep costs).
        comm: one dict per collective / transfer per member rank: ``rank, name, op, start_ns, end_ns, nbytes``
            (S as recorded), ``charged_nbytes`` (S after scaling), ``link``, ``group`` (global ranks), ``dim``,
            ``async_op``, plus the event's tags.
        waits: per rank, the virtual ns its clock was held by blocking calls and waits (exposed communication
            and synchronisation).
        points: per rank, (real ns, virtual ns) breakpoints for :func:`retime`.
        segments: per rank, (virtual start, end) of every charged compute item (operations and sleeps), merged
            where contiguous.
    """

    end_ns: list[int]
    compute_ns: list[int]
    comm: list[dict]
    waits: list[int]
    points: list[list[tuple[int, int]]]
    segments: list[list[tuple[int, int]]]

    @property
    def makespan_ns(self) -> int:
        return max(self.end_ns) if self.end_ns else 0


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _op_cost_ns(cluster: Cluster, charge: Charge, flops: float, nbytes: float, dtype: str) -> int:
    d = charge.dtype if (charge.dtype and TORCH_DTYPES.get(dtype, dtype) in ("fp32", "bf16", "fp16", "fp64")) \
        else dtype
    return _ns(cluster.compute_s(flops * charge.flops_factor, nbytes * charge.bytes_factor, d))


def replay(traces: Sequence[Sequence[tuple]], cluster: Cluster, charge: Charge | None = None) -> ReplayResult:
    """Re-time every rank's trace (module docstring: format and rules) on ``cluster``, charged by ``charge``.

    Args:
        traces: one event list per rank, rank order (``traces[r]`` is rank r's).
        cluster: the profile; the world size must fit it (:meth:`~labkit.theory.cluster.Cluster.check_world_size`).
        charge: scaling (:class:`Charge`, :func:`model_charge`); default: as recorded.

    Returns :class:`ReplayResult`. Raises :class:`ReplayError` (a ValueError) for a trace that deadlocks, a
    collective whose members disagree on the op, a receive from any source, or a wait on an unknown event.
    """
    charge = charge or Charge()
    n = len(traces)
    cluster.check_world_size(max(1, n))
    clock = [0] * n
    idx = [0] * n
    comp = [0] * n
    waited = [0] * n
    points: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    segs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    coll_seq: list[dict] = [{} for _ in range(n)]
    p2p_seq: list[dict] = [{} for _ in range(n)]
    by_uid: list[dict] = [{} for _ in range(n)]
    pending: list = [None] * n  # the instance a rank is blocked on (its current event already posted)
    insts: dict = {}
    stream_free: dict = {}
    rows: list[dict] = []

    def resolve(inst: _Inst) -> None:
        if inst.kind == "coll":
            free = max(stream_free.get((m, inst.ranks), 0) for m in inst.ranks)
            inst.start = max(max(inst.posted.values()), free)
            fb, rep = charge.comm_factor(inst.ranks)
            cost = cluster.collective_s(inst.op, 0 if inst.op == "barrier" else inst.nbytes * fb, inst.ranks)
            inst.cost = _ns(cost * rep)
            inst.end = inst.start + inst.cost
            for m in inst.ranks:
                stream_free[(m, inst.ranks)] = inst.end
        else:
            src, dst = inst.ranks
            inst.start = max(inst.posted.values())
            fb, rep = charge.comm_factor(inst.ranks, p2p=True)
            inst.cost = _ns(cluster.p2p_s(src, dst, inst.nbytes * fb) * rep)
            inst.end = inst.start + inst.cost
        members = sorted(set(inst.ranks))
        inst.link = cluster.link_of(inst.ranks) if len(set(inst.ranks)) > 1 else "-"
        dim = "pp" if inst.kind == "p2p" and tuple(inst.ranks) not in charge.group_dims else charge.dim_of(inst.ranks)
        for m in members:
            info = inst.info.get(m, {})
            name = inst.op if inst.kind == "coll" else ("send" if m == inst.ranks[0] else "recv")
            rows.append({"rank": m, "name": info.get("name") or name, "op": inst.op, "start_ns": inst.start,
                         "end_ns": inst.end, "nbytes": inst.nbytes, "charged_nbytes": inst.nbytes * fb,
                         "link": inst.link, "group": tuple(inst.ranks), "dim": dim,
                         "async_op": bool(info.get("async_op", False)),
                         **{k: v for k, v in info.items() if k not in ("name", "async_op")}})

    def post(r: int, ev: tuple) -> _Inst:
        kind = ev[0]
        if kind == "coll":
            _, _t0, _t1, uid, op, ranks, nbytes, is_async, info = ev
            ranks = tuple(ranks)
            if r not in ranks:
                raise ReplayError(f"rank {r} issued {op} on group {list(ranks)} it is not a member of")
            k = coll_seq[r].get(ranks, 0)
            coll_seq[r][ranks] = k + 1
            key = ("coll", ranks, k)
            inst = insts.get(key)
            if inst is None:
                inst = insts[key] = _Inst(key, op, ranks, "coll")
            elif inst.op != op:
                other = next(iter(inst.posted))
                raise ReplayError(f"collective #{k} on group {list(ranks)}: rank {other} issued {inst.op} but "
                                  f"rank {r} issued {op}; the ranks disagree on the sequence of collectives")
            inst.nbytes = max(inst.nbytes, int(nbytes))
        else:
            _, _t0, _t1, uid, direction, peer, tag, nbytes, is_async, info = ev
            if peer is None or peer < 0:
                raise ReplayError(f"rank {r}: a {direction} from any source (src=None) cannot be emulated: the "
                                  "matching send depends on real timing; name the source rank")
            src, dst = (r, int(peer)) if direction == "send" else (int(peer), r)
            sk = (src, dst, tag)
            k = p2p_seq[r].get((direction, sk), 0)
            p2p_seq[r][(direction, sk)] = k + 1
            key = ("p2p", sk, k)
            inst = insts.get(key)
            if inst is None:
                inst = insts[key] = _Inst(key, "send_recv", (src, dst), "p2p")
            inst.nbytes = max(inst.nbytes, int(nbytes))
        inst.posted[r] = clock[r]
        inst.info[r] = dict(info or {}, async_op=bool(is_async))
        by_uid[r][uid] = inst
        need = set(inst.ranks)
        if set(inst.posted) >= need and inst.end is None:
            resolve(inst)
        return inst

    def advance(r: int) -> bool:
        moved = False
        ev_list = traces[r]
        while idx[r] < len(ev_list):
            ev = ev_list[idx[r]]
            kind = ev[0]
            if kind == "c":
                _, t0, t1, flops, nbytes, dtype = ev
                d = _op_cost_ns(cluster, charge, flops, nbytes, dtype)
                _charge_compute(r, t0, t1, d)
            elif kind == "s":
                _, t0, t1, sec = ev
                _charge_compute(r, t0, t1, _ns(sec))
            elif kind in ("coll", "p2p"):
                is_async = ev[7] if kind == "coll" else ev[8]
                inst = pending[r]
                if inst is None:
                    points[r].append((ev[1], clock[r]))
                    inst = post(r, ev)
                    moved = True
                if not is_async:
                    if inst.end is None:
                        pending[r] = inst
                        return moved
                    before = clock[r]
                    clock[r] = max(clock[r], inst.end)
                    waited[r] += clock[r] - before
                pending[r] = None
                points[r].append((ev[2], clock[r]))
            elif kind == "wait":
                _, t0, t1, uid = ev
                inst = by_uid[r].get(uid)
                if inst is None:
                    raise ReplayError(f"rank {r} waits on event {uid}, which it never issued")
                if inst.end is None:
                    pending[r] = inst
                    return moved
                pending[r] = None
                points[r].append((t0, clock[r]))
                before = clock[r]
                clock[r] = max(clock[r], inst.end)
                waited[r] += clock[r] - before
                points[r].append((t1, clock[r]))
            else:
                raise ReplayError(f"rank {r}: unknown trace event {kind!r}")
            idx[r] += 1
            moved = True
        return moved

    def _charge_compute(r: int, t0: int, t1: int, d: int) -> None:
        points[r].append((t0, clock[r]))
        if d:
            s = clock[r]
            clock[r] += d
            comp[r] += d
            if segs[r] and segs[r][-1][1] == s:
                segs[r][-1] = (segs[r][-1][0], clock[r])
            else:
                segs[r].append((s, clock[r]))
        points[r].append((max(t1, t0), clock[r]))

    while True:
        progressed = False
        for r in range(n):
            if advance(r):
                progressed = True
        if all(idx[r] >= len(traces[r]) for r in range(n)):
            break
        if not progressed:
            raise ReplayError(_deadlock(traces, idx, pending))
    for pts in points:  # real times are monotonic in program order; clamp any clock jitter
        for i in range(1, len(pts)):
            if pts[i][0] < pts[i - 1][0]:
                pts[i] = (pts[i - 1][0], pts[i][1])
    rows.sort(key=lambda x: (x["start_ns"], x["rank"]))
    return ReplayResult(end_ns=list(clock), compute_ns=comp, comm=rows, waits=waited, points=points, segments=segs)


def _deadlock(traces, idx, pending) -> str:
    parts = []
    for r, ev_list in enumerate(traces):
        if idx[r] >= len(ev_list):
            continue
        inst = pending[r]
        if inst is None:
            continue
        missing = sorted(set(inst.ranks) - set(inst.posted))
        what = (f"{inst.op} on group {list(inst.ranks)}" if inst.kind == "coll"
                else f"the transfer {inst.ranks[0]} -> {inst.ranks[1]} (tag {inst.key[1][2]})")
        parts.append(f"rank {r} waits for {what}, which rank(s) {', '.join(map(str, missing))} never issue")
    done = [r for r in range(len(traces)) if idx[r] >= len(traces[r])]
    tail = f"; rank(s) {', '.join(map(str, done))} had finished" if done else ""
    return ("the trace cannot be replayed: it deadlocks (the real run would have hung): "
            + "; ".join(parts) + tail)


def retime(points: Sequence[tuple[int, int]], real_ns: int) -> int:
    """The virtual ns of real timestamp ``real_ns`` on a rank with breakpoints ``points``
    (:attr:`ReplayResult.points`): linear between two breakpoints whose virtual times differ (inside a
    compute operation, a blocking call or a wait), flat where they are equal; before the first breakpoint 0,
    after the last the last virtual time."""
    if not points:
        return 0
    i = bisect.bisect_right(points, (real_ns, float("inf"))) - 1
    if i < 0:
        return points[0][1] if real_ns >= points[0][0] else 0
    r0, v0 = points[i]
    if i + 1 >= len(points):
        return v0
    r1, v1 = points[i + 1]
    if v1 == v0 or r1 <= r0:
        return v0
    return v0 + int(round((real_ns - r0) * (v1 - v0) / (r1 - r0)))


def check_charge_factor(name: str, value) -> float:
    """A scaling factor > 0 (ValueError naming it otherwise)."""
    return positive_float(name, value)
