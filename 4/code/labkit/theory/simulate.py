"""Pipeline schedules as plain data, a discrete-event simulator that runs them, and the bubble formulas.

Pure Python: no torch import (importing this module never imports torch, so a widget slider can call it).

One schedule definition serves two places. :func:`make_schedule` returns a :class:`Schedule` whose
``actions[rank]`` is the ordered list of compute :class:`Action` s that rank performs; :func:`simulate`
executes those lists with op costs, and :mod:`labkit.parallel.pipeline` executes *the same lists* on real
ranks (sleeping stand-ins or the model's layers), so the picture the simulator draws and the picture the
ranks record come from one definition.

Vocabulary (Narayanan et al. 2021; Qi et al. 2023):

* ``p`` ranks (pipeline-parallel size), ``m`` micro-batches per step, ``v`` virtual stages (model chunks)
  per rank. There are ``p*v`` global stages; stage ``s`` lives on rank ``s % p`` (Megatron-LM's and
  torch.distributed.pipelining's placement), so with ``v > 1`` rank r holds stages r, r+p, r+2p, ...
* Ops: ``F`` forward; ``B`` backward; ``W`` weight-gradient. In schedules with ``split_backward=False``
  (GPipe, 1F1B, interleaved) ``B`` is the *full* backward (input and weight gradients, cost ``b + w``);
  in ZB-H1 (``split_backward=True``) ``B`` computes only the input gradient (cost ``b``) and ``W`` the
  weight gradient (cost ``w``), as in Qi et al. 2023 ("T_F, T_B, T_W").
* Dependencies: F(s, j) needs F(s-1, j) (activation sent from rank (s-1)%p); B(s, j) needs F(s, j) and,
  except on the last stage, B(s+1, j) (gradient sent from rank (s+1)%p); W(s, j) needs B(s, j).
  Sends do not occupy the sender (they are asynchronous ``isend`` s in the runner); a transfer between
  two ranks adds ``p2p_s`` to the consumer's ready time.

Bubble fraction (the quantity measured from a timeline and simulated here, "fraction of total time")::

    bubble_fraction = 1 - sum_r busy_r / (p * makespan)

where busy_r is the time rank r spends in F/B/W and makespan runs from the first op's start to the last
op's end. :func:`bubble_formula` gives the closed forms in both conventions, with their sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.checks import check_choice, positive_float, positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
OPS = ("F", "B", "W")
CONVENTIONS = ("fraction", "ratio")

SOURCES = {
    "gpipe": "Huang et al. 2019, GPipe, Sec. 2.2: bubble O((K-1)/(M+K-1)) with K stages, M micro-batches",
    "1f1b": "Narayanan et al. 2021, Megatron-LM (SC21), Sec. 2.2.1: bubble time fraction (p-1)/m "
            "(PipeDream-Flush / 1F1B, same bubble as GPipe)",
    "interleaved": "Narayanan et al. 2021, Megatron-LM (SC21), Sec. 2.2.2: interleaved bubble "
                   "(p-1)/(v*m) with v model chunks per device",
    "zb-h1": "Qi et al. 2023, Zero Bubble Pipeline Parallelism, Sec. 3.1 (ZB-H1): bubble "
             "(p-1)(T_F+T_B-T_W) per rank versus 1F1B's (p-1)(T_F+T_B+T_W)",
}


class Action(NamedTuple):
    """One compute op of a schedule: ``op`` in F/B/W, ``microbatch`` in 0..m-1, global ``stage`` in
    0..p*v-1 (performed by rank ``stage % p``)."""

    op: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as plain data (picklable; shipped to ranks as is).

    Attributes:
        name: one of :data:`SCHEDULES`.
        p: ranks; m: micro-batches per step; v: virtual stages per rank.
        split_backward: True when B is the input-gradient backward only and W ops exist (ZB-H1).
        actions: ``actions[rank]`` is the tuple of :class:`Action` s rank performs, in order.
    """

    name: str
    p: int
    m: int
    v: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def n_stages(self) -> int:
        """Global (virtual) stages, ``p * v``."""
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The rank holding global stage ``stage`` (``stage % p``)."""
        return stage % self.p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Global stages held by ``rank``, in model order (``rank, rank+p, ...``)."""
        return tuple(rank + k * self.p for k in range(self.v))

    def last_backward_op(self) -> str:
        """The op after which a (stage, micro-batch) holds no activations: W when split, else B."""
        return "W" if self.split_backward else "B"

    def describe(self) -> str:
        """One line per rank, e.g. ``rank 0: 0F0 0F1 0B0 ...`` (torch's ``{stage}{op}{mb}`` notation)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, a)) for r, a in enumerate(self.actions))


# --------------------------------------------------------------------------------------------------
# schedule construction
# --------------------------------------------------------------------------------------------------
def min_microbatches(name: str, p: int) -> int:
    """The fewest micro-batches ``name`` runs with on ``p`` ranks: 1 for GPipe, ``p`` for the 1F1B family
    (whose warm-up holds up to p micro-batches in flight; torch's Schedule1F1B refuses fewer too).
    Raises ValueError for an unknown schedule."""
    check_choice("schedule", name, SCHEDULES)
    return 1 if name == "gpipe" else p


def check_schedule_args(name: str, p: int, m: int, v: int = 1) -> tuple[str, int, int, int]:
    """Validate a schedule request; returns ``(name, p, m, v)``. Raises ValueError naming the fix:
    unknown schedule, p < 2 (a pipeline needs two ranks), v != 1 for a single-chunk schedule, v < 2 for
    interleaved, m below :func:`min_microbatches`, or interleaved m not a multiple of p."""
    check_choice("schedule", name, SCHEDULES)
    p = positive_int("pp", p)
    m = positive_int("n_microbatches", m)
    v = positive_int("v", v)
    if p < 2:
        raise ValueError(f"pp={p}: a pipeline schedule needs at least 2 ranks; use pp >= 2 "
                         "(or train without a pipeline schedule when pp=1)")
    if name == "interleaved":
        if v < 2:
            raise ValueError(f"v={v}: the interleaved schedule needs v >= 2 virtual stages per rank "
                             "(v=1 is plain '1f1b')")
    elif v != 1:
        raise ValueError(f"v={v}: schedule={name!r} runs one stage per rank; use v=1, or "
                         "schedule='interleaved' for v > 1")
    need = min_microbatches(name, p)
    if m < need:
        raise ValueError(f"n_microbatches={m} is fewer than schedule={name!r} needs on pp={p} ranks: use "
                         f"n_microbatches >= {need} (with fewer, a 1F1B warm-up waits for micro-batches "
                         "that never come)")
    if name == "interleaved" and m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        ok = f"{lo} or {hi}" if lo >= p else f"{hi}"
        raise ValueError(f"n_microbatches={m} is not a multiple of pp={p}, which the interleaved schedule "
                         f"needs (Narayanan et al. 2021); use n_microbatches={ok}")
    return name, p, m, v


def _gpipe(p: int, m: int) -> list[list[Action]]:
    # all forwards, then all backwards in micro-batch order (torch's ScheduleGPipe order)
    return [[Action("F", j, r) for j in range(m)] + [Action("B", j, r) for j in range(m)] for r in range(p)]


def _one_f_one_b(p: int, m: int) -> list[list[Action]]:
    # PipeDream-Flush (Narayanan et al. 2021, Fig. 4 top): rank r runs p-1-r warm-up forwards, then
    # alternates one forward and one backward, then drains the remaining backwards.
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action("F", j, r) for j in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", j, r) for j in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron-LM interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2 and Fig. 4 bottom): forwards walk
    # the rank's chunks in groups of p micro-batches, backwards walk them in reverse chunk order;
    # warm-up = 2(p-1-r) + (v-1)p forwards.
    total = m * v

    def fwd(k: int) -> Action:
        chunk = (k // p) % v
        return Action("F", (k // (p * v)) * p + k % p, chunk * p + r)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action("B", (k // (p * v)) * p + k % p, chunk * p + r)

    out = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            acts += [fwd(warm + i), bwd(i)]
        acts += [bwd(k) for k in range(total - warm, total)]
        out.append(acts)
    return out


def _zb_h1(p: int, m: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al. 2023, Sec. 3.1, Fig. 3 top): 1F1B's order with B split into B (input gradient)
    # and W (weight gradient). Rank r postpones its W's by r micro-batches, so gradients travel upstream
    # without waiting for weight gradients, and the postponed W's fill the cool-down bubble. Peak
    # activation memory stays at 1F1B's (at most p micro-batches in flight).
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action("F", j, r) for j in range(warm)]
        n_b = n_w = 0
        for i in range(m):
            if i < m - warm:
                acts.append(Action("F", warm + i, r))
            acts.append(Action("B", n_b, r))
            n_b += 1
            if i >= r:
                acts.append(Action("W", n_w, r))
                n_w += 1
        acts += [Action("W", j, r) for j in range(n_w, m)]
        out.append(acts)
    return out


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build schedule ``name`` for ``p`` ranks, ``m`` micro-batches and ``v`` virtual stages per rank.

    Orders: GPipe (Huang et al. 2019): all F then all B. 1F1B / PipeDream-Flush (Narayanan et al. 2021).
    Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2; Megatron-LM's warm-up 2(p-1-r)+(v-1)p).
    ZB-H1 (Qi et al. 2023, Sec. 3.1). Each order equals torch.distributed.pipelining's for the same
    schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and ScheduleInterleavedZeroBubble
    with one stage per rank); tests/test_simulate.py checks this against the installed torch.

    Raises ValueError (see :func:`check_schedule_args`) naming the fix for bad p, m or v.
    """
    name, p, m, v = check_schedule_args(name, p, m, v)
    if name == "gpipe":
        acts = _gpipe(p, m)
    elif name == "1f1b":
        acts = _one_f_one_b(p, m)
    elif name == "interleaved":
        acts = _interleaved(p, m, v)
    else:
        acts = _zb_h1(p, m)
    return Schedule(name, p, m, v, name == "zb-h1", tuple(tuple(a) for a in acts))


def check_complete(schedule: Schedule) -> None:
    """Raise ValueError unless every (op, micro-batch, stage) appears exactly once, on the stage's rank."""
    ops = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    want = {Action(o, j, s) for o in ops for j in range(schedule.m) for s in range(schedule.n_stages)}
    seen: set[Action] = set()
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            if schedule.rank_of(a.stage) != r:
                raise ValueError(f"action {a} is on rank {r} but stage {a.stage} lives on rank "
                                 f"{schedule.rank_of(a.stage)}")
            if a in seen:
                raise ValueError(f"action {a} appears twice")
            seen.add(a)
    if seen != want:
        missing = sorted(map(str, want - seen))[:5]
        extra = sorted(map(str, seen - want))[:5]
        raise ValueError(f"schedule {schedule.name!r} is incomplete: missing {missing}, unexpected {extra}")


# --------------------------------------------------------------------------------------------------
# op costs
# --------------------------------------------------------------------------------------------------
def _per_stage(name: str, value, n_stages: int) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (positive_float(name, value, allow_zero=True),) * n_stages
    vals = tuple(value)
    if len(vals) != n_stages:
        raise ValueError(f"{name} has {len(vals)} per-stage values but the schedule has {n_stages} stages "
                         f"(p*v); give one number or {n_stages} numbers")
    return tuple(positive_float(f"{name}[{i}]", x, allow_zero=True) for i, x in enumerate(vals))


@dataclass(frozen=True)
class OpCosts:
    """Durations (seconds) of one micro-batch's ops on each global stage.

    ``f``: forward; ``b``: input-gradient backward; ``w``: weight-gradient backward (Qi et al. 2023's
    T_F, T_B, T_W). A full backward (GPipe, 1F1B, interleaved) costs ``b + w``. Each may be one number
    (every stage) or a sequence with one value per global stage (unequal stages). ``p2p_s``: latency
    added to every activation/gradient transfer between ranks.
    """

    f: float | Sequence[float] = 1.0
    b: float | Sequence[float] = 1.0
    w: float | Sequence[float] = 1.0
    p2p_s: float = 0.0

    def resolve(self, n_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage tuples ``{"F": ..., "B": ..., "W": ...}`` for ``n_stages`` stages (B = input-grad
        part only). Raises ValueError for a negative value or a sequence of the wrong length."""
        positive_float("p2p_s", self.p2p_s, allow_zero=True)
        return {"F": _per_stage("f", self.f, n_stages), "B": _per_stage("b", self.b, n_stages),
                "W": _per_stage("w", self.w, n_stages)}

    def op_seconds(self, schedule: Schedule) -> dict[Action, float]:
        """Duration of every action of ``schedule`` (a full backward gets b + w)."""
        c = self.resolve(schedule.n_stages)
        out = {}
        for acts in schedule.actions:
            for a in acts:
                if a.op == "B" and not schedule.split_backward:
                    out[a] = c["B"][a.stage] + c["W"][a.stage]
                else:
                    out[a] = c[a.op][a.stage]
        return out


# --------------------------------------------------------------------------------------------------
# simulation
# --------------------------------------------------------------------------------------------------
@dataclass
class SimResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
        schedule: the schedule simulated; costs: the :class:`OpCosts` used.
        events: one dict per op: rank, name (F/B/W), stage, microbatch, start_s, end_s (seconds from 0).
        makespan_s: first op start to last op end (seconds).
        busy_s: per rank, seconds spent in F/B/W.
        bubble_fraction: ``1 - sum(busy_s) / (p * makespan_s)`` (fraction of total time).
        peak_inflight: per rank, the most (stage, micro-batch) activation sets held at once: one is
            taken at F's start and released at the end of its last backward op (B, or W when split).
    """

    schedule: Schedule
    costs: OpCosts
    events: list[dict]
    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: float
    peak_inflight: tuple[int, ...]
    extra: dict = field(default_factory=dict)

    def timeline_rows(self, step: int = 0, origin_ns: int = 0) -> list[dict]:
        """The events as timeline rows (labkit.runtime.timeline columns; kind='compute'), so a simulated step
        draws like a measured one: ``pandas.DataFrame(result.timeline_rows())`` is a timeline frame."""
        return [{"rank": e["rank"], "name": e["name"], "kind": "compute",
                 "start_ns": origin_ns + round(e["start_s"] * 1e9), "end_ns": origin_ns + round(e["end_s"] * 1e9),
                 "step": step, "microbatch": e["microbatch"], "stage": e["stage"], "nbytes": 0}
                for e in self.events]


def simulate(schedule: Schedule, costs: OpCosts | None = None) -> SimResult:
    """Run ``schedule`` as a discrete-event simulation with ``costs`` (default: F = B = W = 1 s, no
    latency). Each rank executes its action list in order; an op starts when the rank is free and its
    inputs have arrived (dependencies in the module docstring). Returns a :class:`SimResult`.

    Raises ValueError when the action lists deadlock (an op waits for one that a rank can only reach
    after it), naming the stuck actions.
    """
    costs = OpCosts() if costs is None else costs
    dur = costs.op_seconds(schedule)
    lat = positive_float("p2p_s", costs.p2p_s, allow_zero=True)
    p, n_stages = schedule.p, schedule.n_stages
    done: dict[Action, float] = {}
    ptr = [0] * p
    free = [0.0] * p
    events: list[dict] = []
    total = sum(len(a) for a in schedule.actions)

    def ready_time(a: Action) -> float | None:
        deps: list[tuple[Action, float]] = []
        if a.op == "F":
            if a.stage > 0:
                deps.append((Action("F", a.microbatch, a.stage - 1), lat))
        elif a.op == "B":
            deps.append((Action("F", a.microbatch, a.stage), 0.0))
            if a.stage < n_stages - 1:
                deps.append((Action("B", a.microbatch, a.stage + 1), lat))
        else:
            deps.append((Action("B", a.microbatch, a.stage), 0.0))
        t = 0.0
        for d, extra in deps:
            if d not in done:
                return None
            cross = schedule.rank_of(d.stage) != schedule.rank_of(a.stage)
            t = max(t, done[d] + (extra if cross else 0.0))
        return t

    while len(done) < total:
        progressed = False
        for r in range(p):
            while ptr[r] < len(schedule.actions[r]):
                a = schedule.actions[r][ptr[r]]
                t = ready_time(a)
                if t is None:
                    break
                start = max(free[r], t)
                end = start + dur[a]
                done[a] = end
                free[r] = end
                events.append({"rank": r, "name": a.op, "stage": a.stage, "microbatch": a.microbatch,
                               "start_s": start, "end_s": end})
                ptr[r] += 1
                progressed = True
        if not progressed:
            stuck = [str(schedule.actions[r][ptr[r]]) for r in range(p) if ptr[r] < len(schedule.actions[r])]
            raise ValueError(f"schedule {schedule.name!r} deadlocks: ranks wait on {', '.join(stuck)}, whose "
                             "inputs come from ops later in another rank's list")

    t0 = min(e["start_s"] for e in events)
    makespan = max(e["end_s"] for e in events) - t0
    busy = tuple(sum(e["end_s"] - e["start_s"] for e in events if e["rank"] == r) for r in range(p))
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return SimResult(schedule, costs, sorted(events, key=lambda e: (e["start_s"], e["rank"])), makespan, busy,
                     bubble, peak_inflight(schedule))


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most (stage, micro-batch) activation sets alive at once when the rank runs its list
    in order: +1 at each F, -1 after each last backward op (W when split, else B). Depends on the order
    only, not on costs: GPipe reaches m * v, 1F1B at most p - r on rank r (Narayanan et al. 2021, Sec. 2.2.1)."""
    last = schedule.last_backward_op()
    out = []
    for acts in schedule.actions:
        cur = peak = 0
        for a in acts:
            if a.op == "F":
                cur += 1
                peak = max(peak, cur)
            elif a.op == last:
                cur -= 1
        out.append(peak)
    return tuple(out)


def bubble_fraction(name: str, p: int, m: int, v: int = 1, costs: OpCosts | None = None) -> float:
    """Simulated bubble fraction (fraction of total time) of schedule ``name``; shorthand for
    ``simulate(make_schedule(name, p, m, v), costs).bubble_fraction``."""
    return simulate(make_schedule(name, p, m, v), costs).bubble_fraction


# --------------------------------------------------------------------------------------------------
# closed forms
# --------------------------------------------------------------------------------------------------
def bubble_formula(name: str, p: int, m: int, v: int = 1, *, convention: str = "fraction",
                   f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The textbook bubble of schedule ``name`` for equal stages and no p2p latency.

    Conventions:

    * ``"fraction"``: bubble time / total time (``1 - busy / (p * makespan)``, what the timeline measures).
    * ``"ratio"``: bubble time / ideal compute time (Narayanan et al. 2021's "bubble time fraction").

    Formulas (``t_ideal = m (f + b + w)`` per rank, ``bubble`` = idle time per rank):

    * GPipe (Huang et al. 2019, Sec. 2.2), 1F1B (Narayanan et al. 2021, Sec. 2.2.1):
      bubble = (p-1)(f+b+w), ratio (p-1)/m, fraction (p-1)/(m+p-1).
    * Interleaved (Narayanan et al. 2021, Sec. 2.2.2): bubble = (p-1)(f+b+w)/v, ratio (p-1)/(v m),
      fraction (p-1)/(v m + p-1).
    * ZB-H1 (Qi et al. 2023, Sec. 3.1): bubble = (p-1)(f+b-w), ratio (p-1)(f+b-w) / (m (f+b+w)),
      fraction (p-1)(f+b-w) / (m (f+b+w) + (p-1)(f+b-w)). The paper draws it with T_F = T_B = T_W;
      the simulator agrees with it exactly while ``w <= min(f, b)`` and finds a larger bubble beyond
      (a long W no longer hides in the cool-down), so there the simulator is the reference.

    ``f, b, w`` only matter for ZB-H1 (the others' ratios cancel them). Raises ValueError for bad
    arguments (as :func:`check_schedule_args`) or an unknown convention.
    """
    name, p, m, v = check_schedule_args(name, p, m, v)
    check_choice("convention", convention, CONVENTIONS)
    f, b, w = (positive_float(k, x, allow_zero=True) for k, x in (("f", f), ("b", b), ("w", w)))
    t_ideal = m * (f + b + w)
    if t_ideal <= 0:
        raise ValueError("f + b + w must be > 0")
    if name in ("gpipe", "1f1b"):
        bubble = (p - 1) * (f + b + w)
    elif name == "interleaved":
        bubble = (p - 1) * (f + b + w) / v
    else:
        bubble = (p - 1) * max(0.0, f + b - w)
    return bubble / t_ideal if convention == "ratio" else bubble / (t_ideal + bubble)


def bubble_table(p: int, m: int, v: int = 2, costs: OpCosts | None = None) -> list[dict]:
    """For each schedule: formula (both conventions, with its source) beside the simulator, as rows
    (``schedule, p, m, v, formula_fraction, formula_ratio, simulated_fraction, source``) for a DataFrame.
    ``costs`` (uniform values) feed both the ZB-H1 formula and the simulator; default F = B = W = 1.
    Schedules that cannot run at (p, m, v) are skipped. Raises ValueError for bad costs."""
    costs = OpCosts() if costs is None else costs
    uniform = all(isinstance(x, (int, float)) for x in (costs.f, costs.b, costs.w))
    rows = []
    for name in SCHEDULES:
        vv = v if name == "interleaved" else 1
        try:
            check_schedule_args(name, p, m, vv)
        except ValueError:
            continue
        kw = {"f": costs.f, "b": costs.b, "w": costs.w} if uniform else {}
        rows.append({"schedule": name, "p": p, "m": m, "v": vv,
                     "formula_fraction": bubble_formula(name, p, m, vv, convention="fraction", **kw)
                     if uniform else math.nan,
                     "formula_ratio": bubble_formula(name, p, m, vv, convention="ratio", **kw)
                     if uniform else math.nan,
                     "simulated_fraction": bubble_fraction(name, p, m, vv, costs),
                     "source": SOURCES[name]})
    return rows


# --------------------------------------------------------------------------------------------------
# stage boundaries
# --------------------------------------------------------------------------------------------------
def balance_layers(layer_costs: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """Split consecutive layers into ``n_stages`` contiguous groups minimising the slowest group's cost
    (the pipeline's steady-state period). Returns layers per stage, e.g. ``(3, 2, 2, 1)``.

    ``layer_costs``: seconds per layer (measured, e.g. F+B per layer; put embedding/head cost into the
    first/last layer's value). Exact dynamic programme over split points (the linear-partition problem,
    as in PipeDream's partitioner, Narayanan et al. 2019, Sec. 3.1), O(n_stages * n_layers^2).
    Raises ValueError when there are fewer layers than stages or a cost is negative.
    """
    costs = [positive_float(f"layer_costs[{i}]", c, allow_zero=True) for i, c in enumerate(layer_costs)]
    n_stages = positive_int("n_stages", n_stages)
    n = len(costs)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot fill n_stages={n_stages}; use n_stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-cost splitting the first i layers into k groups; cut[k][i]: start of group k
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                val = max(best[k - 1][j], prefix[i] - prefix[j])
                if val < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = val, j
    sizes, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def stage_costs_from_layers(layer_costs: Sequence[float], layers_per_stage: Sequence[int]) -> tuple[float, ...]:
    """Sum ``layer_costs`` over each stage's contiguous layers. Raises ValueError when the counts do not
    add up to the number of layers."""
    if sum(layers_per_stage) != len(layer_costs):
        raise ValueError(f"layers_per_stage={tuple(layers_per_stage)} sums to {sum(layers_per_stage)}, "
                         f"not the {len(layer_costs)} layers given")
    out, i = [], 0
    for n in layers_per_stage:
        out.append(float(sum(layer_costs[i:i + n])))
        i += n
    return tuple(out)
