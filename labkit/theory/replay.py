"""Replay a recorded run on a cluster profile: the pure, deterministic half of the emulator.

Pure Python (no torch, no pandas). :mod:`labkit.runtime.emulate` records, inside every rank, the program's
own sequence of events (compute operations with their FLOPs and bytes, ``time.sleep`` stand-ins, collectives
with their group and size, point-to-point sends and receives, and the places the program waits for
asynchronous work). :func:`replay` re-times that trace on a :class:`~labkit.theory.cluster.Cluster`, so the
same trace can be priced on any profile without running it again, and the result depends on nothing but the
trace and the profile (integer nanoseconds: the same trace gives the same timeline to the nanosecond).

Trace format (one list per rank, in program order; times are the rank's real clock, ns):

* ``("c", t0, t1, flops, nbytes, dtype[, kind, shape])`` — one compute operation; ``kind`` one of ``gemm``
  (``shape`` = (batch, m, n, k)), ``attention`` (``shape`` = (batch, heads, q_len, kv_len, head_dim, causal)),
  ``memory`` or ``other`` (no shape); six-field events (older traces) are priced by the roofline;
* ``("u", t0, t1, name)`` — an operation the tracer could not price (no FLOP formula, not memory-bound), its
  measured time; it is also in the trace as a ``c`` event charged by its bytes; ``("u", t0, t1, "host",
  cpu_ns)`` — main-thread CPU work between two traced events (outside torch: numpy, Python loops), not charged;
* ``("use", t0, t1, uid)`` — an operation read the buffer of the async event ``uid`` before any wait on it;
* ``("s", t0, t1, seconds)`` — ``time.sleep(seconds)``: charged ``seconds`` on any profile, never scaled;
* ``("coll", t0, t1, uid, op, ranks, nbytes, is_async, info)`` — a collective on the global ``ranks``
  (a sorted tuple), S = ``nbytes`` (nccl-tests convention); ``info`` a dict of tags (``name``, ``step``, ...);
* ``("p2p", t0, t1, uid, "send"|"recv", peer, tag, nbytes, is_async, info)``;
* ``("wait", t0, t1, uid)`` — the program waits for the asynchronous event ``uid`` of this rank.

Rules of the replay (each rank has a compute clock; a collective runs on its group's stream):

* compute: ``clock += cost`` (:class:`Charge` and :meth:`~labkit.theory.cluster.Cluster.compute_s`);
* compute is priced by :meth:`~labkit.theory.cluster.Cluster.kernel_s` with the event's kind and shape where
  the profile has it (the roofline ``compute_s`` otherwise, and for every operation when a :class:`Charge`
  scales FLOPs or bytes); while communication of the rank is in flight, compute is slowed by the profile's
  ``comm_compute_share`` c (the overlapped part lasts 1 / (1 - c) longer; applied against the communication
  already scheduled when the compute is charged);
* collectives: the k-th collective a rank issues on a group (the same sorted tuple of global ranks *and* the
  same process group: ``info["pg"]``, its index among the groups with those members) is the same instance on
  every member; members that disagree on the op or on S (``charge_bytes`` included; ``all_to_all`` may be
  uneven and is charged at the largest) raise :class:`ReplayError` naming ranks, op and sizes. It starts when
  the last member has issued it *and* every member's stream for that group is free (collectives on one group
  run in order), and lasts :meth:`~labkit.theory.cluster.Cluster.collective_s` for its op, S and placement —
  its latency ``collective_s(op, 0)`` plus its bandwidth time, and the bandwidth time is spent on the links
  (below). A blocking call moves the caller's clock to the end; an asynchronous one leaves it, and the
  ``wait`` moves it to ``max(clock, end)``;
* point-to-point: the k-th send from a to b with tag t matches the k-th receive at b from a with tag t (sizes
  must agree); the transfer starts when both are posted and lasts
  :meth:`~labkit.theory.cluster.Cluster.p2p_s`, its bandwidth time spent on the links;
* links are resources, per direction: every rank's egress and ingress port inside its node, and its NIC's
  egress and ingress across nodes (``nics_per_node`` NICs shared by the node's ranks). A transfer uses the
  sender's egress and the receiver's ingress; a collective every member's ports (inside a node; and their
  NICs when it spans nodes). Concurrent work on one port is served in turn (each takes the port's free time
  after its start until its bandwidth time is used): busy time is conserved, so 8 concurrent 128 MiB sends
  on one link end when one 1 GiB send would;
* async work a rank never waits for is charged when the rank's function returns (the rank's clock moves to
  its end, as the process group's teardown waits for it) and listed in :attr:`ReplayResult.never_waited`;
* a ``use`` of a buffer whose transfer or collective has not ended at the rank's clock is a dependency
  violation (:attr:`ReplayResult.violations`): the program computed on data that had not arrived;
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

    __slots__ = ("key", "op", "ranks", "nbytes", "posted", "start", "end", "cost", "info", "kind", "link", "sizes")

    def __init__(self, key, op, ranks, kind):
        self.key, self.op, self.ranks, self.kind = key, op, ranks, kind
        self.nbytes = 0
        self.posted: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.start = self.end = None
        self.cost = 0
        self.info: dict = {}
        self.link = "-"


#: a rank whose unpriced share of its measured time exceeds this is an incomplete emulation (labelled so)
INCOMPLETE_SHARE = 0.05


@dataclass
class ReplayResult:
    """What :func:`replay` returns (all times virtual ns from the run's start, integers).

    Attributes:
        end_ns: per rank, its clock after its last event (and after any async work it never waited for).
        compute_ns: per rank, the compute it was charged (sum of operation and sleep costs).
        comm: one dict per collective / transfer per member rank: ``rank, name, op, start_ns, end_ns, nbytes``
            (S as recorded), ``charged_nbytes`` (S after scaling), ``link``, ``group`` (global ranks), ``dim``,
            ``async_op``, plus the event's tags.
        waits: per rank, the virtual ns its clock was held by blocking calls and waits (exposed communication
            and synchronisation).
        points: per rank, (real ns, virtual ns) breakpoints for :func:`retime`.
        segments: per rank, (virtual start, end) of every charged compute item (operations and sleeps), merged
            where contiguous.
        never_waited: one dict per async operation a rank never waited for: ``rank, op, name, nbytes,
            start_ns, end_ns`` (charged when the rank returned).
        violations: one dict per buffer read before its transfer or collective ended (emulated): ``rank, op,
            name, used_ns, ready_ns`` (virtual).
        unpriced: one dict per piece of measured work the emulator could not price: ``rank, what``
            (``"operation"`` or ``"host"``), ``name``, ``measured_ns``.
        unpriced_share: per rank, unpriced measured ns / the rank's measured span (first to last event).
    """

    end_ns: list[int]
    compute_ns: list[int]
    comm: list[dict]
    waits: list[int]
    points: list[list[tuple[int, int]]]
    segments: list[list[tuple[int, int]]]
    never_waited: list[dict] = field(default_factory=list)
    violations: list[dict] = field(default_factory=list)
    unpriced: list[dict] = field(default_factory=list)
    unpriced_share: list[float] = field(default_factory=list)

    @property
    def makespan_ns(self) -> int:
        return max(self.end_ns) if self.end_ns else 0

    @property
    def incomplete(self) -> bool:
        """True when some rank's unpriced share exceeds :data:`INCOMPLETE_SHARE`."""
        return any(x > INCOMPLETE_SHARE for x in self.unpriced_share)


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _op_cost_ns(cluster: Cluster, charge: Charge, flops: float, nbytes: float, dtype: str, kind: str | None = None,
                shape=None) -> int:
    """Integer ns of one compute event: :meth:`Cluster.kernel_s` for a shaped ``gemm`` / ``attention`` (when
    the profile has it and the charge does not scale the work), else the roofline :meth:`Cluster.compute_s`
    of the (scaled) FLOPs and bytes."""
    d = charge.dtype if (charge.dtype and TORCH_DTYPES.get(dtype, dtype) in ("fp32", "bf16", "fp16", "fp64")) \
        else dtype
    if shape is not None and kind in ("gemm", "attention") and charge.flops_factor == 1 and \
            charge.bytes_factor == 1 and hasattr(cluster, "kernel_s"):
        return _ns(cluster.kernel_s(kind, flops=flops, nbytes=nbytes, dtype=d, shape=shape))
    return _ns(cluster.compute_s(flops * charge.flops_factor, nbytes * charge.bytes_factor, d))


class _Ports:
    """Per-direction link ports as resources: each a sorted list of disjoint busy intervals (virtual ns)."""

    def __init__(self, cluster):
        self.g = int(getattr(cluster, "gpus_per_node", 1 << 30))
        self.nics = int(getattr(cluster, "nics_per_node", 1) or 1)
        self.busy: dict = {}
        self.keys_cache: dict = {}

    def _nic(self, r: int) -> tuple:
        return r // self.g, (r % self.g) * self.nics // self.g

    def keys(self, kind: str, ranks: tuple) -> tuple:
        k = self.keys_cache.get((kind, ranks))
        if k is not None:
            return k
        g = self.g
        if kind == "p2p":
            src, dst = ranks
            k = ((("o", src), ("i", dst)) if src // g == dst // g
                 else (("no",) + self._nic(src), ("ni",) + self._nic(dst)))
        else:
            out = [(d, m) for m in ranks for d in ("o", "i")]
            if len({m // g for m in ranks}) > 1:
                nics = sorted({self._nic(m) for m in ranks})
                out += [(d,) + n for n in nics for d in ("no", "ni")]
            k = tuple(out)
        self.keys_cache[(kind, ranks)] = k
        return k

    def book(self, keys: tuple, start: int, need: int) -> int:
        """Occupy ``need`` ns of the ports' common free time from ``start``; return when it is used up."""
        if need <= 0:
            return start
        busy = self.busy
        lists = [busy.setdefault(k, []) for k in keys]
        if all(not lst or lst[-1][1] <= start for lst in lists):
            end = start + need
            for lst in lists:
                if lst and lst[-1][1] == start:
                    lst[-1] = (lst[-1][0], end)
                else:
                    lst.append((start, end))
            return end
        cand = []
        for lst in lists:
            i = max(0, bisect.bisect_left(lst, (start,)) - 1)
            cand.extend(iv for iv in lst[i:] if iv[1] > start)
        cand.sort()
        t, gaps = start, []
        for s, e in cand:
            if s > t:
                free = s - t
                if free >= need:
                    break
                gaps.append((t, s))
                need -= free
            t = max(t, e)
            if need <= 0:
                break
        end = t + need
        gaps.append((t, end))
        for lst in lists:
            for gap in gaps:
                _insert(lst, gap)
        return end


def _insert(lst: list, iv: tuple) -> None:
    """Insert the interval ``iv`` (free in ``lst``) into the sorted disjoint list, merging touching ones."""
    i = bisect.bisect_left(lst, iv)
    s, e = iv
    if i > 0 and lst[i - 1][1] == s:
        i -= 1
        s = lst[i][0]
        del lst[i]
    if i < len(lst) and lst[i][0] == e:
        e = lst[i][1]
        del lst[i]
    lst.insert(i, (s, e))


def _unpriced(traces) -> tuple[list[dict], list[float]]:
    """Per rank, what the tracer measured but could not price (its ``u`` events: operations with their
    measured time, host CPU work outside torch with its CPU time), and each rank's share of its measured span
    (first to last event)."""
    rows, shares = [], []
    for r, ev_list in enumerate(traces):
        total, first, last = 0, None, None
        for ev in ev_list:
            if len(ev) < 3 or not isinstance(ev[1], int):
                continue
            t0, t1 = ev[1], ev[2]
            if ev[0] == "u":
                host = len(ev) > 4
                ns = int(ev[4]) if host else max(0, t1 - t0)
                rows.append({"rank": r, "what": "host" if host else "operation",
                             "name": "CPU work outside torch (numpy, Python)" if host else str(ev[3]),
                             "measured_ns": ns})
                total += ns
                continue
            first = t0 if first is None else first
            last = t1 if last is None else max(last, t1)
        span = (last - first) if first is not None and last > first else 0
        shares.append(min(1.0, total / span) if span else 0.0)
    return rows, shares


def replay(traces: Sequence[Sequence[tuple]], cluster: Cluster, charge: Charge | None = None) -> ReplayResult:
    """Re-time every rank's trace (module docstring: format and rules) on ``cluster``, charged by ``charge``.

    Args:
        traces: one event list per rank, rank order (``traces[r]`` is rank r's).
        cluster: the profile; the world size must fit it (:meth:`~labkit.theory.cluster.Cluster.check_world_size`).
        charge: scaling (:class:`Charge`, :func:`model_charge`); default: as recorded.

    Returns :class:`ReplayResult`. Raises :class:`ReplayError` (a ValueError) for a trace that deadlocks, a
    collective whose members disagree on the op or its size, a send and receive of different sizes, a receive
    from any source, or a wait on an unknown event.
    """
    charge = charge or Charge()
    n = len(traces)
    cluster.check_world_size(max(1, n))
    share = float(getattr(cluster, "comm_compute_share", 0.0) or 0.0)
    clock = [0] * n
    idx = [0] * n
    comp = [0] * n
    waited = [0] * n
    done = [False] * n
    points: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    segs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    coll_seq: list[dict] = [{} for _ in range(n)]
    p2p_seq: list[dict] = [{} for _ in range(n)]
    by_uid: list[dict] = [{} for _ in range(n)]
    unwaited: list[dict] = [{} for _ in range(n)]  # async uids not yet waited, in issue order
    active: list[list] = [[] for _ in range(n)]  # (start, end) of each rank's scheduled communication
    pending: list = [None] * n  # the instance a rank is blocked on (its current event already posted)
    insts: dict = {}
    stream_free: dict = {}
    rows: list[dict] = []
    uses: list[tuple] = []
    never: list[dict] = []
    ports = _Ports(cluster)
    costs: dict = {}

    def resolve(inst: _Inst) -> None:
        start = max(inst.posted.values())
        if inst.kind == "coll":
            skey = inst.key[1]  # the stream: (members, process group)
            start = max(start, max(stream_free.get((m, skey), 0) for m in inst.ranks))
            fb, rep = charge.comm_factor(inst.ranks)
            cost = cluster.collective_s(inst.op, 0 if inst.op == "barrier" else inst.nbytes * fb, inst.ranks)
            lat = cluster.collective_s(inst.op, 0, inst.ranks) if inst.op != "barrier" else cost
        else:
            src, dst = inst.ranks
            fb, rep = charge.comm_factor(inst.ranks, p2p=True)
            cost = cluster.p2p_s(src, dst, inst.nbytes * fb)
            lat = cluster.p2p_s(src, dst, 0)
        lat_ns, cost_ns = _ns(lat * rep), _ns(cost * rep)
        lat_ns = min(lat_ns, cost_ns)
        inst.start = start
        inst.end = ports.book(ports.keys(inst.kind, inst.ranks), start + lat_ns, cost_ns - lat_ns)
        inst.cost = inst.end - inst.start
        if inst.kind == "coll":
            for m in inst.ranks:
                stream_free[(m, inst.key[1])] = inst.end
        members = sorted(set(inst.ranks))
        inst.link = cluster.link_of(inst.ranks) if len(set(inst.ranks)) > 1 else "-"
        dim = "pp" if inst.kind == "p2p" and tuple(inst.ranks) not in charge.group_dims else charge.dim_of(inst.ranks)
        for m in members:
            if share and inst.end > inst.start:
                active[m].append((inst.start, inst.end))
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
            pg = int((info or {}).get("pg", 0) or 0)
            gk = (ranks, pg)
            k = coll_seq[r].get(gk, 0)
            coll_seq[r][gk] = k + 1
            key = ("coll", gk, k)
            inst = insts.get(key)
            where = f"collective #{k} on group {list(ranks)}" + (f" (process group #{pg} of these ranks)" if pg
                                                                 else "")
            if inst is None:
                inst = insts[key] = _Inst(key, op, ranks, "coll")
            elif inst.op != op:
                other = next(iter(inst.posted))
                raise ReplayError(f"{where}: rank {other} issued {inst.op} but "
                                  f"rank {r} issued {op}; the ranks disagree on the sequence of collectives")
            elif op != "all_to_all" and inst.sizes and int(nbytes) != next(iter(inst.sizes.values())):
                other, size = next(iter(inst.sizes.items()))
                raise ReplayError(f"{where}: {op} of S = {size} B on rank {other} but S = {int(nbytes)} B on "
                                  f"rank {r}; the members of one collective must agree on its size "
                                  "(charge_bytes included)")
            inst.sizes[r] = int(nbytes)
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
            elif inst.sizes and int(nbytes) != next(iter(inst.sizes.values())):
                other, size = next(iter(inst.sizes.items()))
                raise ReplayError(f"transfer #{k} {src} -> {dst} (tag {tag}): S = {size} B on rank {other} but "
                                  f"S = {int(nbytes)} B on rank {r}; a send and its receive must agree on the size "
                                  "(charge_bytes included)")
            inst.sizes[r] = int(nbytes)
            inst.nbytes = max(inst.nbytes, int(nbytes))
        inst.posted[r] = clock[r]
        inst.info[r] = dict(info or {}, async_op=bool(is_async))
        by_uid[r][uid] = inst
        if is_async:
            unwaited[r][uid] = inst
        need = set(inst.ranks)
        if set(inst.posted) >= need and inst.end is None:
            resolve(inst)
        return inst

    def finish(r: int) -> bool:
        """The rank's function returned: charge the async work it never waited for. False while blocked."""
        for inst in unwaited[r].values():
            if inst.end is None:
                pending[r] = inst
                return False
        pending[r] = None
        before = clock[r]
        for inst in unwaited[r].values():
            info = inst.info.get(r, {})
            never.append({"rank": r, "op": inst.op, "name": info.get("name") or inst.op, "nbytes": inst.nbytes,
                          "start_ns": inst.start, "end_ns": inst.end})
            clock[r] = max(clock[r], inst.end)
        waited[r] += clock[r] - before
        unwaited[r].clear()
        done[r] = True
        return True

    def advance(r: int) -> bool:
        moved = False
        ev_list = traces[r]
        while idx[r] < len(ev_list):
            ev = ev_list[idx[r]]
            kind = ev[0]
            if kind == "c":
                ck = ev[3:]
                d = costs.get(ck)
                if d is None:
                    d = costs[ck] = _op_cost_ns(cluster, charge, ev[3], ev[4], ev[5],
                                                ev[6] if len(ev) > 6 else None, ev[7] if len(ev) > 7 else None)
                _charge_compute(r, ev[1], ev[2], d)
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
                unwaited[r].pop(uid, None)
                points[r].append((t0, clock[r]))
                before = clock[r]
                clock[r] = max(clock[r], inst.end)
                waited[r] += clock[r] - before
                points[r].append((t1, clock[r]))
            elif kind == "use":
                inst = by_uid[r].get(ev[3])
                if inst is not None:
                    uses.append((r, clock[r], inst))
            elif kind == "u":
                pass  # measured, unpriced: listed by _unpriced (its bytes are a "c" event)
            else:
                raise ReplayError(f"rank {r}: unknown trace event {kind!r}")
            idx[r] += 1
            moved = True
        if not done[r]:
            moved = finish(r) or moved
        return moved

    def _charge_compute(r: int, t0: int, t1: int, d: int) -> None:
        points[r].append((t0, clock[r]))
        if d:
            s = clock[r]
            if share and active[r]:
                live = [iv for iv in active[r] if iv[1] > s]
                active[r] = live
                over = sum(max(0, min(e, s + d) - max(b, s)) for b, e in live)
                d += int(round(over * share / (1.0 - share)))
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
            if not done[r] and advance(r):
                progressed = True
        if all(done):
            break
        if not progressed:
            raise ReplayError(_deadlock(traces, idx, pending))
    for pts in points:  # real times are monotonic in program order; clamp any clock jitter
        for i in range(1, len(pts)):
            if pts[i][0] < pts[i - 1][0]:
                pts[i] = (pts[i - 1][0], pts[i][1])
    rows.sort(key=lambda x: (x["start_ns"], x["rank"]))
    violations = []
    for r, used, inst in uses:
        if inst.end is not None and inst.end > used:
            info = inst.info.get(r, {})
            violations.append({"rank": r, "op": inst.op, "name": info.get("name") or inst.op, "used_ns": used,
                               "ready_ns": inst.end})
    unpriced, shares = _unpriced(traces)
    return ReplayResult(end_ns=list(clock), compute_ns=comp, comm=rows, waits=waited, points=points, segments=segs,
                        never_waited=never, violations=violations, unpriced=unpriced, unpriced_share=shares)


def _deadlock(traces, idx, pending) -> str:
    parts = []
    for r, ev_list in enumerate(traces):
        inst = pending[r]
        if inst is None:
            continue
        missing = sorted(set(inst.ranks) - set(inst.posted))
        what = (f"{inst.op} on group {list(inst.ranks)}" if inst.kind == "coll"
                else f"the transfer {inst.ranks[0]} -> {inst.ranks[1]} (tag {inst.key[1][2]})")
        end = " (async work it never waited for, charged when it returns)" if idx[r] >= len(ev_list) else ""
        parts.append(f"rank {r} waits for {what}{end}, which rank(s) {', '.join(map(str, missing))} never issue")
    finished = [r for r in range(len(traces)) if idx[r] >= len(traces[r]) and pending[r] is None]
    tail = f"; rank(s) {', '.join(map(str, finished))} had finished" if finished else ""
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
