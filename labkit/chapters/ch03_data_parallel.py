"""Chapter 03 (data parallelism: naive, bucketed, DDP): its parameter check, the one rank function it
launches, and the sentences it prints about the scaling sweep.

The strategies are in :mod:`labkit.parallel.data`, their formulas in :mod:`labkit.theory.data`, the runs in
:mod:`labkit.experiments.data`.
"""

from __future__ import annotations

from labkit.chapters.common import (
    charged_emulation_plan,
    check_fits_in_memory,
    check_prediction,
    check_steps,
    check_world_size,
)
from labkit.checks import positive_int
from labkit.experiments.data import accumulation_demo_rank, run_rank, scaling_rank
from labkit.parallel.data import DEFAULT_BUCKET_CAP_BYTES
from labkit.theory.data import check_batch


def check_chapter(*, world_size, emulate=None, my_prediction=None, model: str = "lab-tiny-llama",
                  global_batch_size=None, n_microbatches=2, steps=4, seq_len=64,
                  bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, emulated_ranks=8, charge_as="llama-3-8b",
                  charged_seq_len=512, scaling_batch_sizes=(1, 2, 4, 8), scaling_steps=2) -> dict:
    """Chapter 03's parameters, all checked before any launch (the chapter's first cell after its parameters).

    world_size >= 2 (with one rank there is nothing to average, and the wrong-sync run cannot differ from the
    right one); a known ``model`` small enough for the machine; ``steps`` >= 1; world_size divides
    ``global_batch_size``; ``n_microbatches`` >= 2 (the accumulation runs, and the bug of syncing on the wrong
    micro-batch, need two) and divides the local batch; ``seq_len`` within the model's ``max_seq_len``;
    positive ``bucket_cap_bytes`` and ``scaling_steps``; one or more positive local batch sizes. Returns the
    checked values (``local_batch_size`` added). Raises ValueError naming the value and the fix.

    ``global_batch_size`` None (the default) is chosen from world_size: world_size x n_microbatches x 2, so
    every world size works. ``emulate`` (a profile name, or None for no emulated run), ``emulated_ranks``
    (2..16, the emulated strong-scaling sweep's largest group), ``charge_as`` / ``charged_seq_len`` (the model
    the emulated run is charged as) are checked by :func:`emulation_plan`; ``my_prediction`` is None or a
    number (the reader's guess of the emulated naive efficiency at ``emulated_ranks``).
    """
    from labkit.theory.spec import get_spec

    n = check_world_size("03", world_size, why="with one rank there is no gradient to average, and the "
                                 "wrong-sync run cannot leave ranks disagreeing")
    spec = get_spec(model)
    steps = check_steps("steps", steps)
    m = positive_int("n_microbatches", n_microbatches)
    if m < 2:
        raise ValueError(f"n_microbatches={m}: chapter 03's accumulation runs need n_microbatches >= 2 (the bug it "
                         "reproduces syncs on micro-batch 0 instead of the last); use n_microbatches=2")
    if global_batch_size is None:
        global_batch_size = n * m * 2
    local = check_batch(n, global_batch_size, m, dp_name="world_size")
    seq_len = spec.check_seq_len(seq_len)
    positive_int("bucket_cap_bytes", bucket_cap_bytes)
    sizes = tuple(positive_int(f"scaling_batch_sizes[{i}]", b) for i, b in enumerate(scaling_batch_sizes or ()))
    if not sizes:
        raise ValueError(f"scaling_batch_sizes={scaling_batch_sizes!r} is empty: give at least one local batch "
                         "size, e.g. (1, 2, 4, 8)")
    check_steps("scaling_steps", scaling_steps)
    check_fits_in_memory(spec, n, copies=2, what="chapter 03")
    check_prediction(my_prediction, what="a number: your guess of the emulated naive efficiency T(1) / (n T(n)) "
                                    "at n = emulated_ranks, e.g. 0.6")
    plan = emulation_plan(emulate, emulated_ranks, charge_as, charged_seq_len, model) if emulate else None
    return {"world_size": n, "model": spec.name, "global_batch_size": global_batch_size, "n_microbatches": m,
            "local_batch_size": local, "steps": steps, "seq_len": seq_len, "scaling_batch_sizes": sizes,
            "emulate": plan, "emulated_ranks": emulated_ranks, "charge_as": charge_as,
            "charged_seq_len": charged_seq_len}


