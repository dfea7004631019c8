"""The pipeline-stage split: how many layers each pipeline rank holds (even, Megatron's first/last-stage
options, or a split derived for a layer count pp does not divide), which layers those are (with interleaved
model chunks), and how many micro-batches' activations each rank keeps in flight under each schedule.
Pure Python.

The training budget and the parameter placement (:func:`labkit.theory.memory.params.local_param_tensors`)
take their layers per pipeline rank from :func:`stage_layers`, so every stage split goes through here.

Splits
------
A split is one layer count per pipeline rank (``layers_per_stage``, e.g. ``(7, 8, ..., 8, 7)``), summing to
``n_layers``, each at least ``vpp`` (every model chunk holds a layer). Published runs put fewer layers on the
first and last stages, which also hold the embedding and the output layer: Llama 3 405B, 126 layers on 16
stages, "we remove one Transformer layer each from the first and the last stages" (Llama Team 2024, "The
Llama 3 Herd of Models", Sec. 3.3.2) -> 7 + 14·8 + 7; BLOOM-176B, 70 layers on 12 stages, DeepSpeed's
``partition_method="type:transformer|embedding"`` counting the two embeddings as layers -> 5 + 10·6 + 5.
Megatron-LM takes the same choice as ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` (the middle stages split the rest evenly) or derives it with
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` (the embedding and
the loss each count as one layer). :func:`split_layers` derives a split the same way.
"""

from __future__ import annotations

import functools

from labkit.checks import check_choice, positive_int
from labkit.theory.memory.conventions import MAX_DEGREE, MAX_LAYERS, SCHEDULES


def _check_split_args(n_layers, pp, vpp) -> tuple[int, int, int]:
    n_layers = positive_int("n_layers", n_layers)
    pp, vpp = positive_int("pp", pp), positive_int("vpp", vpp)
    if n_layers > MAX_LAYERS:
        raise ValueError(f"n_layers={n_layers} is beyond the {MAX_LAYERS} layers the calculator handles")
    if pp > MAX_DEGREE or vpp > MAX_DEGREE:
        raise ValueError(f"pp={pp}, vpp={vpp}: a degree must be at most {MAX_DEGREE}")
    if pp * vpp > n_layers:
        raise ValueError(f"pp*vpp={pp * vpp} (pp={pp} stages x vpp={vpp} chunks) exceeds n_layers={n_layers}: every "
                         f"model chunk needs at least one layer; use pp*vpp <= {n_layers}")
    return n_layers, pp, vpp


def split_layers(n_layers: int, pp: int, vpp: int = 1, *, first: int | None = None,
                 last: int | None = None) -> tuple[int, ...]:
    """Layers per pipeline rank (a tuple of ``pp`` counts summing to ``n_layers``).

    * ``first`` / ``last`` given (Megatron-LM's ``--decoder-first/last-pipeline-num-layers``): those on the
      first / last stage, the other stages split the rest evenly (ValueError naming the fix when they cannot).
    * neither given, pp divides n_layers: the even split (Narayanan et al. 2021, Sec. 2.2).
    * otherwise: the embedding and the loss count as one layer each (Megatron-LM's
      ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``), the
      n_layers + 2 units split as evenly as possible, the spare units on the middle stages from the last one
      backwards (later stages hold fewer micro-batches in flight, :func:`in_flight_microbatches`), then the
      last and the first stage, then one layer less on the first and on the last stage. This gives Llama 3
      405B's 7 + 14·8 + 7 and BLOOM's 5 + 10·6 + 5 (module docstring). When that would leave a stage fewer
      than vpp layers, the even split with the spare layers on the last stages instead.

    Raises ValueError when pp·vpp > n_layers, a stage would hold fewer than vpp layers, or first/last do not
    fit.
    """
    n_layers, pp, vpp = _check_split_args(n_layers, pp, vpp)
    if first is not None or last is not None:
        return _split_with_edges(n_layers, pp, vpp, first, last)
    return _derived_split(n_layers, pp, vpp)


