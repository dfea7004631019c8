"""Chapter 04 (sharded data parallelism: ZeRO-1/2/3 and FSDP2): its parameter check, the one rank function
it launches, and the two tables it shows: model-state bytes predicted per (degree, variant), and bytes per
collective measured beside the formula.

The strategies are in :mod:`labkit.parallel.zero`, their formulas in :mod:`labkit.theory.zero`, the runs in
:mod:`labkit.experiments.zero`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import (
    charged_emulation_plan,
    check_fits_in_memory,
    check_prediction,
    check_steps,
    check_world_size,
)
from labkit.checks import check_choice
from labkit.experiments.common import _runs
from labkit.experiments.zero import memory_rank, run_rank
from labkit.theory.data import check_batch
from labkit.theory.zero import STAGE_OF, VARIANTS, layout_bytes, padded_params, predicted_comm_bytes


def check_chapter(*, world_size, emulate=None, my_prediction=None, model: str = "lab-tiny-llama",
                  global_batch_size=None, steps=3, seq_len=32, emulated_ranks=8, charge_as="llama-3-8b",
                  charged_seq_len=2048) -> dict:
    """Chapter 04's parameters, all checked before any launch (the chapter's first cell after its parameters).

    world_size >= 2 (with one rank nothing is sharded: every stage holds the same bytes and sends nothing);
    a known ``model`` small enough for the machine; ``steps`` >= 1; world_size divides ``global_batch_size``
    (then so does every degree the memory sweep uses, each a divisor of world_size); ``seq_len`` within the
    model's ``max_seq_len``. Returns the checked values. Raises ValueError naming the value and the fix.

    ``global_batch_size`` None (the default) is world_size x 4, so every world size works. ``emulate`` (a
    profile, None for no emulated run), ``emulated_ranks`` (2..16), ``charge_as`` and ``charged_seq_len`` are
    checked by :func:`emulation_plan`; ``my_prediction`` is None, a number (your guess of ZeRO-3's emulated
    step / DDP's) or a dict with keys of :data:`PREDICTION_KEYS`.
    """
    from labkit.theory.spec import get_spec

    n = check_world_size("04", world_size, why="with one rank nothing is sharded, so every stage holds "
                                 "the same bytes and sends none")
    spec = get_spec(model)
    steps = check_steps("steps", steps)
    if global_batch_size is None:
        global_batch_size = 4 * n
    local = check_batch(n, global_batch_size, dp_name="world_size")
    seq_len = spec.check_seq_len(seq_len)
    check_fits_in_memory(spec, n, copies=2, what="chapter 04")
    check_prediction(my_prediction, what="a finite number, e.g. 1.3 (ZeRO-3's emulated step / DDP's) or 20 (GB), or "
                     "a dict of them keyed zero3_step_ratio, zero3_memory_gb", keys=PREDICTION_KEYS,
                     default_key="zero3_step_ratio")
    plan = emulation_plan(emulate, emulated_ranks, charge_as, charged_seq_len, model) if emulate else None
    return {"world_size": n, "model": spec.name, "global_batch_size": global_batch_size, "local_batch_size": local,
            "steps": steps, "seq_len": seq_len, "emulate": plan, "emulated_ranks": emulated_ranks}


def chapter_rank(ctx, runs: list[dict] | None = None, *, degrees=None, memory_variants=VARIANTS, **kwargs) -> dict:
    """Rank function for chapter 04, one launch: the variants trained side by side (:func:`run_rank` with
    ``runs`` and ``kwargs``) and model-state bytes per degree (:func:`memory_rank`, with the same ``model``,
    ``seq_len``, ``global_batch_size`` and ``seed`` as the training runs).
    Returns {"runs": [...], "memory": [...]}."""
    out = {"runs": run_rank(ctx, runs, **kwargs)}
    same = {k: kwargs[k] for k in ("model", "seq_len", "global_batch_size", "seed") if k in kwargs}
    out["memory"] = memory_rank(ctx, degrees, memory_variants, **same)
    return out


def predicted_table(model: str, degrees, variants=VARIANTS, *, rank: int = 0) -> pd.DataFrame:
    """Predicted model-state bytes per rank for each (degree, variant), from the lab's calculator:
    ``labkit.theory.memory.train_memory`` with ``ParallelConfig(dp=degree, zero=stage)`` and convention "torch-fp32"
    (Rajbhandari et al. 2020, Figure 1, with 4 + 4 + 8 bytes per parameter and AdamW's 4-byte step counter
    per parameter tensor). Columns ``degree``, ``variant``, ``stage``, ``parameters``, ``gradients``,
    ``optimizer``, ``optimizer_steps`` (the step counters inside ``optimizer``), ``model_states``; and the
    same four for this implementation's layout on ``rank`` (of its group, ``rank % degree``) from
    :func:`layout_bytes`, prefixed ``layout_`` (equal to the calculator's when d divides every size; else
    they differ by the padding / uneven rows, and ZeRO's step counters are one per unit).
    Raises ValueError for an unknown model or variant."""
    from labkit.theory import memory
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    train = memory.TrainConfig(convention="torch-fp32", seq_len=min(32, spec.max_seq_len))
    steps = memory.get_convention("torch-fp32").step_bytes * len(memory.param_tensors(spec))
    rows = []
    for d in degrees:
        for v in variants:
            check_choice("variant", v, VARIANTS)
            est = memory.train_memory(spec, memory.ParallelConfig(dp=d, zero=STAGE_OF[v]), train, headroom=0.0,
                                      workspace_bytes=0)
            b = {k: est.categories[k] for k in ("parameters", "gradients", "optimizer")}
            lay = layout_bytes(spec, d, v, rank % d)
            rows.append({"degree": d, "variant": v, "stage": STAGE_OF[v], **b, "optimizer_steps": steps,
                         "model_states": sum(b.values()), **{f"layout_{k}": x for k, x in lay.items()}})
    return pd.DataFrame(rows)


#: comm_table's byte columns, each named for where its number comes from
PAYLOAD = "payload S (measured: what the code issued)"
RING = "ring bytes (model: S x factor)"
PREDICTED = "ring bytes (predicted: formula of Ψ)"


def comm_table(results, model: str) -> pd.DataFrame:
    """Bytes per rank per step by collective for every run of a :func:`run_rank` / :func:`chapter_rank`
    launch. Columns: ``label``, ``op``, ``calls`` (measured, per step), :data:`PAYLOAD` (measured: the S the
    code passed to the collectives, CommLog), :data:`RING` (model: each S times its ring factor),
    :data:`PREDICTED` (:func:`predicted_comm_bytes` with the root unit kept gathered, Ψ and Ψ_root padded as
    the variant pads them: :func:`padded_params`). :data:`RING` equals :data:`PREDICTED` exactly when the code
    issued the predicted collectives; the bytes gloo actually wrote are per run, in
    :func:`labkit.experiments.common.summarize`."""
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    runs = _runs(results)
    n = len(runs)
    rows = []
    for r in runs[0]:
        m = r.get("n_microbatches", 1)
        psi, root = padded_params(spec, n, r["variant"])
        pred = predicted_comm_bytes(STAGE_OF[r["variant"]], n, psi, root_params=root, n_microbatches=m)
        for op in sorted(set(pred) | set(r["comm"])):
            c = r["comm"].get(op, {"calls": 0.0, "nbytes": 0.0, "bytes_per_rank": 0.0})
            rows.append({"label": r["label"], "op": op, "calls": c["calls"], PAYLOAD: c["nbytes"],
                         RING: c["bytes_per_rank"], PREDICTED: pred.get(op, 0.0)})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------------
# the reader's prediction, the emulated memory / step-time trade-off, what the runs show, figures, checks
# ------------------------------------------------------------------------------------------------------
from labkit.chapters.ch03_data_parallel import SOCKET_OVERHEAD_MAX  # noqa: E402 (headers per gloo message)

#: the keys a dict ``my_prediction`` may have
PREDICTION_KEYS = ("zero3_step_ratio", "zero3_memory_gb")
#: the sequence length the ranks run in the emulated launch (each lab sequence charged as one of the preset's)
LAB_SEQ_LEN = 32
#: the variants of the emulated launch (FSDP2 is stage 3 like zero3; one stage-3 run keeps the launch short)
EMULATED_VARIANTS = ("ddp", "zero1", "zero2", "zero3")


def emulation_plan(emulate, emulated_ranks=8, charge_as="llama-3-8b", charged_seq_len=2048,
                   model="lab-tiny-llama") -> dict:
    """The ``emulate=`` dict of the chapter's emulated run (cluster ``emulate``, ``model`` at
    :data:`LAB_SEQ_LEN` charged as ``charge_as`` at ``charged_seq_len``, one sequence for one), checked by
    labkit.runtime.emulate.resolve (ValueError naming the valid profiles, sizes, presets); 2..16 ranks."""
    return charged_emulation_plan(emulate, emulated_ranks, charge_as=charge_as, charged_seq_len=charged_seq_len,
                                  model=model, lab_seq_len=LAB_SEQ_LEN,
                                  what="chapter 04's emulated run uses 2..16 ranks (8 fills one dgx-h100 node); "
                                       "use emulated_ranks=8")


class EmulatedTradeoff:
    """One emulated launch of DDP and ZeRO-1/2/3 (one sequence per rank per step) and its table: per variant the
    predicted model-state GB per rank, whether it fits the device, the emulated and predicted step
    (:func:`labkit.experiments.zero_tradeoff.tradeoff_rows`). ``reprice(cluster=, model=)`` charges the same
    traces on another cluster or as another model without running again."""

    def __init__(self, result, plan, n, emulation=None):
        import pandas as pd

        from labkit.experiments.zero_tradeoff import emulated_run_steps, tradeoff_rows
        from labkit.theory.spec import get_spec

        self.result, self.plan, self.n = result, plan, n
        self.emulation = emulation or result.emulation
        self.label = f"emulated ({plan['cluster']}, as {plan['model']})"
        steps = emulated_run_steps(result, self.emulation)
        self.table = pd.DataFrame(tradeoff_rows(steps, self.emulation.cluster, get_spec(plan["model"]),
                                                plan["seq_len"], 1, n, self.label))
        self.device_gb = self.emulation.cluster.device.memory_bytes / 1e9

    def reprice(self, cluster=None, model=None, charged_seq_len=None) -> EmulatedTradeoff:
        plan = dict(self.plan, **{k: v for k, v in (("cluster", cluster), ("model", model),
                                                     ("seq_len", charged_seq_len)) if v})
        return EmulatedTradeoff(self.result, plan, self.n, emulation=self.result.emulation.reprice(plan))

    def value(self, variant: str, column: str) -> float:
        return float(self.table.set_index("variant").loc[variant, column])

    def breakdown(self):
        """Per variant, on the emulated clock of the slowest rank's window (ms per step): ``step_ms``,
        ``compute_ms`` (charged compute), ``comm_ms`` (the union of its communication), ``hidden_ms`` (the part
        of that under compute) and ``exposed_ms`` (the rest): what the program's trace did, read from the
        replay, so that a sentence about overlap says what this run did."""
        import pandas as pd

        from labkit.experiments.common import _runs
        from labkit.runtime.timeline import _overlap_ns, _union_ns

        em, rep = self.emulation, self.emulation.result
        best: dict = {}
        for rank, runs in enumerate(_runs(self.result)):
            for run in runs:
                a, b = em.map_ns(rank, run["window_ns"][0]), em.map_ns(rank, run["window_ns"][1])
                comm = _union_ns([(max(c["start_ns"], a), min(c["end_ns"], b)) for c in rep.comm
                                  if c["rank"] == rank and c["end_ns"] > a and c["start_ns"] < b])
                seg = _union_ns([(max(x, a), min(y, b)) for x, y in rep.segments[rank] if y > a and x < b])
                k = max(len(run["step_s"]), 1) * 1e6
                row = {"variant": run["label"], "step_ms": (b - a) / k, "compute_ms": sum(y - x for x, y in seg) / k,
                       "comm_ms": sum(y - x for x, y in comm) / k, "hidden_ms": _overlap_ns(comm, seg) / k}
                row["exposed_ms"] = row["comm_ms"] - row["hidden_ms"]
                if row["step_ms"] > best.get(run["label"], {}).get("step_ms", -1.0):
                    best[run["label"]] = row
        return pd.DataFrame(list(best.values())).set_index("variant")

    def step_ratio(self, column: str = "emulated_step_s") -> float:
        """ZeRO-3's step / DDP's (``column``: emulated_step_s or predicted_step_s)."""
        return self.value("zero3", column) / self.value("ddp", column)


def emulated_tradeoff(plan, emulated_ranks: int = 8, *, echo: bool = False) -> EmulatedTradeoff:
    """The chapter's emulated run: DDP and ZeRO-1/2/3 (:data:`EMULATED_VARIANTS`) train one step from the same
    weights on ``emulated_ranks`` ranks, one sequence each, emulated on ``plan`` (:func:`emulation_plan`)."""
    from labkit import launch

    runs = [{"variant": v} for v in EMULATED_VARIANTS]
    res = launch(run_rank, emulated_ranks, runs, model=plan["lab_model"], steps=1, global_batch_size=emulated_ranks,
                 seq_len=LAB_SEQ_LEN, emulate=plan, echo=echo)
    return EmulatedTradeoff(res, plan, emulated_ranks)


def tradeoff_findings(t: EmulatedTradeoff) -> str:
    """Sentences about the trade-off, computed from the table: which stages' model states fit the device at
    this degree (none, some: the first that does, or all), how ZeRO-3's emulated step compares with DDP's
    (within 10 %, or how much longer), and the fastest stage that fits."""
    tab = t.table.set_index("variant")
    mem = ", ".join(f"{v} {g:.1f} GB" for v, g in tab["memory_gb"].items())
    out = [f"{t.label}, d={t.n}: model states per rank (predicted, 2+2+12 bytes per parameter) {mem}; "
           f"the {t.emulation.cluster.device.name} holds {t.device_gb:.1f} GB ({t.device_gb * 1e9 / 2**30:.0f} GiB)."]
    fits = tab[tab["fits"]]
    if not len(fits):
        out.append(f"No stage fits at d={t.n}: even ZeRO-3's {tab.loc['zero3', 'memory_gb']:.1f} GB exceeds the "
                   "device — shard over more ranks, or add tensor / pipeline parallelism.")
    elif len(fits) == len(tab):
        out.append("Every stage fits, DDP included: here sharding buys memory the run does not need.")
    else:
        first = fits.sort_values("stage").index[0]
        out.append(f"DDP does not fit; {first} is the first stage that does ({tab.loc[first, 'memory_gb']:.1f} GB).")
    r = t.step_ratio()
    b = t.breakdown()
    z, d = b.loc["zero3"], b.loc["ddp"]
    comm = (f"its communication took {z['comm_ms']:.0f} ms a step against DDP's {d['comm_ms']:.0f} ms, "
            f"{z['hidden_ms']:.0f} ms of it under compute")
    if r <= 1.1:
        out.append(f"ZeRO-3's step is {r:.2f}x DDP's ({t.value('zero3', 'emulated_step_s') * 1e3:.0f} vs "
                   f"{t.value('ddp', 'emulated_step_s') * 1e3:.0f} ms): {comm}; the extra all-gathers cost little "
                   f"here, the compute per step ({z['compute_ms']:.0f} ms) outweighs them.")
    else:
        out.append(f"ZeRO-3's step is {r:.2f}x DDP's ({t.value('zero3', 'emulated_step_s') * 1e3:.0f} vs "
                   f"{t.value('ddp', 'emulated_step_s') * 1e3:.0f} ms): {comm}: {r - 1:.0%} more time per step.")
    for v in ("zero1", "zero2"):
        if v in b.index and t.value(v, "emulated_step_s") < 0.97 * t.value("ddp", "emulated_step_s"):
            x = b.loc[v]
            out.append(f"{v}'s step is shorter than DDP's ({t.value(v, 'emulated_step_s') * 1e3:.0f} vs "
                       f"{t.value('ddp', 'emulated_step_s') * 1e3:.0f} ms) though it sends as many bytes: its "
                       f"compute is {d['compute_ms'] - x['compute_ms']:.0f} ms less (the optimizer updates a 1/{t.n} "
                       f"shard) and {x['hidden_ms']:.0f} of its {x['comm_ms']:.0f} ms of communication ran under "
                       f"compute, against DDP's {d['hidden_ms']:.0f} of {d['comm_ms']:.0f} ms.")
    if len(fits):
        best = fits["emulated_step_s"].idxmin()
        out.append(f"The fastest stage that fits is {best} ({fits.loc[best, 'emulated_step_s'] * 1e3:.0f} ms).")
    return " ".join(out)


def measured_step_findings(table, exposure=None) -> str:
    """What this machine measured for the step times (``summarize`` table: label, step_s), with the direction
    of ZeRO-3 vs DDP stated only as measured (5 % counts as a difference). ``exposure`` (the
    ``exposure_table`` of the same run: label, comm_ms, hidden_ms, exposed_ms, hidden_fraction), when given,
    says how much of ZeRO-3's communication the run hid behind compute — read from the run, never assumed."""
    s = table.set_index("label")["step_s"]
    listed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in s.items())
    out = f"Measured on this machine, per step: {listed}."
    r = s["zero3"] / s["ddp"]
    if r > 1.05:
        if exposure is None:
            return out + f" ZeRO-3 was {r:.2f}x DDP's step: it sends more bytes, in more collectives."
        e = exposure.set_index("label")
        z, d = e.loc["zero3"], e.loc["ddp"]
        return out + (f" ZeRO-3 was {r:.2f}x DDP's step: its communication took {z['comm_ms']:.1f} ms a step "
                      f"against DDP's {d['comm_ms']:.1f} ms, and {z['hidden_fraction']:.0%} of it ran under "
                      f"compute ({z['exposed_ms']:.1f} ms exposed).")
    if r < 0.95:
        return out + (f" ZeRO-3 was faster than DDP here ({r:.2f}x) although it sends more bytes: on this tiny model "
                      "a step is set by per-call and Python overheads (DDP's reducer, AdamW over full tensors "
                      "against shards), not by bytes — the emulated run shows the trade-off at a real model's size.")
    return out + f" ZeRO-3 and DDP took the same time within 5 % ({r:.2f}x): the extra bytes are too few to show."