def chapter_rank(ctx, runs: list[dict] | None = None, *, scaling_batch_sizes=(1, 2, 4, 8), scaling_steps: int = 2,
                 **kwargs) -> dict:
    """Rank function for chapter 03, so one launch does all of it: the training variants (:func:`run_rank`
    with ``runs`` and ``kwargs``), the hand-checkable accumulation demo (:func:`accumulation_demo_rank`) and
    the local-batch sweep (:func:`scaling_rank`, with the training runs' ``model``, ``seq_len`` and ``seed``;
    skipped when ``scaling_batch_sizes`` is empty).
    Returns {"runs": [...], "demo": {...}, "scaling": [...]}; :func:`labkit.experiments.common.summarize` and
    :func:`labkit.experiments.common.exposure_table` accept the LaunchResult directly."""
    out = {"runs": run_rank(ctx, runs, **kwargs), "demo": accumulation_demo_rank(ctx)}
    same = {k: kwargs[k] for k in ("model", "seq_len", "seed") if k in kwargs}  # the training runs' own values
    out["scaling"] = (scaling_rank(ctx, scaling_batch_sizes, steps=scaling_steps, **same)
                      if scaling_batch_sizes else [])
    return out


def scaling_findings(rows) -> str:
    """What :func:`scaling_rank`'s sweep showed, as sentences computed from its rows (nothing assumed).

    ``rows``: dicts (or a DataFrame's records) with ``local_batch_size`` and ``efficiency``. Sorted by local
    batch, the efficiencies either rise (each at least the one before), fall, or move both ways; the sentence
    says which, with the numbers, and only in the first case that the sweep shows the expected trend (compute
    grows with the batch, the all-reduce does not: Li et al. 2020, sec. 5). Raises ValueError for no rows or a
    row without those keys."""
    rows = list(rows.to_dict("records") if hasattr(rows, "to_dict") else rows)
    if not rows:
        raise ValueError("scaling_findings() got no rows; expected scaling_rank's rows (local_batch_size, efficiency)")
    missing = [k for k in ("local_batch_size", "efficiency") if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"scaling_findings() rows lack {missing}; expected scaling_rank's rows")
    rows = sorted(rows, key=lambda r: r["local_batch_size"])
    b = [int(r["local_batch_size"]) for r in rows]
    e = [float(r["efficiency"]) for r in rows]
    listed = ", ".join(f"b={x}: {y:.2f}" for x, y in zip(b, e))
    text = f"Measured efficiency (compute_s / dp_s) by local batch: {listed}."
    if len(e) < 2:
        return text + " One local batch size: no trend to read; give scaling_batch_sizes more values."
    steps = [y - x for x, y in zip(e, e[1:])]
    if all(d >= 0 for d in steps):
        return text + (" In this run efficiency rose with the local batch, as the model predicts: the compute grows "
                       "with b, the all-reduce's bytes do not.")
    if all(d <= 0 for d in steps):
        return text + (" In this run efficiency FELL with the local batch, against the model: at these sizes the "
                       "timings are milliseconds and noise from other processes dominates; re-run, or raise "
                       "seq_len or the batch sizes.")
    return text + (f" In this run efficiency shows no monotone trend ({e[0]:.2f} at the smallest batch, {e[-1]:.2f} "
                   "at the largest): at these sizes the timings are milliseconds and noise from other processes "
                   "outweighs the effect; re-run, or raise seq_len or the batch sizes to see it.")


# ------------------------------------------------------------------------------------------------------
# the reader's prediction, the emulated strong-scaling sweep, what it shows, its figures and its panel
# ------------------------------------------------------------------------------------------------------
#: socket bytes / gloo's model of the calls may exceed 1 by this much: TCP and gloo headers per message. The naive
#: variant sends one all-reduce per tensor, in n-1 ring messages each, so at world_size 8 its overhead reaches
#: about 10 % (measured 1.103); 2-4 ranks stay under 3 % for the bucketed runs
SOCKET_OVERHEAD_MAX = 1.15
#: the sequence length the ranks run in the emulated sweep (each lab sequence is charged as one of the preset's)
LAB_SEQ_LEN = 32
#: below this efficiency (T(1) / (n T(n))) an added GPU buys less than half a GPU of speed-up
PAYING_EFFICIENCY = 0.5