@functools.lru_cache(maxsize=4096)
def _derived_split(n_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    if n_layers % pp == 0 or pp <= 2:
        q, r = divmod(n_layers, pp)
        split = [q] * pp
        for k in range(r):  # pp = 2 only: the spare layer on the last stage (fewer micro-batches in flight)
            split[pp - 1 - k] += 1
        return _checked(split, n_layers, vpp)
    q, r = divmod(n_layers + 2, pp)
    units = [q] * pp
    middle = list(range(pp - 2, 0, -1))
    for k in (middle + [pp - 1, 0])[:r]:
        units[k] += 1
    units[0] -= 1
    units[-1] -= 1
    if min(units) < vpp:  # too few layers for the edge trick: spread them evenly instead
        q, r = divmod(n_layers, pp)
        units = [q] * pp
        for k in range(r):
            units[pp - 1 - k] += 1
    return _checked(units, n_layers, vpp)


def _split_with_edges(n_layers, pp, vpp, first, last) -> tuple[int, ...]:
    fixed = {}
    if first is not None:
        fixed[0] = positive_int("first_stage_layers", first)
    if last is not None:
        if pp == 1 and first is not None:
            raise ValueError("pp=1 has a single stage: give first_stage_layers or last_stage_layers, not both")
        fixed[pp - 1] = positive_int("last_stage_layers", last)
    rest_stages = [k for k in range(pp) if k not in fixed]
    rest = n_layers - sum(fixed.values())
    if not rest_stages:
        if rest:
            raise ValueError(f"first/last stage layers {tuple(fixed.values())} sum to {n_layers - rest}, not "
                             f"n_layers={n_layers}")
        return _checked([fixed[k] for k in range(pp)], n_layers, vpp)
    if rest < len(rest_stages) or rest % len(rest_stages):
        lo = max(0, rest) // len(rest_stages) * len(rest_stages)
        raise ValueError(f"with first/last stage layers {dict(sorted(fixed.items()))} the other {len(rest_stages)} "
                         f"stages hold {rest} layers, which they cannot split evenly (Megatron-LM's rule); change "
                         f"first/last so that they hold a multiple of {len(rest_stages)} (e.g. "
                         f"{lo or len(rest_stages)}), or give every stage's count (layers_per_stage)")
    per = rest // len(rest_stages)
    return _checked([fixed.get(k, per) for k in range(pp)], n_layers, vpp)


def _checked(split, n_layers, vpp) -> tuple[int, ...]:
    split = tuple(split)
    if min(split) < vpp:
        raise ValueError(f"stage split {_short(split)} puts {min(split)} layer(s) on a stage, fewer than vpp={vpp} "
                         "model chunks; every chunk needs a layer")
    assert sum(split) == n_layers
    return split


def _short(split) -> str:
    """A split as text, runs compressed: (7, 8, 8, 8, 7) -> '7,8x3,7'."""
    out, i = [], 0
    while i < len(split):
        j = i
        while j + 1 < len(split) and split[j + 1] == split[i]:
            j += 1
        out.append(f"{split[i]}x{j - i + 1}" if j > i else str(split[i]))
        i = j + 1
    return ",".join(out)


def format_split(split) -> str:
    """A stage split as short text, runs compressed: ``(7, 8, 8, 8, 7)`` -> ``"7,8x3,7"``."""
    return _short(tuple(split))


def check_split(layers_per_stage, n_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """``layers_per_stage`` as a tuple if it has ``pp`` counts, each >= vpp, summing to ``n_layers``; else
    ValueError naming what is wrong (bounded: it never lists divisors)."""
    n_layers, pp, vpp = _check_split_args(n_layers, pp, vpp)
    try:
        split = tuple(layers_per_stage)
    except TypeError:
        raise ValueError(f"layers_per_stage={layers_per_stage!r} must be a sequence of layer counts, one per "
                         "pipeline stage") from None
    if len(split) != pp:
        raise ValueError(f"layers_per_stage has {len(split)} entries but pp={pp}: give one layer count per pipeline "
                         "stage")
    split = tuple(positive_int(f"layers_per_stage[{i}]", c) for i, c in enumerate(split))
    if sum(split) != n_layers:
        raise ValueError(f"layers_per_stage={_short(split)} sums to {sum(split)}, not n_layers={n_layers}")
    return _checked(split, n_layers, vpp)


def resolve_split(n_layers: int, pp: int, vpp: int = 1, layers_per_stage=None) -> tuple[int, ...]:
    """The split in use: ``layers_per_stage`` checked (:func:`check_split`) or the derived one
    (:func:`split_layers`)."""
    if layers_per_stage is None:
        return split_layers(n_layers, pp, vpp)
    if isinstance(layers_per_stage, tuple) and all(type(c) is int for c in layers_per_stage):
        return _checked_split(layers_per_stage, n_layers, pp, vpp)
    return check_split(layers_per_stage, n_layers, pp, vpp)


@functools.lru_cache(maxsize=4096)
def _checked_split(split: tuple[int, ...], n_layers, pp, vpp) -> tuple[int, ...]:
    return check_split(split, n_layers, pp, vpp)


def chunk_split(layers_per_stage, vpp: int = 1) -> tuple[int, ...]:
    """Layers per global stage (pp·vpp model chunks, in model order: chunk c of rank i is global stage
    c·pp + i; Narayanan et al. 2021, Sec. 2.2.2): rank i's layers split into vpp chunks as evenly as possible,
    the earlier chunks one layer larger. This is the ``layers_per_stage`` (one count per global stage) the
    pipeline runner and simulator take."""
    split = tuple(layers_per_stage)
    vpp = positive_int("vpp", vpp)
    per = [[n // vpp + (1 if c < n % vpp else 0) for c in range(vpp)] for n in split]
    return tuple(per[i][c] for c in range(vpp) for i in range(len(split)))


@functools.lru_cache(maxsize=4096)
def _stage_layer_ids(split: tuple[int, ...], vpp: int) -> tuple[tuple[int, ...], ...]:
    pp = len(split)
    chunks = chunk_split(split, vpp)
    starts, s = [], 0
    for n in chunks:
        starts.append(s)
        s += n
    return tuple(tuple(j for c in range(vpp)
                       for j in range(starts[c * pp + i], starts[c * pp + i] + chunks[c * pp + i]))
                 for i in range(pp))


def stage_layers(n_layers: int, pp: int, vpp: int, stage: int, layers_per_stage=None) -> list[int]:
    """Layers held by pipeline rank ``stage``, for the split ``layers_per_stage`` (None: :func:`split_layers`).
    With vpp model chunks per rank, chunk c of rank i is the (c·pp + i)-th block of consecutive layers
    (Narayanan et al. 2021, Sec. 2.2.2), each rank's layers split into vpp chunks by :func:`chunk_split`; for an
    even split that is blocks of n_layers/(pp·vpp). Raises ValueError for a bad split or 0 <= stage < pp
    failing."""
    split = resolve_split(n_layers, pp, vpp, layers_per_stage)
    if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage < len(split)):
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{len(split) - 1}")
    return list(_stage_layer_ids(split, vpp)[stage])


def _in_flight(schedule: str, pp: int, m: int, vpp: int, stage: int) -> float:
    """:func:`in_flight_microbatches` without the argument checks (the callers pass checked values)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zb-h1"):
        return float(min(m, pp - stage))
    return float(min(m, (2 * (pp - stage - 1) + (vpp - 1) * pp + 1) / vpp))


@functools.lru_cache(maxsize=1024)


def in_flight_microbatches(schedule: str, pp: int, n_microbatches: int, vpp: int = 1, stage: int = 0) -> float:
    """How many micro-batches' activations pipeline rank ``stage`` holds at its peak, in units of its whole
    share of layers.

    * pp = 1: 1 (gradient accumulation runs each micro-batch's forward and backward in turn);
    * GPipe (Huang et al. 2019): all m;
    * 1F1B (Narayanan et al. 2021, PipeDream-Flush): min(m, pp - stage);
    * ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1): as 1F1B — the schedule is built
      to keep 1F1B's peak (min(m, pp - stage) forwards before the first backward);
    * interleaved with v chunks (Megatron-LM's warm-up of 2(pp - stage - 1) + (v - 1)·pp chunks, plus one):
      min(m, (2(pp - stage - 1) + (v - 1)·pp + 1)/v); on stage 0 this is pp·(1 + (pp - 1)/(pp·v)),
      Korthikanti et al. 2022, Sec. 4.2.3.

    Non-increasing in ``stage`` for every schedule (the planner's peak-stage shortcut relies on it).
    """
    check_choice("schedule", schedule, SCHEDULES)
    pp, m, vpp = positive_int("pp", pp), positive_int("n_microbatches", n_microbatches), positive_int("vpp", vpp)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in 0..{pp - 1}")
    return _in_flight(schedule, pp, m, vpp, stage)
