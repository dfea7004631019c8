"""Chapter 02 (collectives): its parameter check and the overlap verdict, a sentence written from the numbers.

What it launches is in :mod:`labkit.experiments.collectives` (the sweep) and
:mod:`labkit.experiments.collective_patterns` (AllReduce = ReduceScatter + AllGather, re-partition bytes, overlap,
and :func:`~labkit.experiments.collective_patterns.measure`, one launch for everything); sizes are checked by
:mod:`labkit.theory.collectives`, the predictions come from :mod:`labkit.theory.costmodel`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import as_emulate, check_world_size, compare_prediction  # noqa: F401 (the notebook's)
from labkit.checks import positive_int
from labkit.runtime.probes import cpu_cores
from labkit.theory.collectives import DTYPES, check_size, format_size, parse_ops, parse_size, plan, size_range

#: untimed calls before each timed size (nccl-tests' -w)
WARMUP = 2


def check_chapter(*, world_size: int, ops, min_size, max_size, factor: int, repeats: int, warmup: int = WARMUP,
                  ar_size, repartition_size, overlap_size, n_matmuls: int = 32, matmul_size: int = 256,
                  backend: str = "auto", emulate=None, emulated_world_size: int = 8, my_prediction=None) -> dict:
    """Validate chapter 02's parameters before anything is launched (the chapter's first code cell) and
    return the sizes its experiments will use.

    The sweep's range is kept as given (each size rounded down per op to one it accepts, as nccl-tests does
    with ``-b/-e``); ``ar_size``, ``repartition_size`` and ``overlap_size`` are rounded down the same way to
    the nearest size their ops accept on ``world_size`` ranks (reduce_scatter: a multiple of world_size
    elements; the re-partition: of world_size² elements), and ``notes`` says which were rounded.

    Returns ``{"ar_size": bytes, "repartition_size": bytes, "overlap_size": bytes, "sweep_sizes": {op:
    [bytes, ...]}, "notes": [str, ...]}``.

    Raises:
        ValueError: world_size < 2 (a collective needs a peer), an unknown op, a bad size or range, a range
            that gives fewer than 2 sizes for some op (the alpha-beta fit needs at least 2), factor < 2,
            warmup < 0, repeats < 1, n_matmuls or matmul_size < 1, a backend the machine cannot run
            (:func:`labkit.runtime.launcher.resolve_backend`), an ``emulate`` profile that cannot hold
            ``emulated_world_size`` ranks (or emulated_world_size < 2), or a ``my_prediction`` that is not None
            or a number — each naming the value and what would be valid.
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("02", world_size, why="a collective moves data between ranks, and with one "
                                  "rank nothing crosses a link")
    op_list = parse_ops(ops)
    sizes = size_range(min_size, max_size, factor)
    positive_int("warmup", warmup, minimum=0)
    positive_int("repeats", repeats)
    positive_int("n_matmuls", n_matmuls)
    positive_int("matmul_size", matmul_size)
    sweep_sizes = {}
    for op, nbytes, _ in plan(op_list, sizes, world_size, align=True):
        sweep_sizes.setdefault(op, []).append(nbytes)
    for op, got in sweep_sizes.items():
        if len(got) < 2:
            raise ValueError(f"min_size={min_size!r}, max_size={max_size!r}, factor={factor} give {op} only "
                             f"{len(got)} size ({got[0]} bytes on {world_size} ranks); the alpha-beta fit needs at "
                             f"least 2: raise max_size to at least {format_size(got[0] * factor)}")
    notes, out = [], {}
    for name, value, op, unit_elems in (("ar_size", ar_size, "reduce_scatter", world_size),
                                        ("repartition_size", repartition_size, "all_to_all",
                                         world_size * world_size),
                                        ("overlap_size", overlap_size, "all_reduce", 1)):
        nbytes = parse_size(value, name)
        unit = unit_elems * DTYPES["float32"]
        if nbytes < unit:
            raise ValueError(f"{name}={value!r} is smaller than one {op} unit on {world_size} ranks ({unit} "
                             f"bytes of float32); use at least {unit}")
        out[name] = nbytes // unit * unit
        if out[name] != nbytes:
            notes.append(f"{name}={value!r} ({nbytes} bytes) rounded down to {out[name]} bytes: {op} on "
                         f"{world_size} ranks needs a multiple of {unit} bytes")
    check_size("reduce_scatter", out["ar_size"], world_size)
    check_size("reduce_scatter", out["repartition_size"], world_size)
    check_size("all_to_all", out["repartition_size"] // world_size, world_size)
    resolve_backend(backend, world_size)
    from labkit.chapters.ch00_getting_started import check_emulate
    from labkit.chapters.common import check_prediction

    check_prediction(my_prediction, what="a number of GB/s (busbw of a 1 GiB all-reduce on emulated_world_size "
                                    "GPUs, e.g. 400)")
    if as_emulate(emulate) is not None:
        check_emulate(emulate, check_world_size("02", emulated_world_size, why="emulated_world_size: a collective "
                                                "needs a peer"))
    return {**out, "sweep_sizes": sweep_sizes, "notes": notes}


#: hidden_fraction an overlapped run must reach when its compute outlasts its communication and every rank
#: has a core of its own (chapter 02's check). Observed on a shared 2-core machine with 2 ranks: >= 0.9.
MIN_HIDDEN_FRACTION = 0.2

#: an oversubscribed run's verdict blames the shared cores only when the hidden fraction is below this share
#: of the predicted bound (min(1, compute / comm)); closer to the bound there is nothing to explain.
CROWDED_SHORTFALL = 0.8


def overlap_verdict(summary: pd.DataFrame, *, world_size: int, backend: str = "gloo",
                    cores: int | None = None) -> dict:
    """What an :func:`labkit.experiments.collective_patterns.overlap_summary` shows, as numbers and one sentence
    written from them.

    * ``hidden_fraction`` — measured: 1 − exposed comm (overlapped) / comm (serialised);
    * ``predicted_max_hidden_fraction`` — predicted upper bound ``min(1, compute_s / comm_s)`` from the
      serialised steps: an overlapped step can hide at most as much communication as it has compute to hide it
      behind (the ``max(compute, comm)`` model of an overlapped step, as in overlapping DDP's gradient
      all-reduce with backward: Li et al. 2020, "PyTorch Distributed", sec. 3.2.3);
    * ``compute_covers_comm`` — the serialised compute lasted at least as long as the communication, so
      overlap could hide all of it;
    * ``oversubscribed`` — gloo with more ranks than ``cores`` (default
      :func:`labkit.runtime.probes.cpu_cores`): a rank's communication thread then waits for a core while the
      matmuls run, so less can hide (the sentence says so only when the run hid less than
      :data:`CROWDED_SHORTFALL` of the bound);
    * ``required_hidden_fraction`` — what the chapter's check asks for when ``compute_covers_comm``:
      :data:`MIN_HIDDEN_FRACTION`, or just more than 0 (overlapped exposes less than serialised) when
      oversubscribed; ``hides`` — the run met it; ``checked`` — whether a chapter should assert ``hides``:
      compute covers the communication and every rank has a core (oversubscribed, a run may hide nothing);
    * ``conclusion`` — the sentence.

    Raises ValueError when the summary lacks the ``serialised`` or ``overlapped`` row, or world_size < 1."""
    world_size = positive_int("world_size", world_size)
    s = summary.set_index("mode")
    if not {"serialised", "overlapped"} <= set(s.index):
        raise ValueError(f"summary has modes {sorted(s.index)}; expected serialised and overlapped "
                         "(from overlap_summary)")
    cores = cpu_cores() if cores is None else positive_int("cores", cores)
    comp, comm = float(s.loc["serialised", "compute_s"]), float(s.loc["serialised", "comm_s"])
    hidden = float(s.loc["overlapped", "hidden_fraction"])
    bound = min(1.0, comp / comm) if comm > 0 else float("nan")
    over = backend == "gloo" and world_size > cores
    required = 0.0 if over else MIN_HIDDEN_FRACTION
    out = {"hidden_fraction": hidden, "predicted_max_hidden_fraction": bound,
           "compute_covers_comm": comp >= comm, "oversubscribed": over, "required_hidden_fraction": required,
           "hides": hidden > required if over else hidden >= required,
           # the chapter asserts ``hides`` only where physics promises it: enough compute, a core per rank
           "checked": comp >= comm and not over,
           "serialised_exposed_ms": float(s.loc["serialised", "exposed_comm_s"]) * 1e3,
           "overlapped_exposed_ms": float(s.loc["overlapped", "exposed_comm_s"]) * 1e3}
    numbers = (f"compute {comp * 1e3:.1f} ms beside an all-reduce of {comm * 1e3:.1f} ms (serialised, measured); "
               f"exposed communication {out['serialised_exposed_ms']:.1f} ms serialised vs "
               f"{out['overlapped_exposed_ms']:.1f} ms overlapped: {hidden:.0%} hidden (measured; at most "
               f"{bound:.0%} can hide, predicted)")
    if out["hides"]:
        verdict = "In this run overlap hid communication: "
    elif not out["compute_covers_comm"]:
        verdict = ("In this run overlap could not hide much, as there was less compute than communication to hide "
                   "it behind: ")
    else:
        verdict = ("In this run overlap did NOT hide the communication, although the compute was long enough: "
                   "the all-reduce's worker thread competed with the matmul for the cores: ")
    # the crowding explanation only where the run fell short: well below what could hide (the bound)
    short_of_bound = bound == bound and hidden < CROWDED_SHORTFALL * bound
    if over and short_of_bound:
        crowd = (f" {world_size} ranks share {cores} cores, so each rank's communication thread waits for a core "
                 f"while the matmuls run: the likely reason less hid than the {bound:.0%} that could.")
    elif over:
        crowd = (f" {world_size} ranks share {cores} cores, yet in this run that did not keep the overlap from "
                 "hiding close to what it could.")
    else:
        crowd = ""
    out["conclusion"] = verdict + numbers + "." + crowd
    return out


# ======================================================================================================
# The emulated sweep (a named cluster), its findings, the headline busbw figure and the cluster panel
# ======================================================================================================
#: the ops the emulated sweep runs (one launch), and its sizes: 1 KiB .. 1 GiB by 4x
EMULATED_OPS = ("all_reduce", "all_gather", "reduce_scatter")
EMULATED_SIZES = tuple(2**k for k in range(10, 31, 2))
#: an emulated busbw at or above this share of the link's peak is "bandwidth-bound"; at or below
#: :data:`LATENCY_BOUND` "latency-bound" (the alpha term dominates)
BANDWIDTH_BOUND, LATENCY_BOUND = 0.8, 0.2
#: reduce-scatter + all-gather "costs the same" as one all-reduce within this relative difference
SAME_COST = 0.1


def two_node_cluster(profile, world_size: int):
    """``profile`` (a name or Cluster) with ``world_size`` ranks split over 2 nodes (half as many GPUs and NICs
    per node), named ``"<profile>, 2 nodes x k"``; None when that cannot be (odd world_size, no inter-node link)
    or need not (``world_size`` already spans more than one node of ``profile``)."""
    from labkit.theory.cluster import get_cluster

    cl = get_cluster(profile)
    if world_size % 2 or world_size < 4 or cl.inter is None or world_size > cl.gpus_per_node:
        return None
    k = world_size // 2
    return cl.replace(gpus_per_node=k, nics_per_node=max(1, cl.nics_per_node * k // cl.gpus_per_node),
                      name=f"{cl.name}, 2 nodes x {k}")


def emulated_sweep_run(world_size: int = 8, emulate="dgx-h100", *, ops=EMULATED_OPS, sizes=EMULATED_SIZES,
                       timeout_s: float = 300.0) -> dict:
    """One emulated launch of :func:`labkit.experiments.emulate.collectives_rank` over ``ops`` x ``sizes`` on
    ``world_size`` ranks of ``emulate`` (one node), re-priced without re-running on the same GPUs split over two
    nodes (:func:`two_node_cluster`). The sizes of the :func:`published_rows` of the placement are emulated in
    the same launch, kept apart from the asked sweep. Returns ``{"emulation", "cases", "table"`` (its
    :func:`asked_table`: the asked ``ops`` x ``sizes`` only), ``"n_asked"``,
    ``"published_sizes_table"`` (with the published rows' sizes too), ``"two_nodes"`` (the re-priced table,
    or None),
    ``"label", "world_size", "findings"`` (:func:`emulated_findings`)}."""
    from labkit.experiments.emulate import collectives_rank, sweep_cases, sweep_table
    from labkit.runtime.emulate import resolve
    from labkit.runtime.launcher import launch

    plan = resolve(as_emulate(emulate) or "dgx-h100", world_size)
    cases = sweep_cases(ops, sizes)
    # the sizes of the published rows this placement can be checked against, emulated in the same launch
    extra = sorted({int(r["bytes"]) for r in published_rows(plan.cluster, world_size, ops)} - set(sizes))
    extra_cases = sweep_cases(ops, extra) if extra else []
    res = launch(collectives_rank, world_size, cases + extra_cases, emulate=plan, timeout_s=timeout_s, echo=False)
    em = res.emulation
    every = cases + extra_cases
    two = two_node_cluster(em.cluster, world_size)
    out = {"emulation": em, "cases": every, "n_asked": len(cases), "table": asked_table(em, every, len(cases)),
           "published_sizes_table": sweep_table(em, every), "label": em.label, "world_size": world_size,
           "two_nodes": asked_table(em.reprice(two), every, len(cases)) if two is not None else None}
    out["findings"] = emulated_findings(out)
    return out


def asked_table(emulation, cases, n_asked: int) -> pd.DataFrame:
    """:func:`labkit.experiments.emulate.sweep_table` of ``emulation`` over all its ``cases``, the first
    ``n_asked`` rows (the sweep asked for; the rest are the published rows' sizes)."""
    from labkit.experiments.emulate import sweep_table

    return sweep_table(emulation, cases).iloc[:n_asked].reset_index(drop=True)


def published_rows(cluster, world_size: int, ops=EMULATED_OPS) -> list[dict]:
    """The published busbw rows of validation (data/reference/published/collectives.csv, ``role ==
    validation``: the collectives model was not fitted on them) measured on one node of ``world_size`` GPUs of
    the profile ``cluster`` (name or Cluster) for one of ``ops``, in the bandwidth regime, where NCCL's default
    choice (on the profile as named) is the algorithm the row ran (a row forced to ``NCCL_ALGO=RING`` on an
    NVLS node does not apply).
    Rows as :func:`labkit.theory.nccl.validation_table` gives them."""
    from labkit.theory import nccl
    from labkit.theory.cluster import get_cluster

    cl = get_cluster(cluster) if isinstance(cluster, str) else cluster
    out = []
    for r in nccl.validation_table():
        if (r["profile"] != cl.name or r["world_size"] != world_size or r["nodes"] != 1 or r["op"] not in ops
                or r["metric"] != "busbw" or r["regime"] != "bandwidth"):
            continue
        default = get_cluster(r["profile"]).collective_choice(r["op"], r["bytes"], range(world_size))
        if default["algorithm"] == r["algorithm"]:  # judged on the named profile, whatever ``cluster`` prices
            out.append(r)
    return out


def published_beside(run: dict) -> pd.DataFrame:
    """The emulated busbw of an :func:`emulated_sweep_run` beside every :func:`published_rows` row of its
    placement: ``source, op, bytes, published_gbps`` (``published (<source>)``), ``emulated_gbps`` (the run's
    label), ``ratio`` = emulated / published, ``tolerance`` (the model's validation tolerance), ``within``.
    Empty (with ``attrs["note"]``) when no published row measured this placement."""
    em = run["emulation"]
    table = run.get("published_sizes_table", run["table"])
    rows = []
    for r in published_rows(em.cluster, run["world_size"], tuple(set(table["op"]))):
        row = _at(table, r["op"], int(r["bytes"]))
        if row is None:
            continue
        bus = float(row["busbw_gbps"])
        rows.append({"source": r["source"], "op": r["op"], "bytes": int(r["bytes"]), "published_gbps": r["published"],
                     "emulated_gbps": bus, "ratio": bus / r["published"], "tolerance": r["tolerance"],
                     "within": abs(bus / r["published"] - 1) <= r["tolerance"]})
    df = pd.DataFrame(rows, columns=["source", "op", "bytes", "published_gbps", "emulated_gbps", "ratio",
                                     "tolerance", "within"])
    df.attrs["label"] = run["label"]
    if not rows:
        df.attrs["note"] = (f"no published row of validation measured {run['world_size']} GPUs on one node of "
                            f"{em.cluster.name}: the emulated sweep is not checked against a measurement")
    return df


#: published rows at least this large are the bandwidth plateau the emulated sweep must reproduce
PLATEAU_BYTES = 2**26


def check_published(beside: pd.DataFrame, *, min_bytes: int = PLATEAU_BYTES) -> str:
    """Chapter 02's check of the emulated sweep against measurements (AssertionError naming the rows): every
    :func:`published_beside` row of S >= ``min_bytes`` (the bandwidth plateau) within its tolerance. Smaller
    rows are reported, not asserted (the model's known misses at 2-32 MiB: docs/costmodel.md). Returns one line
    saying what was compared (or why nothing was)."""
    if not len(beside):
        return beside.attrs.get("note", "no published row to compare with")
    big = beside[beside["bytes"] >= min_bytes]
    bad = big[~big["within"]]
    assert bad.empty, ("emulated busbw outside the published rows' tolerance:\n" + bad.to_string())
    small = beside[beside["bytes"] < min_bytes]
    return (f"{beside.attrs.get('label', 'emulated')} busbw within tolerance of {len(big)} of {len(big)} "
            f"published rows of S >= {min_bytes // 2**20} MiB; below that {int(small['within'].sum())} of "
            f"{len(small)} (not asserted)")


def link_peak_gbps(cluster, world_size: int) -> float:
    """The busbw an all-reduce on ``world_size`` GPUs of ``cluster`` approaches at large S (GB/s, *predicted*):
    ``factor x S / t`` at S = 1 TiB without the per-call latency, priced by :mod:`labkit.theory.nccl` as NCCL
    runs it (:func:`labkit.theory.costmodel.group_collective_time`). Inside one node that is the faster of a
    Simple ring at the link's fitted ``bus_efficiency`` x line rate and, where the link has NVLink SHARP,
    ``nvls_efficiency`` x line rate x k/(k+1) x the all-reduce's bus factor — which can exceed the per-direction
    line rate (the switch reduces: published 8 x H100 NVLS runs reach 465-476 GB/s of a 450 GB/s link); across
    nodes the network's share of it (NICs per node x the fitted NIC efficiency)."""
    from labkit.theory import costmodel as cm
    from labkit.theory.cluster import get_cluster

    cl = get_cluster(cluster) if isinstance(cluster, str) else cluster
    s = float(2**40)
    t = cm.group_collective_time("all_reduce", s, range(world_size), gpus_per_node=cl.gpus_per_node, intra=cl.intra,
                                 inter=cl.inter, nics_per_node=cl.nics_per_node, link_efficiency=cl.link_efficiency,
                                 include_base=False, nvls=cl.nvls)  # the profile's NVLS switch (dgx-h100-nonvls)
    return s / t / 1e9 * cm.bus_factor("all_reduce", world_size)


def _at(table, op, nbytes):
    row = table[(table["op"] == op) & (table["bytes"] == nbytes)]
    return row.iloc[0] if len(row) else None


def emulated_findings(run: dict) -> dict:
    """Sentences written from an :func:`emulated_sweep_run`: for the smallest and the largest size, all_reduce's
    emulated busbw as a share of its large-S busbw (:func:`link_peak_gbps`): "bandwidth-bound" (>=
    :data:`BANDWIDTH_BOUND`), "latency-bound" (<= :data:`LATENCY_BOUND`) or in between; the two-node busbw beside
    the one-node one; and reduce-scatter + all-gather beside one all-reduce at each size (the same within
    :data:`SAME_COST`, else which is dearer and by how much). Returns ``{"regime": {bytes: word}, "share": {bytes:
    share}, "rs_ag_over_ar": {bytes: ratio}, "two_node_ratio", "conclusion"}``."""
    from labkit.theory.collectives import format_size

    t, n, label = run["table"], run["world_size"], run["label"]
    peak = link_peak_gbps(run["emulation"].cluster, n)
    sizes = sorted(set(t.loc[t["op"] == "all_reduce", "bytes"]))
    out = {"regime": {}, "share": {}, "rs_ag_over_ar": {}, "two_node_ratio": None, "peak_gbps": peak}
    lines = []
    for s in sorted({sizes[0], sizes[-1]}):
        bus = float(_at(t, "all_reduce", s)["busbw_gbps"])
        share = bus / peak
        word = ("bandwidth-bound" if share >= BANDWIDTH_BOUND else "latency-bound" if share <= LATENCY_BOUND
                else "between the latency and the bandwidth regime")
        out["regime"][s], out["share"][s] = word, share
        link = run["emulation"].cluster.link_of(range(n))
        lines.append(f"At S = {format_size(s)} the all-reduce on {n} GPUs ({link}) reaches busbw {bus:.3g} GB/s "
                     f"({label}), {share:.3g} x the {peak:.0f} GB/s it approaches at large S (predicted, NCCL "
                     f"model): {word}.")
        ar, rs, ag = (_at(t, op, s) for op in ("all_reduce", "reduce_scatter", "all_gather"))
        if rs is not None and ag is not None:
            ratio = (rs["time_s"] + ag["time_s"]) / ar["time_s"]
            out["rs_ag_over_ar"][s] = ratio
            lines.append(f"  Reduce-scatter + all-gather takes {ratio:.2f}x one all-reduce there: "
                         + _rs_ag_why(ratio, word, run["emulation"].cluster, n, s))
    two = run.get("two_nodes")
    if two is not None:
        big = sizes[-1]
        b1, b2 = float(_at(t, "all_reduce", big)["busbw_gbps"]), float(_at(two, "all_reduce", big)["busbw_gbps"])
        out["two_node_ratio"] = b2 / b1
        lines.append(f"Split over two nodes ({two['source'].iloc[0]}), the same {format_size(big)} all-reduce reaches "
                     f"busbw {b2:.3g} GB/s, {b2 / b1:.2f}x the one-node figure: the InfiniBand step, not NVLink, "
                     "sets the time." if b2 < b1 else f"Split over two nodes, busbw {b2:.3g} GB/s: no slower.")
    out["conclusion"] = "\n".join(lines)
    return out


def _rs_ag_why(ratio: float, regime: str, cluster, n: int, nbytes: int) -> str:
    """Why reduce-scatter + all-gather cost ``ratio`` x one all-reduce of ``nbytes`` on ``n`` GPUs of
    ``cluster`` (emulated): the same within :data:`SAME_COST` (the ring moves 2(n-1)/n·S per GPU either way);
    dearer where the all-reduce is latency-bound (two calls, two latencies) or where NCCL runs the all-reduce on
    another algorithm than the rings of the two halves (NVLink SHARP: ``cluster.collective_choice``, predicted)."""
    if abs(ratio - 1) <= SAME_COST:
        return "the same cost, as the ring predicts (both move 2(n-1)/n·S per GPU)."
    if ratio < 1:
        return "cheaper, which the ring model does not predict."
    algo = cluster.collective_choice("all_reduce", nbytes, range(n))
    if algo["algorithm"] != "ring" and regime != "latency-bound":
        name = {"nvls": "NVLink SHARP", "nvls_tree": "NVLink SHARP with a tree across nodes"}.get(
            algo["algorithm"], algo["algorithm"])
        return (f"dearer: NCCL runs this all-reduce as {name} ({algo['algbw_gbps']:.0f} GB/s algbw, predicted: "
                "the switch reduces), while reduce-scatter and all-gather each run as a ring at its bus efficiency.")
    if regime == "latency-bound":
        return "dearer: two calls pay the fixed latency twice, and at this size latency is most of the cost."
    return "dearer: each of the two calls pays its own fixed latency (the ring moves the same bytes either way)."


def ar_rs_ag_finding(table: pd.DataFrame, *, world_size: int, backend: str) -> dict:
    """Section 4's measured comparison as a sentence: all_reduce vs reduce_scatter + all_gather (medians of
    :func:`labkit.experiments.collective_patterns.ar_vs_rs_ag`'s ``table``): the same within :data:`SAME_COST`,
    or which was faster and by how much; the ring predicts the same bytes per rank either way, so a difference is
    the backend's algorithms (gloo: its reduce_scatter is not a ring, section 5 counts its bytes) or noise."""
    t = table.set_index("method")["time_s"]
    ar, both = float(t["all_reduce"]), float(t["reduce_scatter + all_gather"])
    ratio = both / ar
    head = (f"Measured on {world_size} ranks ({backend}): all_reduce {ar * 1e3:.3g} ms, reduce_scatter + all_gather "
            f"{both * 1e3:.3g} ms ({ratio:.2f}x). ")
    if abs(ratio - 1) <= SAME_COST:
        tail = "The times match, as the ring's equal bytes per rank predict."
    elif ratio > 1:
        tail = ("Two calls were slower than one: each pays its own latency, and a backend whose reduce_scatter is "
                "not a ring sends more than the ring's bytes (section 5 counts them).")
    else:
        tail = ("The two calls were faster than one all_reduce: the ring model predicts the same time, so this "
                f"{backend} all_reduce did more work than a ring at this size (another algorithm) or the run was "
                "disturbed; the emulated run below, which charges both as rings, shows the model's answer.")
    return {"ratio": ratio, "same": abs(ratio - 1) <= SAME_COST, "sentence": head + tail}


def busbw_figure(measured: pd.DataFrame | None, emulated: dict | None, *, ops=("all_reduce",), published=True,
                 title: str | None = None):
    """The headline: all-reduce busbw vs S — ``measured`` on this machine (sweep rows, synchronised), the emulated
    sweep on one node and on two (``emulated (<profile>)``), the busbw it approaches at large S as ``predicted
    (large-S busbw, NCCL model: ...)`` dotted lines (:func:`link_peak_gbps`), and the published nccl-tests rows
    (:func:`labkit.plots.add_published_busbw`)."""
    import plotly.graph_objects as go

    from labkit import plots
    from labkit.style import LABEL_DASH, label_color

    fig = go.Figure()
    if measured is not None:
        m = measured[measured["op"].isin(ops) & (measured["flag"] == "")]
        for op, g in m.groupby("op", sort=False):
            g = g.sort_values("bytes")
            fig.add_trace(go.Scatter(x=g["bytes"], y=g["busbw_gbps"], mode="lines+markers",
                                     name=f"measured: {op}, n={int(g['world_size'].iloc[0])} ({g['backend'].iloc[0]})",
                                     line={"color": label_color("measured")}))
    xs = list(EMULATED_SIZES)
    if emulated is not None:
        n = emulated["world_size"]
        nodes = -(-n // emulated["emulation"].cluster.gpus_per_node)
        for table, dash, where in ((emulated["table"], LABEL_DASH["emulated"], f"{nodes} node{'s' * (nodes > 1)}"),
                                   (emulated.get("two_nodes"), "dot", "2 nodes")):
            if table is None:
                continue
            g = table[table["op"].isin(ops)].sort_values("bytes")
            xs = sorted(g["bytes"])
            src = g["source"].iloc[0]
            fig.add_trace(go.Scatter(x=g["bytes"], y=g["busbw_gbps"], mode="lines+markers", name=f"{src}: all_reduce, "
                                     f"n={n}, {where}", line={"color": label_color("emulated"), "dash": dash}))
        clusters = [emulated["emulation"].cluster, two_node_cluster(emulated["emulation"].cluster, n)]
        for cl in filter(None, clusters):
            peak = link_peak_gbps(cl, n)
            fig.add_trace(go.Scatter(x=[xs[0], xs[-1]], y=[peak, peak], mode="lines",
                                     name=f"predicted (large-S busbw, NCCL model: {cl.name}, {peak:.0f} GB/s)",
                                     line={"color": label_color("predicted"), "dash": "dot"}))
    if published:
        plots.add_published_busbw(fig, ops=list(ops))
    fig.update_xaxes(type="log", title="message size S (bytes, log)")
    fig.update_yaxes(type="log", title="busbw (GB/s, log)")
    fig.update_layout(title=title or "all-reduce busbw: measured here, emulated on a cluster, its large-S "
                      "prediction, published", legend={"font": {"size": 10}})
    return fig


def cluster_panel(emulated: dict, measured: pd.DataFrame | None = None):
    """A widget: pick a cluster profile (and one node or two) and the emulated sweep is re-priced on it (the same
    run's traces, no re-run: :meth:`labkit.runtime.emulate.Emulation.reprice`) and :func:`busbw_figure` redrawn.
    Returns the ``ipywidgets.VBox``; ``.figure()`` gives the current figure."""
    import ipywidgets as w

    from labkit.theory.cluster import clusters, get_cluster
    from labkit.widgets import headless, show_in

    em, n = emulated["emulation"], emulated["world_size"]
    names = [k for k, c in clusters().items() if n in c.valid_world_sizes(n)]
    pick = w.Dropdown(options=names, value=em.cluster.name if em.cluster.name in names else names[0],
                      description="cluster")
    out, state = w.Output(), {}

    def redraw(*_):
        cl = get_cluster(pick.value)
        two = two_node_cluster(cl, n)
        k = emulated.get("n_asked", len(emulated["cases"]))
        run = {**emulated, "table": asked_table(em.reprice(cl), emulated["cases"], k),
               "two_nodes": asked_table(em.reprice(two), emulated["cases"], k) if two is not None else None,
               "emulation": em.reprice(cl)}
        state["fig"] = busbw_figure(measured, run, title=f"all-reduce busbw re-priced on {cl.name} ({n} GPUs)")
        show_in(out, state["fig"])

    pick.observe(redraw, names="value")
    redraw()
    box = w.VBox([pick, out])
    box.figure = lambda: state["fig"]
    return headless(box)  # an executed copy shows the figure, not VBox(children=...)


def timing_trap_finding(cmp: pd.DataFrame) -> str:
    """Section 7 as a sentence: at the largest size, the median over ops of synchronised / unsynchronised time
    (``too_fast_x``), and whether the unsynchronised times still grow with size (their median ratio largest /
    smallest size)."""
    big, small = cmp[cmp["bytes"] == cmp["bytes"].max()], cmp[cmp["bytes"] == cmp["bytes"].min()]
    x = float(big["too_fast_x"].median())
    grow = float(big["time_s_unsync"].median() / small["time_s_unsync"].median())
    head = (f"At the largest size the clock read without synchronising is {x:.1f}x too fast (median over ops, "
            "measured)" if x > 1 else f"At the largest size the unsynchronised clock was NOT too fast ({x:.2f}x)")
    return head + (f"; the wrong times still grow {grow:.1f}x from the smallest size to the largest (gloo starts "
                   "the work at once on a background thread)." if grow > 1.5 else
                   f"; the wrong times barely grow with size ({grow:.1f}x): the clock times the issue, not the work.")


def emulation_on(emulate) -> bool:
    """Whether the chapter's ``emulate`` parameter asks for an emulated run (None and ``"None"`` do not)."""
    return as_emulate(emulate) is not None


def prediction_numbers(emulated: dict | None, nbytes: int = 2**30) -> dict:
    """What the reader's guess (busbw of a ``nbytes`` all-reduce on the emulated node) is compared with: the
    emulated busbw (None without an emulated run) and the busbw it approaches at large S (:func:`link_peak_gbps`;
    the dgx-h100 node's when nothing was emulated), with their labels."""
    if emulated is None:
        return {"measured": None, "predicted": link_peak_gbps("dgx-h100", 8), "label": "emulated"}
    row = _at(emulated["table"], "all_reduce", nbytes)
    return {"measured": None if row is None else float(row["busbw_gbps"]), "label": emulated["label"],
            "predicted": link_peak_gbps(emulated["emulation"].cluster, emulated["world_size"])}