def scaling_sizes(emulated_ranks: int) -> tuple:
    """The group sizes of the sweep: 1, 2, 4, ... below ``emulated_ranks``, and ``emulated_ranks`` itself.
    Raises ValueError when ``emulated_ranks`` is not an integer >= 1."""
    n = positive_int("emulated_ranks", emulated_ranks)
    return tuple(sorted({1, n} | {2 ** k for k in range(1, n.bit_length()) if 2 ** k < n}))


def emulation_plan(emulate, emulated_ranks=8, charge_as="llama-3-8b", charged_seq_len=512,
                   model="lab-tiny-llama") -> dict:
    """The ``emulate=`` dict of the chapter's emulated sweep: cluster ``emulate`` (a profile name), the ranks'
    ``model`` at :data:`LAB_SEQ_LEN` charged as ``charge_as`` at ``charged_seq_len``, one sequence for one.
    Checked before anything runs (labkit.runtime.emulate.resolve): ValueError naming the valid profiles, world
    sizes or presets; ``emulated_ranks`` must be 2..16."""
    return charged_emulation_plan(emulate, emulated_ranks, charge_as=charge_as, charged_seq_len=charged_seq_len,
                                  model=model, lab_seq_len=LAB_SEQ_LEN,
                                  what="chapter 03's emulated sweep runs 2..16 ranks (8 fills one dgx-h100 node, "
                                       "16 crosses to a second); use emulated_ranks=8")


def _label(plan) -> str:
    return f"emulated ({plan['cluster']}, as {plan['model']})"


class EmulatedScaling:
    """One emulated strong-scaling launch and its table. ``result`` (LaunchResult), ``plan`` (the emulate
    dict), ``label`` ("emulated (<profile>, as <model>)"), ``frame`` (emulated timeline), ``table`` (one row
    per variant and n: :func:`labkit.experiments.dp_scaling.strong_scaling_rows`), ``sizes``,
    ``global_batch_size`` (lab sequences per step; each stands for one of the preset's)."""

    def __init__(self, result, plan, sizes, global_batch_size, emulation=None):
        import pandas as pd

        from labkit.experiments.dp_scaling import emulated_steps, strong_scaling_rows
        from labkit.theory.spec import get_spec

        self.result, self.plan, self.sizes, self.global_batch_size = result, plan, tuple(sizes), global_batch_size
        self.emulation = emulation or result.emulation
        self.frame = result.emulated if emulation is None else emulation.retime(result.timeline)
        self.label = _label(plan)
        steps = emulated_steps(self.frame, self.sizes)
        self.table = pd.DataFrame(strong_scaling_rows(steps, self.emulation.cluster, get_spec(plan["model"]),
                                                      plan["seq_len"], global_batch_size))

    def reprice(self, cluster=None, charged_seq_len=None) -> EmulatedScaling:
        """The same traces charged on another ``cluster`` and/or ``charged_seq_len``, without running again."""
        plan = dict(self.plan, **{k: v for k, v in (("cluster", cluster), ("seq_len", charged_seq_len)) if v})
        return EmulatedScaling(self.result, plan, self.sizes, self.global_batch_size,
                               emulation=self.result.emulation.reprice(plan))

    def efficiency(self, variant: str = "naive", n: int | None = None) -> float:
        n = self.sizes[-1] if n is None else n
        t = self.table
        return float(t[(t["variant"] == variant) & (t["n"] == n)]["efficiency"].iloc[0])

    def predicted_efficiency(self, n: int | None = None) -> float:
        n = self.sizes[-1] if n is None else n
        t = self.table
        return float(t[(t["variant"] == "naive") & (t["n"] == n)]["predicted_efficiency"].iloc[0])


