"""Chapter 08 (expert parallelism): its parameter check, and the ep degrees it accepts.

The strategy is :mod:`labkit.parallel.expert`, the predictions :mod:`labkit.theory.expert`, the rank
functions it launches :func:`labkit.experiments.expert.ep_parity_rank` and
:func:`labkit.experiments.expert.ep_profile_rank`.
"""

from __future__ import annotations

from labkit.chapters.common import check_prediction, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.theory.expert import check_expert_parallel, moe_spec


def check_chapter(*, world_size: int, tokens_per_rank: int, hidden_size: int, ffn_hidden_size: int,
                  n_experts: int, top_k: int, capacity_factor: float | None, capacity_factors, repeats: int,
                  spec: str = "lab-tiny-moe", backend: str = "auto", emulate=None,
                  emulate_world_size: int | None = None, emulate_model: str | None = "mixtral-8x7b",
                  emulate_tokens_per_rank: int = 4096,
                  router_skews=(0.0, 3.0), my_prediction=None) -> dict:
    """Validate chapter 08's parameters before anything is launched (the chapter's first code cell).

    Raises ValueError naming the value and the fix: world_size < 2 (expert parallelism needs ranks to move
    tokens between), ep = world_size not dividing n_experts, top_k outside 1..n_experts, a capacity factor
    that is not > 0, ``capacity_factors`` empty or not increasing (the sweep's check reads the dropped
    fraction falling along it), non-positive sizes or repeats, a ``spec`` that is not an MoE preset, a
    backend the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`), an ``emulate`` profile
    that cannot hold ``emulate_world_size`` ranks (None: max(8, world_size)), an ``emulate_model`` that is not
    an MoE preset, ``router_skews`` not starting at 0 or not increasing, or a ``my_prediction`` that is not None
    or a number in [0, 1].

    Returns ``{"emulate_world_size", "eps"}``: the ep degrees of the emulated run (divisors >= 2 of
    emulate_world_size that divide n_experts), None without ``emulate``.
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("08", world_size, why="expert parallelism spreads the experts over ranks and "
                                  "moves tokens between them with all-to-all")
    for name, value in (("tokens_per_rank", tokens_per_rank), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size), ("repeats", repeats)):
        positive_int(name, value)
    if positive_int("n_experts", n_experts) % world_size:
        valid = chapter_ep_degrees(n_experts)
        fix = (f"world_size (= ep) values that pass every rule of chapter 08 with n_experts={n_experts}: "
               f"{', '.join(map(str, valid))}" if valid else
               f"no world_size >= 2 divides n_experts={n_experts}: choose an n_experts with a divisor >= 2, e.g. "
               "n_experts=8")
        raise ValueError(f"ep=world_size={world_size} does not divide n_experts={n_experts} (chapter 08 runs ep = "
                         f"world_size, each rank holding n_experts/ep experts); {fix}; or choose an n_experts it "
                         "divides")
    check_expert_parallel(n_experts, ep=world_size, top_k=top_k, capacity_factor=capacity_factor)
    if isinstance(capacity_factors, (str, bytes)) or not hasattr(capacity_factors, "__iter__"):
        raise ValueError(f"capacity_factors={capacity_factors!r} must be a list of numbers > 0, e.g. [0.5, 1.0, 2.0]")
    cfs = [positive_float("capacity_factors[]", c) for c in capacity_factors]
    if not cfs:
        raise ValueError("capacity_factors=[] is empty; give at least one number > 0, e.g. [0.5, 1.0, 2.0]")
    if any(b <= a for a, b in zip(cfs, cfs[1:])):
        raise ValueError(f"capacity_factors={list(capacity_factors)!r} must be strictly increasing (the sweep reads "
                         f"the dropped fraction falling as capacity grows); e.g. {sorted(set(cfs))}")
    moe_spec(spec)
    resolve_backend(backend, world_size)
    check_prediction(my_prediction, what="a fraction in [0, 1] (your guess of the dropped fraction at capacity_factor "
                     "1.0, e.g. 0.1)", at_least=0.0, at_most=1.0)
    skews = [float(x) for x in router_skews]
    if not skews or skews[0] != 0 or any(b <= a for a, b in zip(skews, skews[1:])):
        raise ValueError(f"router_skews={list(router_skews)!r} must start at 0 (the untrained router) and increase, "
                         "e.g. [0.0, 3.0]")
    if emulate is None:
        return {"emulate_world_size": None, "eps": None}
    ecp = max(8, world_size) if emulate_world_size is None else positive_int("emulate_world_size",
                                                                             emulate_world_size)
    eps = [e for e in range(2, ecp + 1) if ecp % e == 0 and n_experts % e == 0 and e & (e - 1) == 0]
    if not eps:
        raise ValueError(f"emulate_world_size={ecp} has no power-of-two divisor >= 2 that divides "
                         f"n_experts={n_experts}; choose e.g. emulate_world_size=8 with n_experts=8")
    emulation_plan(emulate, ecp, model=emulate_model, tokens_per_rank=emulate_tokens_per_rank,
                   lab_tokens_per_rank=tokens_per_rank, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
    return {"emulate_world_size": ecp, "eps": eps}


def chapter_ep_degrees(n_experts: int) -> list[int]:
    """The world_size (= ep) values chapter 08 accepts for ``n_experts`` (the backend aside): ep >= 2 dividing
    n_experts. Raises ValueError for n_experts < 1."""
    n_experts = positive_int("n_experts", n_experts)
    return [e for e in range(2, n_experts + 1) if n_experts % e == 0]


# ------------------------------------------------------------------------------------------------------
# tables, the emulated run and the sentences written from the numbers
# ------------------------------------------------------------------------------------------------------
def recount_table(rows, *, n_experts: int, top_k: int):
    """Per (placement, capacity factor) of an :func:`labkit.experiments.expert.ep_parity_rank` launch with a
    capacity: the dropped count the EP layer reported beside an independent recount from the routing decisions
    (:func:`labkit.experiments.expert.recount_dropped`), and the tokens on each rank."""
    import pandas as pd

    from labkit.experiments.expert import recount_dropped

    groups: dict = {}
    for row in rows:
        if row["capacity_factor"] is not None:
            groups.setdefault((row["placement"], row["capacity_factor"]), []).append(row)
    return pd.DataFrame([{"placement": p, "capacity_factor": cf, "dropped (EP layer)": grp[0]["global"]["dropped"],
                          "dropped (recounted)": recount_dropped(grp, n_experts=n_experts, top_k=top_k),
                          "tokens per rank": [r["n_local"] for r in grp]}
                         for (p, cf), grp in sorted(groups.items(), key=lambda kv: kv[0][0])])


def emulation_plan(emulate, world_size: int, *, model: str | None, tokens_per_rank: int, lab_tokens_per_rank: int,
                   hidden_size: int, ffn_hidden_size: int):
    """``emulate`` for ``world_size`` ranks, charged as one MoE layer of ``model`` with ``tokens_per_rank`` tokens
    per GPU (:func:`labkit.experiments.expert_emulated.moe_charge`); ``model`` None: the lab's sizes. Raises
    ValueError as :func:`labkit.runtime.emulate.resolve` and ``moe_charge`` do."""
    from labkit.experiments.expert_emulated import moe_charge
    from labkit.runtime.emulate import EmulationPlan, resolve

    plan = resolve(emulate, world_size)
    if model is None:
        return plan
    charge = moe_charge(model=model, tokens_per_rank=tokens_per_rank, lab_tokens_per_rank=lab_tokens_per_rank,
                        lab_hidden_size=hidden_size, lab_ffn_hidden_size=ffn_hidden_size)
    return EmulationPlan(plan.cluster, charge, world_size)


def run_emulated(world_size: int | None, *, emulate, eps, router_skews, tokens_per_rank: int, hidden_size: int,
                 ffn_hidden_size: int, n_experts: int, top_k: int, model: str | None = "mixtral-8x7b",
                 model_tokens_per_rank: int = 4096, backend: str = "auto") -> dict | None:
    """Chapter 08's emulated run: one MoE step per ep of ``eps`` and skew of ``router_skews``
    (:func:`labkit.experiments.expert_emulated.ep_a2a_rank`, one launch of ``world_size`` ranks), charged as
    the ``emulate`` profile would run it (as ``model``'s MoE layer, :func:`emulation_plan`). ``emulate`` None:
    prints that and returns None. Returns :func:`a2a_findings` of the table, with ``table`` and ``result``."""
    from labkit import launch
    from labkit.experiments import expert_emulated as epx

    if emulate is None or world_size is None:
        print("emulate=None: no emulated run; the all-to-all is shown as measured on this machine only.")
        return None
    plan = emulation_plan(emulate, world_size, model=model, tokens_per_rank=model_tokens_per_rank,
                          lab_tokens_per_rank=tokens_per_rank, hidden_size=hidden_size,
                          ffn_hidden_size=ffn_hidden_size)
    res = launch(epx.ep_a2a_rank, world_size, eps=list(eps), skews=list(router_skews), tokens_per_rank=tokens_per_rank,
                 hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, n_experts=n_experts, top_k=top_k,
                 emulate=plan, backend=backend)
    table = epx.a2a_table(res, tokens_per_rank=tokens_per_rank, hidden_size=hidden_size, top_k=top_k)
    out = a2a_findings(table)
    out.update(table=table, result=res)
    return out


#: an all-to-all time within this of another counts as "the same" in :func:`a2a_findings`
SAME_TOLERANCE = 0.10


def a2a_findings(table) -> dict:
    """What an emulated (ep, skew) table (:func:`labkit.experiments.expert_emulated.a2a_table`) shows, in
    sentences computed from it: how the uniform router's all-to-all time moves from the smallest to the largest
    ep, beside the cost model's prediction; and, at the largest ep, what each skew does to the busiest
    receiver and to the all-to-all time (slower / within :data:`SAME_TOLERANCE`). Returns ``{"label",
    "ep_ratio", "skew_ratio" (largest skew over none, largest ep), "skew_slower", "conclusion"}``."""
    label = table["label"].iloc[0]
    base = table[table["skew"] == 0].sort_values("ep")
    lo, hi = base.iloc[0], base.iloc[-1]
    out = {"label": label, "ep_ratio": float(hi["a2a_ms"] / lo["a2a_ms"])}
    trend = ("rises" if out["ep_ratio"] > 1 + SAME_TOLERANCE else
             "falls" if out["ep_ratio"] < 1 - SAME_TOLERANCE else "stays within 10 %")
    parts = [f"{label}, uniform router: the all-to-all time per step {trend} from {lo['a2a_ms']:.3g} ms at "
             f"ep={int(lo['ep'])} to {hi['a2a_ms']:.3g} ms at ep={int(hi['ep'])} (the cost model predicts "
             f"{lo['predicted_a2a_ms']:.3g} → {hi['predicted_a2a_ms']:.3g} ms)."]
    top = table[table["ep"] == hi["ep"]].sort_values("skew")
    out["skew_ratio"] = float(top["a2a_ms"].iloc[-1] / top["a2a_ms"].iloc[0])
    out["skew_slower"] = bool(out["skew_ratio"] > 1 + SAME_TOLERANCE)
    for r in top.iloc[1:].itertuples():
        ratio = r.a2a_ms / top["a2a_ms"].iloc[0]
        what = (f"{ratio:.2f}x as long as with no skew: the busiest rank sets the all-to-all"
                if ratio > 1 + SAME_TOLERANCE else "within 10 % of the time with no skew")
        step = r.step_ms / top["step_ms"].iloc[0]
        parts.append(f"Router skew {r.skew:g} at ep={int(hi['ep'])}: the busiest rank receives "
                     f"{r.busiest_recv_over_mean:.2f}x the mean rows, and the all-to-all takes {r.a2a_ms:.3g} ms, "
                     f"{what}; the whole step takes {r.step_ms:.3g} ms, {step:.2f}x"
                     + (" — every rank waits for the busiest rank's experts." if step > 1 + SAME_TOLERANCE else "."))
    out["conclusion"] = " ".join(parts)
    return out


def a2a_figure(emulated: dict):
    """All-to-all time per step against ep, one emulated line per router skew (each named by the run's label,
    in a legend group titled by its skew), beside the cost model's line for a
    uniform router (``predicted (cost model, uniform router)``)."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    t = emulated["table"]
    fig = go.Figure()
    dashes = ["solid", "dot", "dashdot", "longdashdot"]
    for i, (skew, g) in enumerate(t.groupby("skew")):
        g = g.sort_values("ep")
        fig.add_scatter(x=g["ep"], y=g["a2a_ms"], mode="lines+markers", name=emulated["label"],
                        legendgroup=f"skew {skew:g}", legendgrouptitle_text=f"router skew {skew:g}:",
                        line={"color": label_color(emulated["label"]), "dash": dashes[i % len(dashes)]})
    g = t[t["skew"] == 0].sort_values("ep")
    pred = "predicted (cost model, uniform router)"
    fig.add_scatter(x=g["ep"], y=g["predicted_a2a_ms"], mode="lines+markers", name=pred,
                    line={"color": label_color(pred), "dash": "dash"}, marker={"symbol": "diamond"})
    fig.update_layout(title="all-to-all time per MoE step (forward + backward) against ep and router skew",
                      xaxis={"title": "ep", "type": "log", "tickvals": list(g["ep"])},
                      yaxis={"title": "ms", "rangemode": "tozero"}, height=420, legend={"orientation": "h", "y": -0.25})
    return fig


def dense_vs_moe_finding(dvm) -> str:
    """One sentence on the measured forward time of the MoE beside its dense-active twin (same predicted FLOPs
    per token), from :func:`labkit.experiments.expert.dense_vs_moe`: slower / faster / within 10 %."""
    d = dvm.set_index("model")["forward_ms_measured"]
    r = d["moe"] / d["dense-active"]
    what = ("slower: the router, gathering and scattering rows and several small matmuls cost more than their "
            "FLOPs" if r > 1.1 else "faster, despite the extra routing work" if r < 0.9 else "within 10 %")
    return (f"Measured here: MoE forward {d['moe']:.2f} ms vs dense-active {d['dense-active']:.2f} ms ({r:.2f}x) "
            f"for the same predicted FLOPs per token — {what}.")