def memory_figure(both):
    """Model-state bytes per rank by (variant, degree): measured parts stacked, predicted totals as marks."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    fig = go.Figure()
    for part, opacity in (("parameters", 1.0), ("gradients", 0.7), ("optimizer", 0.45)):
        fig.add_bar(x=both["case"], y=both[f"{part}_measured"] / 1e6, name=f"measured ({part})",
                    marker={"color": label_color("measured"), "opacity": opacity})
    for name, y, symbol in (("predicted (calculator, Ψ/d)", both["model_states_predicted"], "line-ew-open"),
                            ("predicted (this layout, rank 0)",
                             both[["layout_parameters", "layout_gradients", "layout_optimizer"]].sum(axis=1),
                             "x-thin-open")):
        fig.add_scatter(x=both["case"], y=y / 1e6, mode="markers", name=name,
                        marker={"symbol": symbol, "size": 24, "line": {"width": 3}, "color": label_color(name)})
    fig.update_layout(barmode="stack", title="Model-state bytes per rank: measured (bars) vs predicted (marks)",
                      yaxis_title="MB (10^6 bytes)", legend={"orientation": "h", "y": -0.3})
    return fig


def bytes_figure(wire, comm):
    """Bytes per rank per step by run: what gloo wrote to its sockets (measured) beside the ring formula of the
    stage (predicted, :func:`labkit.theory.zero.predicted_comm_bytes`)."""
    import plotly.graph_objects as go

    from labkit.experiments.common import SOCKET
    from labkit.style import label_color

    pred = comm.groupby("label", sort=False)[PREDICTED].sum()
    name = "predicted (ring formula: 2(n−1)/n·Ψ, ZeRO-3 3(n−1)/n·Ψ)"
    fig = go.Figure([go.Bar(x=wire["label"], y=wire[SOCKET], name="measured", marker_color=label_color("measured")),
                     go.Scatter(x=pred.index, y=pred.values, mode="markers", name=name,
                                marker={"symbol": "line-ew-open", "size": 40, "line": {"width": 3},
                                        "color": label_color(name)})])
    fig.update_layout(title="Bytes per rank per step: socket bytes written (measured) vs the ring formula",
                      yaxis_title="bytes", legend={"orientation": "h", "y": -0.3})
    return fig


def tradeoff_figure(tradeoffs):
    """Step time (emulated, and predicted: compute + the stage's collectives, nothing overlapped; log scale)
    against model states per rank (predicted, log scale) for each of ``tradeoffs`` (EmulatedTradeoff, e.g. one
    per cluster), one point per stage, with the device's memory as a vertical line."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    fig = go.Figure()
    dashes = iter(("solid", "dot", "dashdot", "longdash"))
    for t in tradeoffs:
        tab, dash = t.table.sort_values("stage"), next(dashes, "solid")
        fig.add_scatter(x=tab["memory_gb"], y=tab["emulated_step_s"] * 1e3, mode="lines+markers+text",
                        text=tab["variant"], textposition="top center", name=t.label,
                        line={"color": label_color(t.label), "dash": dash})
        name = f"predicted (compute + collectives, {t.plan['cluster']})"
        fig.add_scatter(x=tab["memory_gb"], y=tab["predicted_step_s"] * 1e3, mode="markers", name=name,
                        marker={"symbol": "x-thin-open", "size": 12, "line": {"width": 2},
                                "color": label_color(name)})
    t0 = tradeoffs[0]
    steps = [y for t in tradeoffs for y in (*t.table["emulated_step_s"], *t.table["predicted_step_s"])]
    lo, hi = min(steps) * 1e3 * 0.8, max(steps) * 1e3 * 1.25
    for dev, gb in {t.emulation.cluster.device.name: t.device_gb for t in tradeoffs}.items():
        fig.add_scatter(x=[gb, gb], y=[lo, hi], mode="lines+text", text=["", f"{dev}: {gb:.1f} GB"],
                        textposition="bottom left", name=f"memory of one {dev}", hoverinfo="skip",
                        line={"color": "#999", "dash": "dot", "width": 1.5})
    fig.update_layout(title=f"The ZeRO trade-off at d={t0.n}, as {t0.plan['model']}: memory per rank vs step time",
                      xaxis_title="model states per rank, GB (predicted)", yaxis_title="step, ms",
                      xaxis_type="log", yaxis_type="log", legend={"orientation": "h", "y": -0.3})
    return fig


def byte_ratios(table, wire, model: str) -> str:
    """The ZeRO-3 / DDP and FSDP2 / DDP byte ratios, ring model and socket bytes, beside the paper's 1.5."""
    from labkit.experiments.common import RING, SOCKET
    from labkit.theory.spec import get_spec
    from labkit.theory.zero import root_params

    spec = get_spec(model)
    psi, ring, sock = spec.n_params(), table.set_index("label")[RING], wire.set_index("label")[SOCKET]
    return (f"ring model ZeRO-3 / DDP bytes: {ring['zero3'] / ring['ddp']:.3f} (paper: 1.5; with the root kept "
            f"gathered: {(3 * psi - root_params(spec)) / (2 * psi):.3f}); "
            f"FSDP2 / DDP: {ring['fsdp2'] / ring['ddp']:.3f}"
            f"\nsocket bytes (measured) ZeRO-3 / DDP: {sock['zero3'] / sock['ddp']:.3f}, "
            f"FSDP2 / DDP: {sock['fsdp2'] / sock['ddp']:.3f}")


def check_measured(res, both, comm, table, wire, *, model: str, steps: int, global_batch_size: int,
                   seq_len: int) -> None:
    """The measured run's checks (AssertionError with a message): every variant's replicas identical and equal to
    the single-process reference; measured model-state bytes = this layout's prediction, to the byte; the ring
    model of the logged calls = the formula; 1 < ZeRO-3 / DDP ring bytes <= 1.5; socket bytes within 1-15 % of
    gloo's model."""
    import math

    from labkit.chapters.ch03_data_parallel import assert_parity
    from labkit.experiments.common import RING as TABLE_RING
    from labkit.experiments.common import assert_ranks_identical, per_rank
    from labkit.models import train_reference

    ref = train_reference(model, steps=steps, global_batch_size=global_batch_size, seq_len=seq_len)
    for label in VARIANTS:
        per = per_rank(res, label)
        assert_ranks_identical([r["state"] for r in per], label)
        assert_parity(per[0]["state"], ref["state_dict"], len(res), what=label)
    for row in both.itertuples():
        for part in ("parameters", "gradients", "optimizer", "optimizer_steps"):
            got, want = getattr(row, f"{part}_measured"), getattr(row, f"layout_{part}")
            assert got == want, f"{row.case} {part}: measured {got} != predicted {want}"
    close = [math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(comm[RING], comm[PREDICTED])]
    assert all(close), comm[[not c for c in close]]
    ring = table.set_index("label")[TABLE_RING]
    assert 1.0 < ring["zero3"] / ring["ddp"] <= 1.5, ring.to_dict()
    ratio = wire.set_index("label")["measured / gloo model"].dropna()
    assert ((ratio >= 0.99) & (ratio <= SOCKET_OVERHEAD_MAX)).all(), f"socket bytes / gloo model: {ratio.to_dict()}"


def check_emulated(t: EmulatedTradeoff | None, both=None) -> None:
    """The chapter's checks of what ran, at every value check_chapter accepts (any cluster, 2..16 ranks, any
    preset and charged sequence length): ``both`` (:func:`measured_vs_predicted`) — the *measured* model states
    per rank at the largest degree fall with every stage (DDP > ZeRO-1 > ZeRO-2 > ZeRO-3: the run, not the
    formula); ``t`` (the emulated run) — ZeRO-3's emulated step is no shorter than DDP's, and ZeRO-3's emulated
    communication exceeds DDP's by at least 0.9x the predicted extra all-gather (one more all-gather of the bf16
    parameters, :data:`labkit.experiments.zero_tradeoff.STAGE_COLLECTIVES`: the program must send it; more is
    allowed, per-collective latency adds to it); the label says emulated."""
    if both is not None:
        top = both[both["degree"] == both["degree"].max()].set_index("variant")
        order = [v for v in ("ddp", "zero1", "zero2", "zero3") if v in top.index]
        states = top.loc[order, "model_states_measured"]
        assert (states.diff().dropna() < 0).all(), f"measured model states do not fall with the stage: {dict(states)}"
    if t is None:
        return
    from labkit.experiments.zero_tradeoff import predicted_zero_step_s
    from labkit.theory.spec import get_spec

    assert t.step_ratio() >= 1.0, f"ZeRO-3 emulated step shorter than DDP's: {t.step_ratio():.3f}"
    spec, cl = get_spec(t.plan["model"]), t.emulation.cluster
    extra = (predicted_zero_step_s(cl, spec, t.plan["seq_len"], 1, t.n, 3)["comm_s"]
             - predicted_zero_step_s(cl, spec, t.plan["seq_len"], 1, t.n, 0)["comm_s"]) * 1e3
    b = t.breakdown()
    got = b.loc["zero3", "comm_ms"] - b.loc["ddp", "comm_ms"]
    assert got >= 0.9 * extra, (f"ZeRO-3's emulated communication exceeds DDP's by {got:.1f} ms, less than the "
                                f"predicted extra all-gather {extra:.1f} ms")
    assert t.label.startswith("emulated ("), t.label


def measured_vs_predicted(res, predicted):
    """Rank 0's measured model-state bytes per (degree, variant) merged with ``predicted`` (:func:`predicted_table`):
    columns ``<part>_measured``, ``<part>_predicted``, ``layout_<part>`` and ``case`` ("variant, d=degree")."""
    measured = pd.DataFrame(res[0]["memory"])  # rank 0's live tensors (labkit.runtime.measure)
    measured["model_states"] = measured[["parameters", "gradients", "optimizer"]].sum(axis=1)
    both = predicted.merge(measured, on=["degree", "variant", "stage"], suffixes=("_predicted", "_measured"))
    both["case"] = both["variant"] + ", d=" + both["degree"].astype(str)
    return both