def emulated_scaling(plan, emulated_ranks: int = 8, *, sequences_per_rank: int = 1, keep_warm: bool = True,
                     echo: bool = False) -> EmulatedScaling:
    """The chapter's emulated run: one launch of ``emulated_ranks`` ranks on ``plan`` (:func:`emulation_plan`)
    training the same global batch (``sequences_per_rank`` x the lcm of the sizes) on 1, 2, 4, ... ranks,
    naive and bucketed (:func:`labkit.experiments.dp_scaling.strong_scaling_rank`), in a warm pool by default
    (the panel re-runs it there). Returns :class:`EmulatedScaling`. Raises ValueError for a bad
    ``emulated_ranks`` or ``sequences_per_rank`` (not an integer >= 1), before anything is launched."""
    import math

    from labkit import launch
    from labkit.experiments.dp_scaling import strong_scaling_rank

    sizes = scaling_sizes(emulated_ranks)
    gbs = math.lcm(*sizes) * positive_int("sequences_per_rank", sequences_per_rank)
    res = launch(strong_scaling_rank, emulated_ranks, sizes, model=plan["lab_model"], seq_len=LAB_SEQ_LEN,
                 global_batch_size=gbs, steps=1, emulate=plan, keep_warm=keep_warm, echo=echo)
    return EmulatedScaling(res, plan, sizes, gbs)


def strong_scaling_findings(scaling: EmulatedScaling) -> str:
    """Sentences about the emulated sweep, every direction and size computed from its table: where adding ranks
    stops paying (the first n whose naive efficiency is below :data:`PAYING_EFFICIENCY`, or that it never does
    up to the largest n), whether overlap (bucketed) beat naive at the largest n and by how much of the naive
    variant's exposed communication, and how the emulated naive step compares with the formula."""
    t, label, big = scaling.table, scaling.label, scaling.sizes[-1]
    naive = t[t["variant"] == "naive"].set_index("n")
    eff = naive["efficiency"]
    listed = ", ".join(f"n={n}: {e:.2f}" for n, e in eff.items())
    out = [f"{label}, naive efficiency T(1)/(n·T(n)) at a fixed global batch: {listed}."]
    low = [n for n, e in eff.items() if e < PAYING_EFFICIENCY]
    if low:
        n = low[0]
        out.append(f"Adding ranks stops paying at n={n}: efficiency {eff[n]:.2f} < {PAYING_EFFICIENCY}, so each GPU "
                   f"spends {1 - eff[n]:.0%} of the step not computing — the compute per rank shrinks as 1/n, the "
                   "all-reduce of the whole gradient does not.")
    else:
        out.append(f"Up to n={big} adding ranks still pays: the naive efficiency stays at or above "
                   f"{PAYING_EFFICIENCY} (lowest {eff.min():.2f}); at this batch the compute per rank still outweighs "
                   "the all-reduce — lower charged_seq_len or raise emulated_ranks to find the knee.")
    bucket = t[t["variant"] == "bucket"].set_index("n")
    tn, tb = float(naive.loc[big, "emulated_step_s"]), float(bucket.loc[big, "emulated_step_s"])
    exposed = tn - naive.loc[1, "emulated_step_s"] / big
    if tb < tn:
        hidden = (tn - tb) / exposed if exposed > 0 else 0.0
        out.append(f"Overlap pays: at n={big} the bucketed step is {tb * 1e3:.1f} ms against naive {tn * 1e3:.1f} ms, "
                   f"hiding {min(hidden, 1.0):.0%} of the naive variant's {exposed * 1e3:.1f} ms of communication "
                   f"behind backward (efficiency {scaling.efficiency('bucket'):.2f} instead of {eff[big]:.2f}).")
    else:
        out.append(f"Overlap does not pay here: at n={big} the bucketed step is {tb * 1e3:.1f} ms, naive "
                   f"{tn * 1e3:.1f} ms — the buckets' per-call latency outweighs what backward can hide.")
    ratio = tn / naive.loc[big, "predicted_step_s"]
    text = (f"The emulated naive step at n={big} is {ratio:.2f}x the formula C/n + all-reduce "
            f"({naive.loc[big, 'predicted_step_s'] * 1e3:.1f} ms predicted)")
    if abs(ratio - 1) <= 0.1:
        out.append(text + " — within 10 %.")
    else:  # where the gap is, from the run: n=1 has no all-reduce, so its ratio is the compute's alone
        c1 = naive.loc[1, "emulated_step_s"] / naive.loc[1, "predicted_step_s"]
        comm_pred = float(naive.loc[big, "predicted_comm_s"])
        out.append(text + f": at n=1, compute alone, the emulated step is {c1:.2f}x the formula's C"
                   + (" — the gap is in the compute the emulator charges the program's own operations, "
                      "which the formula's FLOP count does not hold" if abs(c1 - 1) > 0.1 else
                      f" — the compute agrees, so the gap is the communication: {exposed * 1e3:.1f} ms not under "
                      f"compute at n={big} against the formula's all-reduce of {comm_pred * 1e3:.1f} ms")
                   + ".")
    return " ".join(out)


def efficiency_figure(scaling: EmulatedScaling):
    """Efficiency T(1)/(n T(n)) vs n: emulated naive and bucketed beside the predicted formula (naive, no
    overlap), with the :data:`PAYING_EFFICIENCY` line."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    t = scaling.table
    color = label_color(scaling.label)
    fig = go.Figure()
    for variant, dash in (("naive", "solid"), ("bucket", "dot")):
        g = t[t["variant"] == variant]
        fig.add_scatter(x=g["n"], y=g["efficiency"], mode="lines+markers", name=f"{scaling.label}: {variant}",
                        line={"color": color, "dash": dash})
    g = t[t["variant"] == "naive"]
    pred = "predicted (C/n + all-reduce, no overlap)"
    fig.add_scatter(x=g["n"], y=g["predicted_efficiency"], mode="lines", name=pred,
                    line={"color": label_color(pred), "dash": "dash"})
    fig.add_hline(y=PAYING_EFFICIENCY, line={"color": "#999", "dash": "dot"},
                  annotation_text="an added GPU buys half a GPU", annotation_position="bottom left")
    fig.update_layout(title=f"When adding ranks stops paying: a fixed global batch of {scaling.global_batch_size} "
                            f"sequences x {scaling.plan['seq_len']} tokens on 1..{scaling.sizes[-1]} GPUs",
                      xaxis_title="data-parallel ranks n", yaxis_title="efficiency T(1) / (n·T(n))",
                      xaxis_type="log", yaxis_range=[0, 1.05], legend={"orientation": "h", "y": -0.25})
    return fig


def overlap_timeline(scaling: EmulatedScaling, n: int | None = None):
    """The emulated timeline of one naive step then one bucketed step on ``n`` ranks (default the largest):
    compute on each rank's lane, communication on its own lane where it overlaps compute."""
    from labkit.experiments.dp_scaling import span_name
    from labkit.plots import timeline_figure

    n = scaling.sizes[-1] if n is None else n
    f = scaling.frame
    spans = f[f["name"].isin([span_name("naive", n), span_name("bucket", n)]) & (f["stream"] != "comm")]
    lo, hi = spans["start_ns"].min(), spans["end_ns"].max()
    df = f[(f["start_ns"] >= lo) & (f["end_ns"] <= hi) & (f["rank"] < n) & ~f["name"].isin(spans["name"])
           & (f["op"] != "broadcast")]  # the bucketed wrapper's initial broadcast, between the two steps
    return timeline_figure(carve_blocking(df), title=f"{scaling.label}: one naive step, then one bucketed step, "
                           f"n={n} (communication during compute on its own lane; the wrapper's initial "
                           "broadcast between them left out)")


def bytes_figure(wire, predicted_bytes: float):
    """Bytes per rank per step by variant: what gloo wrote to its sockets (measured) beside the ring formula
    2(n-1)/n·Ψ·4 (predicted)."""
    import plotly.graph_objects as go

    from labkit.experiments.common import SOCKET
    from labkit.style import label_color

    pred = "predicted (2(n−1)/n·Ψ·4)"
    fig = go.Figure([go.Bar(x=wire["label"], y=wire[SOCKET], name="measured", marker_color=label_color("measured")),
                     go.Scatter(x=wire["label"], y=[predicted_bytes] * len(wire), mode="markers", name=pred,
                                marker={"symbol": "line-ew-open", "size": 40, "line": {"width": 3},
                                        "color": label_color(pred)})])
    fig.update_layout(title="All-reduce bytes per rank per step: socket bytes written (measured) vs the ring formula",
                      yaxis_title="bytes", legend={"orientation": "h", "y": -0.3})
    return fig


def measured_timelines(res, labels=("naive", "bucket", "ddp")):
    """One measured per-rank timeline figure per variant (its timed steps)."""
    from labkit.experiments.common import per_rank, window
    from labkit.plots import timeline_figure

    return [timeline_figure(window(res.timeline, per_rank(res, lab)[0]["window_ns"]),
                            title=f"{lab}: per-rank timeline (measured)") for lab in labels]


def exposure_findings(exposure) -> str:
    """What the measured exposure table shows about overlap on this machine, computed from it: the hidden
    fraction of the bucketed and naive variants, and whether overlap showed (bucketed hides at least 5 points
    more than naive) or not."""
    e = exposure.set_index("label")["hidden_fraction"]
    b, nv = float(e.get("bucket", 0.0)), float(e.get("naive", 0.0))
    text = (f"Measured on this machine: the bucketed variant hid {b:.0%} of its communication time behind backward, "
            f"the naive one {nv:.0%}.")
    if b >= nv + 0.05:
        return text + " Overlap shows even on gloo, where the all-reduce thread competes with backward for the cores."
    return text + (" Here overlap barely shows: gloo's communication thread competes with backward for the same two "
                   "cores; the emulated run gives each rank a GPU whose copy engines and links work alongside compute.")


def scaling_panel(scaling: EmulatedScaling, *, clusters=None, seq_lens=(128, 512, 2048, 8192),
                  sequences=(1, 2, 4)):
    """An ipywidgets panel: the cluster (re-priced, no run), the charged sequence length (re-priced) and the
    sequences per rank of the global batch (re-run in the warm pool: the emulated experiment itself) redraw the
    efficiency figure and its findings. Returns the VBox; ``.scaling()`` gives the current EmulatedScaling."""
    import ipywidgets as w

    from labkit.theory.cluster import clusters as all_clusters
    from labkit.widgets import headless, show_in

    names = list(clusters or sorted(all_clusters()))
    state = {"base": scaling, "now": scaling, "per_rank": 1}
    cl = w.Dropdown(options=names, value=scaling.plan["cluster"], description="cluster")
    sl = w.SelectionSlider(options=sorted(set(seq_lens) | {scaling.plan["seq_len"]}),
                           value=scaling.plan["seq_len"], description="charged seq")
    sq = w.SelectionSlider(options=list(sequences), value=1, description="seqs / rank")
    out, words = w.Output(), w.HTML()

    def redraw(*_):
        try:
            if sq.value != state["per_rank"]:  # a new experiment: re-run it (warm ranks)
                state["base"] = emulated_scaling(scaling.plan, scaling.sizes[-1], sequences_per_rank=sq.value)
                state["per_rank"] = sq.value
            state["now"] = state["base"].reprice(cluster=cl.value, charged_seq_len=sl.value)
        except ValueError as e:  # a profile that cannot hold this many ranks
            words.value = f"<b>{e}</b>"
            return
        show_in(out, efficiency_figure(state["now"]))
        words.value = strong_scaling_findings(state["now"])

    for c in (cl, sl, sq):
        c.observe(redraw, names="value")
    box = w.VBox([w.HBox([cl, sl, sq]), out, words])
    box.scaling = lambda: state["now"]
    redraw()
    return headless(box)  # an executed copy shows the figure, not VBox(children=...)


def check_measured(res, wire, *, model: str, steps: int, global_batch_size: int, seq_len: int) -> None:
    """The measured run's checks (AssertionError with a message when the run is wrong): every variant's
    replicas identical and equal to the single-process reference; every gradient all-reduced once a step
    (payload Ψ·4, ring model = the prediction); socket bytes within 1-15 % above gloo's model; the correct
    accumulation leaves the replicas identical and the wrong-sync bug does not; the demo's numbers."""
    import math

    from labkit.experiments.common import assert_ranks_identical, per_rank, replica_spread
    from labkit.models import train_reference
    from labkit.theory.data import predicted_allreduce_bytes
    from labkit.theory.spec import get_spec

    n, psi = len(res), get_spec(model).n_params()
    ref = train_reference(model, steps=steps, global_batch_size=global_batch_size, seq_len=seq_len)
    for label in ("naive", "bucket", "ddp", "ddp + accumulation"):
        per = per_rank(res, label)
        assert_ranks_identical([r["state"] for r in per], label)
        assert_parity(per[0]["state"], ref["state_dict"], n, what=label)
        assert per[0]["payload_bytes_per_step"] == psi * 4, f"{label}: payload {per[0]['payload_bytes_per_step']}"
        assert math.isclose(per[0]["ring_bytes_per_step"], predicted_allreduce_bytes(psi, n), rel_tol=1e-9), label
    ratio = wire.set_index("label")["measured / gloo model"].dropna()
    assert ((ratio >= 0.99) & (ratio <= SOCKET_OVERHEAD_MAX)).all(), f"socket bytes / gloo model off: {ratio.to_dict()}"
    spread = replica_spread(res)
    assert spread["ddp + accumulation"] == 0.0, "correct accumulation must leave the replicas identical"
    assert spread["ddp, sync on micro-batch 0 (bug)"] > 1e-4, "the wrong-sync run should leave ranks disagreeing"
    correct = {res[r]["demo"]["ddp"]["correct"] for r in range(n)}
    wrong = [res[r]["demo"]["ddp"]["wrong"] for r in range(n)]
    assert len(correct) == 1 and len(set(wrong)) == n, f"demo: correct {correct}, wrong {wrong}"


def check_emulated(scaling: EmulatedScaling | None) -> None:
    """The emulated sweep's checks: the same global batch gives the same loss on every n (fp32 rounding);
    naive efficiency never rises with n (the compute shrinks as 1/n, the all-reduce does not); the emulated
    naive step within 25 % of the formula at every n; every emulated number labelled emulated."""
    import math

    if scaling is None:
        return
    from labkit.experiments.dp_scaling import span_name

    losses = [scaling.result[0][span_name(v, n)] for v in ("naive", "bucket") for n in scaling.sizes]
    assert all(math.isclose(x, losses[0], rel_tol=1e-4) for x in losses), f"losses differ across n: {losses}"
    eff = scaling.table[scaling.table["variant"] == "naive"].sort_values("n")["efficiency"].tolist()
    assert all(b <= a + 1e-9 for a, b in zip(eff, eff[1:])), f"naive efficiency rose with n: {eff}"
    t = scaling.table
    r = (t["emulated_step_s"] / t["predicted_step_s"])[t["variant"] == "naive"]
    assert ((r > 0.75) & (r < 1.25)).all(), f"emulated naive step vs formula: {r.tolist()}"
    assert scaling.label.startswith("emulated (") and scaling.frame.attrs.get("label", scaling.label).startswith(
        "emulated"), scaling.label


def demo_table(res):
    """The accumulation demo's gradients, one column per rank, indexed by (variant, sync)."""
    import pandas as pd

    demo = pd.DataFrame({f"rank {r}": {(v, k): g for v, d in res[r]["demo"].items() for k, g in d.items()}
                         for r in range(len(res))})
    demo.index.names = ["variant", "sync"]
    return demo


def assert_parity(actual: dict, expected: dict, world_size: int, what: str = "") -> None:
    """A data-parallel run's weights against the single-process reference: fp32 tolerance
    (:data:`labkit.models.TOLERANCES`) when ``world_size`` is a power of two (dividing the summed gradient by n is
    exact); when it is not, 1/n is rounded and AdamW's normalisation magnifies that rounding on near-zero
    gradients, so the absolute tolerance is 1e-4 (measured: 1.3e-5 on one element of 4096 at world_size 3 after
    4 steps). Raises AssertionError naming the entry."""
    import torch

    from labkit.models import TOLERANCES

    tol = dict(TOLERANCES[torch.float32])
    if world_size & (world_size - 1):
        tol["atol"] = max(tol["atol"], 1e-4)
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}")
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def carve_blocking(df):
    """``df`` (an emulated timeline frame) with every blocking collective's interval cut out of the compute rows
    of its rank: the naive variant all-reduces from a callback at the end of ``backward()``, so its ``B`` span
    contains the wait; carved, that communication sits alone on the rank's lane (exposed) while an asynchronous
    bucket's all-reduce still overlaps ``B`` (its own lane). The same rule as the lab's training loop
    (:func:`labkit.runtime.training._carve`)."""
    import pandas as pd

    from labkit.runtime.training import _carve

    comm = df[(df["stream"] == "comm") & (df["async_op"] == False)]  # noqa: E712 (a column of bools / NaN)
    rows = []
    for r, g in df.groupby("rank"):
        blocking = sorted(zip(comm[comm["rank"] == r]["start_ns"], comm[comm["rank"] == r]["end_ns"]))
        for row in g.to_dict("records"):
            if row["stream"] == "comm" or row["kind"] != "compute":
                rows.append(row)
                continue
            for _name, s, e, _tags in _carve([(row["name"], row["start_ns"], row["end_ns"], {})], blocking):
                rows.append(dict(row, start_ns=s, end_ns=e))
    out = pd.DataFrame(rows, columns=df.columns)
    out.attrs.update(df.attrs)
    return out
