"""Chapter 12 (notebooks/12_serving_under_load.ipynb): serving under load — open-loop arrivals, the knee of a
request-rate sweep, the server's own monitoring, chunked prefill, a hot swap and quantized replicas.

The chapter's parameter check (:func:`check_chapter`, before any launch), the GPU-side prediction
(:func:`gpu_knees`), its figures (:func:`sweep_figure`, :func:`policy_figure`; the dashboard is
:func:`labkit.plots.serving_dashboard_figure`), the checks of its claims (:func:`nothing_lost`) and the
sentences it prints from the numbers (:func:`knee_findings`, :func:`policy_findings`, :func:`swap_findings`,
:func:`quant_findings`). The strategy is :mod:`labkit.parallel.serving`, the predictions
:mod:`labkit.theory.serving`, the launch and its tables :mod:`labkit.experiments.serving_load`.
"""

from __future__ import annotations

import bisect

import pandas as pd
import plotly.graph_objects as go

from labkit.chapters.common import check_fits_in_memory, check_prediction, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.experiments.serving_load import make_load_plan
from labkit.theory import serving as st
from labkit.theory.spec import get_spec

WORKLOAD = {"arrival": "poisson", "trace": None, "short_prompt": (8, 24), "long_prompt": (64, 96),
            "long_fraction": 0.25, "output_len": (4, 12), "max_tokens": None}
POLICY = {"model": "lab-small-llama", "token_budget": 16}
SWAP = {"to": "int8", "drain": "finish"}
GPU_CASE = {"big_model": "llama-2-13b", "gpus": 8, "concurrency": 64, "prompt_len": 1024, "output_len": 256,
            "target_rate": 100.0}


def _group(name: str, value, defaults: dict) -> dict:
    """``defaults`` updated with the dict ``value`` (None: the defaults); ValueError naming an unknown key."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict with keys {', '.join(defaults)}")
    unknown = sorted(set(value) - set(defaults))
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(unknown)}; valid: {', '.join(defaults)}")
    return {**defaults, **value}


_UNSET = object()


def check_chapter(*, world_size, cluster="dgx-h100", my_prediction=None, model=None, concurrency=None,
                  rate_factors=(0.5, 1.0, 3.0), n_requests=None, workload=None, policy=None, swap=None,
                  quality_train_steps=20, gpu_case=None, backend="auto", emulate=_UNSET) -> dict:
    """Chapter 12's parameters as the notebook groups them (``workload``: :data:`WORKLOAD`'s keys, ``policy``:
    :data:`POLICY`'s, ``swap``: :data:`SWAP`'s, ``gpu_case``: :data:`GPU_CASE`'s, each a dict of overrides),
    validated by :func:`check_flat` before anything is launched. ``cluster``: the cluster profile whose GPU
    prices the GPU-side knee table (None: that table is skipped; open-loop serving follows real time, so the
    runs themselves are not emulated — docs/emulation.md "What it cannot represent" — hence not ``emulate``,
    still accepted as the old name of ``cluster``). ``my_prediction``: None
    or a positive number (replicas' knee / TP's knee on these ranks). Returns check_flat's dict plus ``"gpu"``
    (None when cluster is None) and ``"gpu_case"``."""
    if emulate is not _UNSET:
        cluster = emulate
    w, pol, sw = _group("workload", workload, WORKLOAD), _group("policy", policy, POLICY), _group("swap", swap, SWAP)
    g = _group("gpu_case", gpu_case, GPU_CASE)
    check_prediction(my_prediction, what="a positive number (replicas' knee / TP's knee, e.g. 2.0)", above=0.0)
    gpu = None
    if cluster not in (None, False, ""):  # "" and False (as `labkit run -p cluster=` gives) mean off, like None
        from labkit.runtime.emulate import resolve

        gpu = getattr(resolve(cluster, world_size).cluster.device, "name", None)
    out = check_flat(world_size=world_size, model=model, concurrency=concurrency, rate_factors=rate_factors,
                     n_requests=n_requests, **w, policy_model=pol["model"], token_budget=pol["token_budget"],
                     swap_to=sw["to"], swap_drain=sw["drain"], quality_train_steps=quality_train_steps,
                     backend=backend, big_model=g["big_model"], gpus=g["gpus"], gpu=gpu or "h100-80gb",
                     concurrency_gpu=g["concurrency"], prompt_len_gpu=g["prompt_len"], output_len_gpu=g["output_len"],
                     target_rate_gpu=g["target_rate"], my_prediction=None)
    return {**out, "gpu": gpu, "gpu_case": g}


def check_flat(*, world_size, model, concurrency, rate_factors, n_requests, arrival, trace, short_prompt,
               long_prompt, long_fraction, output_len, max_tokens, policy_model, token_budget, swap_to, swap_drain,
               quality_train_steps, backend, big_model, gpus, gpu, concurrency_gpu, prompt_len_gpu, output_len_gpu,
               target_rate_gpu, my_prediction) -> dict:
    """Validate chapter 12's parameters (one keyword each) before anything is launched. Returns
    ``{"plan", "model", "backend", "kwargs"}`` (``kwargs``: what to pass to
    :func:`~labkit.experiments.serving_load.run_load`).

    Raises ValueError naming the value and the valid range: world_size < 2 (replicas vs TP on the same
    ranks, and the prefill-first / chunked pair runs side by side), what
    :func:`~labkit.experiments.serving_load.make_load_plan` refuses (rates or factors <= 0 or NaN, lengths
    beyond the model's context, a swap to a model with another vocabulary, a token budget below one token,
    a concurrency that is not a multiple of world_size, an unreadable trace), a model this machine's memory
    cannot hold, a backend it cannot run, the GPU-side sizes (:func:`gpu_knees`), and a ``my_prediction``
    other than None, "replicas" or "tp" (the flat form's old question)."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("12", world_size, why="replicas vs tensor parallelism on the same ranks, and "
                                  "the two scheduling policies side by side")
    check_prediction(my_prediction, what="'replicas' or 'tp'", choices=("replicas", "tp"))
    kwargs = {"model": model, "concurrency": concurrency, "rate_factors": tuple(rate_factors),
              "n_requests": n_requests, "arrival": arrival, "trace": trace, "short_prompt": short_prompt,
              "long_prompt": long_prompt, "long_fraction": long_fraction, "output_len": output_len,
              "max_tokens": max_tokens, "policy_model": policy_model, "token_budget": token_budget,
              "swap_to": swap_to, "swap_drain": swap_drain, "quality_train_steps": quality_train_steps}
    plan = make_load_plan(world_size, **kwargs)
    check_fits_in_memory(plan["model"], world_size, copies=2, what="chapter 12's serving runs")
    check_fits_in_memory(plan["policies"]["model"], world_size, copies=1, what="chapter 12's policy runs")
    gpu_knees(big_model, gpus=gpus, gpu=gpu, concurrency=concurrency_gpu, prompt_len=prompt_len_gpu,
              output_len=output_len_gpu, target_rate_rps=target_rate_gpu)
    return {"plan": plan, "model": plan["model"], "backend": resolve_backend(backend, world_size), "kwargs": kwargs}


def gpu_knees(big_model: str, *, gpus: int, gpu: str, concurrency: int, prompt_len: int, output_len: int,
              target_rate_rps: float, utilisation: float = 0.8) -> pd.DataFrame:
    """*Predicted* for a published model on one node of ``gpus`` GPUs: per TP degree the knee
    (:func:`labkit.theory.serving.deployment_rows`' ``knee_rps``, requests of prompt_len + output_len tokens,
    ``concurrency`` in flight per node) and how many such nodes keep ``target_rate_rps`` at ``utilisation``
    of their knee (:func:`labkit.theory.serving.replicas_needed`). Deployments that do not fit carry no
    knee. Raises ValueError as deployment_rows, and for a target rate <= 0."""
    target = positive_float("target_rate_gpu (requests/s)", target_rate_rps)
    rows = st.deployment_rows(big_model, gpus=positive_int("gpus", gpus), gpu=gpu,
                              concurrency=positive_int("concurrency_gpu", concurrency),
                              prompt_len=positive_int("prompt_len_gpu", prompt_len),
                              output_len=positive_int("output_len_gpu", output_len))
    out = []
    for r in rows:
        ok = r["fits"] and r["knee_rps"] == r["knee_rps"]
        out.append({"tp": r["tp"], "replicas": r["replicas"], "fits": r["fits"], "ttft_s": r["ttft_s"],
                    "tpot_s": r["tpot_s"], "knee_rps": r["knee_rps"],
                    f"nodes_for_{target:g}_rps": st.replicas_needed(target, r["knee_rps"], utilisation=utilisation)
                    if ok else None, "source": "predicted (labkit.theory.serving)"})
    return pd.DataFrame(out)


# ------------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------------
def sweep_figure(sweep: pd.DataFrame, knee: pd.DataFrame, title: str | None = None) -> go.Figure:
    """The request-rate sweep, per mode: TTFT p95 (left, log), requests completed per second (middle: the
    offered rate as a grey diagonal, flattening at the knee) and the queue's growth (right), all *measured*
    against the offered rate; the knee of each mode *predicted* (dashed), *forecast* (dash-dot) and
    *measured* (dotted) as vertical lines (:func:`labkit.experiments.serving_metrics.knee_table`)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT p95 (s)", "completed requests/s",
                                                        "queue growth (requests/s)"), horizontal_spacing=0.07)
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c")
    shapes = []
    for i, (mode, g) in enumerate(sweep.sort_values("rate_rps").groupby("mode", sort=False)):
        c = palette[i % 3]
        for col, y in ((1, "ttft_p95_s"), (2, "achieved_rps"), (3, "queue_growth_rps")):
            fig.add_trace(go.Scatter(x=g["rate_rps"], y=g[y], mode="lines+markers", line={"color": c},
                                     name=f"measured, {mode}", legendgroup=mode, showlegend=col == 1), row=1, col=col)
        k = knee[knee["mode"] == mode]
        for name, dash in (("knee_predicted_rps", "dash"), ("knee_forecast_rps", "dashdot"),
                           ("knee_measured_rps", "dot")):
            x = k[name].iloc[0] if len(k) else float("nan")
            if x == x:  # one shape per panel (add_vline per panel is slow)
                shapes += [{"type": "line", "x0": float(x), "x1": float(x), "y0": 0, "y1": 1, "xref": ax,
                            "yref": f"y{ax[1:]} domain", "line": {"color": c, "dash": dash, "width": 1}}
                           for ax in ("x", "x2", "x3")]
    top = float(sweep["rate_rps"].max())
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", line={"color": "#aaa", "dash": "dash"},
                             name="offered = completed"), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title="offered rate (requests/s)")
    fig.update_layout(shapes=shapes)
    fig.update_layout(title=title or "a request-rate sweep: the knee predicted (dashed), forecast (dash-dot), "
                      "measured (dotted)",
                      legend={"font": {"size": 10}})
    return fig


def policy_figure(classes: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Prefill-first vs chunked prefill, per request class: ITL p95 (left) and TTFT p95 (right), *measured*."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("inter-token latency p95 (ms)", "TTFT p95 (ms)"))
    for i, (policy, g) in enumerate(classes.groupby("policy", sort=False)):
        for col, y in ((1, "itl_p95_s"), (2, "ttft_p95_s")):
            fig.add_trace(go.Bar(x=g["kind"], y=g[y] * 1e3, name=f"measured, {policy}", legendgroup=policy,
                                 marker_color=("#1f77b4", "#ff7f0e")[i % 2], showlegend=col == 1), row=1, col=col)
    fig.update_layout(barmode="group", title=title or "scheduling: prefill-first vs chunked prefill, per class")
    return fig


# ------------------------------------------------------------------------------------------------------
# checks and sentences computed from the numbers
# ------------------------------------------------------------------------------------------------------
def nothing_lost(records: pd.DataFrame, n_requests: int) -> dict:
    """For one experiment's records: every request must end (its last attempt) ``ok`` or ``cancelled`` by
    its client — a preempted attempt must have been retried. Returns ``{"requests", "ok", "cancelled",
    "retried", "lost": [rids whose last attempt is anything else, or that never appear]}``."""
    last = records.sort_values("attempt").groupby("rid").tail(1)
    bad = sorted(set(last.loc[~last["status"].isin(["ok", "cancelled"]), "rid"])
                 | (set(range(n_requests)) - set(last["rid"])))
    return {"requests": int(records["rid"].nunique()), "ok": int((last["status"] == "ok").sum()),
            "cancelled": int((last["status"] == "cancelled").sum()),
            "retried": int((records["attempt"] > 1).sum()), "lost": bad}


def _queue_trend(growth_rps: float, rate_rps: float) -> str:
    """A queue's measured growth rate (requests/s, signed) in words whose direction is the number's: "grew by
    X requests/s", "shrank by X requests/s" (negative: it drained), or "stayed level (X requests/s)" when
    the absolute value is under 5 % of the offered ``rate_rps`` — never "grew by -6.7"."""
    g = float(growth_rps)
    if abs(g) < 0.05 * max(float(rate_rps), 1e-9):
        return f"stayed level ({g:+.1f} requests/s)"
    return f"grew by {g:.1f} requests/s" if g > 0 else f"shrank by {-g:.1f} requests/s"


def knee_findings(knee: pd.DataFrame, sweep: pd.DataFrame) -> list[str]:
    """Per mode: the knee measured, predicted (on the saturated forward passes) and forecast (on unloaded
    step costs), and what TTFT p95 and the queue did from the lowest to the highest offered rate. Every
    number from the tables; raises ValueError for tables without their columns."""
    need = {"mode", "knee_measured_rps", "knee_predicted_rps", "knee_forecast_rps"}
    if need - set(knee.columns) or {"mode", "rate_rps", "ttft_p95_s", "queue_growth_rps"} - set(sweep.columns):
        raise ValueError("pass run_load(...)['knee'] and run_load(...)['sweep']")
    out = []
    for _, k in knee.iterrows():
        g = sweep[sweep["mode"] == k["mode"]].sort_values("rate_rps")
        lo, hi = g.iloc[0], g.iloc[-1]
        out.append(f"{k['mode']}: knee measured {k['knee_measured_rps']:.1f} req/s (the service rate while requests "
                   f"waited); predicted {k['knee_predicted_rps']:.1f} req/s from the forward passes of those "
                   f"stretches ({k['measured_over_predicted']:.2f}x), forecast {k['knee_forecast_rps']:.1f} req/s from "
                   f"step costs measured unloaded before each run ({k['measured_over_forecast']:.2f}x); from "
                   f"{lo['rate_rps']:.1f} to {hi['rate_rps']:.1f} req/s offered, TTFT p95 went from "
                   f"{lo['ttft_p95_s'] * 1e3:.0f} to {hi['ttft_p95_s'] * 1e3:.0f} ms; the queue "
                   f"{_queue_trend(lo['queue_growth_rps'], lo['rate_rps'])} at the lowest rate and "
                   f"{_queue_trend(hi['queue_growth_rps'], hi['rate_rps'])} at the highest (measured).")
    if set(knee["mode"]) >= {"replicas", "tp"}:
        r = knee.set_index("mode")["knee_measured_rps"]
        better = "replicas" if r["replicas"] > r["tp"] else "tp"
        out.append(f"On these ranks {better} sustained the higher rate ({r[better]:.1f} vs "
                   f"{r['tp' if better == 'replicas' else 'replicas']:.1f} req/s, measured).")
    return out


def policy_findings(classes: pd.DataFrame) -> list[str]:
    """Per request class: ITL p95 and TTFT p95 with prefill-first vs chunked prefill (measured)."""
    out = []
    for kind, g in classes.groupby("kind"):
        r = g.set_index("policy")
        if not {"prefill_first", "chunked"} <= set(r.index):
            continue
        a, b = r.loc["prefill_first"], r.loc["chunked"]
        out.append(f"{kind} prompts: ITL p95 {a['itl_p95_s'] * 1e3:.1f} ms prefill-first vs {b['itl_p95_s'] * 1e3:.1f} "
                   f"ms chunked ({b['itl_p95_s'] / a['itl_p95_s']:.2f}x); TTFT p95 {a['ttft_p95_s'] * 1e3:.0f} vs "
                   f"{b['ttft_p95_s'] * 1e3:.0f} ms ({b['ttft_p95_s'] / a['ttft_p95_s']:.2f}x) (measured).")
    return out


def swap_findings(info: pd.DataFrame, compare: pd.DataFrame, lost: dict) -> list[str]:
    """The hot swap: drain, swap and pause time per replica, TTFT / TPS before vs after, what was lost."""
    out = []
    for _, r in info[info["swap_s"].notna()].iterrows():
        out.append(f"replica {int(r['instance'])}: drained {r['in_flight_at_trigger']} in-flight request(s) in "
                   f"{r['drain_s'] * 1e3:.0f} ms ({r['drain']}), swapped {r['from']} -> {r['to']} in "
                   f"{r['swap_s'] * 1e3:.0f} ms: paused {r['pause_s'] * 1e3:.0f} ms (measured).")
    if len(compare) == 2:
        a, b = compare.iloc[0], compare.iloc[1]
        out.append(f"TTFT p50 {a['ttft_p50_s'] * 1e3:.0f} ms before vs {b['ttft_p50_s'] * 1e3:.0f} ms after (the "
                   f"queue that built up during the pause), TPS p50 {a['tps_p50']:.0f} vs {b['tps_p50']:.0f} tok/s "
                   "(measured).")
    out.append(f"{lost['requests']} requests: {lost['ok']} served, {lost['cancelled']} cancelled by their clients, "
               f"{lost['retried']} retried, {len(lost['lost'])} lost.")
    return out


def quant_findings(quant: pd.DataFrame) -> list[str]:
    """Weight bytes measured vs predicted, quality and speed of each weight dtype against fp32."""
    q = quant.set_index("weight_dtype")
    out = []
    for wd in q.index:
        r = q.loc[wd]
        line = (f"{wd}: {r['weight_bytes_measured']:,} bytes of weights measured, {r['weight_bytes_predicted']:,} "
                f"predicted ({r['weight_bytes_measured'] / q.loc['fp32', 'weight_bytes_measured']:.2f}x fp32)")
        if "perplexity" in q.columns and r["perplexity"] == r["perplexity"]:
            line += (f"; perplexity {r['perplexity']:.2f} (fp32 {q.loc['fp32', 'perplexity']:.2f}), top-1 agreement "
                     f"{r['top1_agreement']:.1%}, greedy tokens alike {r['greedy_agreement']:.1%}")
        line += f"; TPS p50 {r['tps_p50']:.0f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms (measured)."
        out.append(line)
    return out


def exercise_reference(prefill_ms: float, decode_step_ms: float, concurrency: int, new_tokens: float) -> float:
    """The exercise's answer: :func:`labkit.theory.serving.knee_rate` for one instance (requests/s)."""
    return st.knee_rate(prefill_s=prefill_ms / 1e3, decode_step_s=decode_step_ms / 1e3, concurrency=concurrency,
                        new_tokens=new_tokens)


def model_name(plan: dict) -> str:
    """The serving model of a plan, with its size (for the chapter's first print)."""
    spec = get_spec(plan["model"])
    return f"{spec.name}: {spec.n_layers} layers, hidden {spec.hidden_size}, {spec.n_params() / 1e6:.2f} M parameters"


# ------------------------------------------------------------------------------------------------------
# the chapter shape: the reader's guess, the verdicts, the checks
# ------------------------------------------------------------------------------------------------------
def knee_ratio(knee: pd.DataFrame, column: str = "knee_measured_rps") -> float | None:
    """Replicas' knee / TP's knee in ``column`` of :func:`~labkit.experiments.serving_metrics.knee_table`
    (None when a mode is missing)."""
    k = knee.set_index("mode")[column]
    if not {"replicas", "tp"} <= set(k.index) or not k["tp"] > 0:
        return None
    return float(k["replicas"] / k["tp"])


def policy_verdict(classes: pd.DataFrame) -> str:
    """One sentence: for which request classes chunked prefill lowered ITL p95 below prefill-first, and which
    way it moved TTFT p95 (measured)."""
    c = classes.set_index(["kind", "policy"])
    kinds = sorted(set(classes["kind"]))
    lower = [k for k in kinds if c.loc[(k, "chunked"), "itl_p95_s"] < c.loc[(k, "prefill_first"), "itl_p95_s"]]
    slower = [k for k in kinds if c.loc[(k, "chunked"), "ttft_p95_s"] > c.loc[(k, "prefill_first"), "ttft_p95_s"]]
    itl = ("for every class" if len(lower) == len(kinds) else
           f"for {', '.join(lower)} prompts only" if lower else "for no class")
    ttft = (f"raised TTFT p95 for {', '.join(slower)} prompts" if slower else "raised TTFT p95 for no class")
    return f"Chunked prefill lowered ITL p95 {itl} and {ttft} (measured)."


def quant_verdict(quant: pd.DataFrame) -> str:
    """One sentence: whether each quantized dtype served faster or slower than fp32 here (TPS p50, measured)."""
    q = quant.set_index("weight_dtype")
    parts = []
    for wd in q.index:
        if wd == "fp32":
            continue
        r = q.loc[wd, "tps_p50"] / q.loc["fp32", "tps_p50"]
        parts.append(f"{wd} {'slower' if r < 1 else 'faster'} than fp32 ({r:.2f}x TPS p50)")
    return "On this machine: " + "; ".join(parts) + " (measured)."


def sweep_keys() -> list[str]:
    """The sweep table's key columns (the full table is one click away)."""
    return ["mode", "rate_rps", "achieved_rps", "saturated_rps", "ttft_p95_s", "queue_growth_rps", "source"]


#: measured knee / predicted knee a correct run stays within: below 1 by the engine's time outside forward passes
#: and by batches that are not full. Measured on 2 cores: 0.67-0.86 unloaded, 0.60 (replicas) with one core
#: busy with other work, 0.61-0.68 for TP at world_size 4; the floor leaves that load room, the ceiling 35 %.
KNEE_VS_PREDICTED = (0.4, 1.35)


#: past the knee a request's TTFT must exceed one's below it in more than this share of all pairs
TTFT_GROWTH_MIN = 0.5


def ttft_growth(records: pd.DataFrame, mode: str, lo_rate: float, hi_rate: float) -> float:
    """The probability that a request served at ``hi_rate`` waited longer for its first token than one served at
    ``lo_rate`` (the sweep runs of ``mode``, ``ok`` requests; ties count one half): the Mann-Whitney U statistic
    over the product of the two sizes (Mann & Whitney 1947, Ann. Math. Statist. 18(1); "common-language effect
    size", McGraw & Wong 1992). 0.5 when neither run is slower; 1.0 when every request past the knee waited
    longer than every one below it. A handful of requests delayed by other work on the machine moves it by
    their share only, where it decides a comparison of two p95s. Raises ValueError when either run has no
    ``ok`` request."""
    r = records[(records["experiment"] == "sweep") & (records["mode"] == mode) & (records["status"] == "ok")]
    lo = sorted(r.loc[r["rate_rps"] == lo_rate, "ttft_s"])
    hi = r.loc[r["rate_rps"] == hi_rate, "ttft_s"].tolist()
    if not lo or not hi:
        raise ValueError(f"{mode}: no ok sweep request at rate {lo_rate if not lo else hi_rate} req/s "
                         f"(rates: {sorted(set(r['rate_rps']))})")
    wins = sum(bisect.bisect_left(lo, t) + 0.5 * (bisect.bisect_right(lo, t) - bisect.bisect_left(lo, t))
               for t in hi)
    return wins / (len(lo) * len(hi))


def check_run(run: dict, lost: dict, swap_recs: pd.DataFrame) -> str:
    """Every check of chapter 12's run (AssertionError naming what is wrong): the knee within its stated
    tolerance of the prediction and the forecast, the queue and TTFT growing past it (:func:`ttft_growth`),
    percentiles in order, KV bytes measured = predicted at every step, chunked prefill lowering ITL p95 for both
    classes, the hot swap losing nothing, and the quantized weights' bytes and quality. Returns "all checks passed"."""
    sweep, series, classes = run["sweep"], run["series"], run["classes"]
    k = run["knee"].set_index("mode")
    # the knee: measured within KNEE_VS_PREDICTED of the model on the forward passes the server made (below it by
    # the engine's time outside them and batches not full); the forecast from unloaded costs within a factor 3
    lo_k, hi_k = KNEE_VS_PREDICTED
    for mode, r in k.iterrows():
        assert lo_k <= r["measured_over_predicted"] <= hi_k, f"{mode}: knee measured " \
            f"{r['knee_measured_rps']:.1f} vs predicted {r['knee_predicted_rps']:.1f} req/s (allowed " \
            f"{lo_k}..{hi_k} x):\n{run['knee']}"
        assert 1 / 3 <= r["measured_over_forecast"] <= 3, \
            f"{mode}: the forecast was off by more than 3x:\n{run['knee']}"
    for mode, g in sweep.groupby("mode"):
        g = g.sort_values("rate_rps")
        lo, hi = g.iloc[0], g.iloc[-1]
        # the queue's longest length, not its slope: above the knee the requests arrive within a few server
        # steps, where a slope is noise (tests/test_serving.py). TTFT: every request of the two runs, not one
        # percentile of each (a few requests delayed by other work on the machine move a p95, not a majority)
        share = ttft_growth(run["records"], mode, lo["rate_rps"], hi["rate_rps"])
        assert hi["queue_max"] > lo["queue_max"] and share > TTFT_GROWTH_MIN, \
            f"{mode}: the queue and TTFT should grow past the knee (P(TTFT at {hi['rate_rps']:.1f} req/s > TTFT at " \
            f"{lo['rate_rps']:.1f} req/s) = {share:.2f}, needs > {TTFT_GROWTH_MIN}):\n{g}"
    order = ((sweep["ttft_p50_s"] <= sweep["ttft_p95_s"]) & (sweep["ttft_p95_s"] <= sweep["ttft_p99_s"])
             & (sweep["itl_p50_s"] <= sweep["itl_p95_s"]) & (sweep["tps_p5"] <= sweep["tps_p50"]))
    assert order.all(), f"a percentile is out of order:\n{sweep[~order]}"
    off = series[series["kv_bytes_measured"] != series["kv_bytes_predicted"]]
    assert off.empty, f"KV bytes measured != predicted at {len(off)} rows:\n{off.head()}"
    assert (series["kv_bytes_used"] <= series["kv_bytes_measured"]).all(), "more KV written than reserved"
    c = classes.set_index(["kind", "policy"])["itl_p95_s"]
    for kind in ("short", "long"):
        assert c[(kind, "chunked")] < c[(kind, "prefill_first")], \
            f"{kind}: chunked ITL p95 not below prefill-first:\n{c}"
    info = run["swap_info"]
    assert info["swap_s"].notna().all() and (info["swap_s"] > 0).all(), f"a replica did not swap:\n{info}"
    assert not lost["lost"] and lost["ok"] + lost["cancelled"] == run["swap_requests"], f"requests lost: {lost}"
    assert (swap_recs["model_version"] == 1).any(), "no request was served after the swap"
    q = run["quant"].set_index("weight_dtype")
    assert (q["weight_bytes_measured"] == q["weight_bytes_predicted"]).all(), f"weight bytes off:\n{q}"
    assert q.loc["int8", "top1_agreement"] >= 0.95, f"int8 changed the top-1 token too often:\n{q}"
    assert abs(q.loc["int8", "perplexity"] / q.loc["fp32", "perplexity"] - 1) < 0.01, f"int8 perplexity moved:\n{q}"
    w = q["weight_bytes_measured"]
    assert w["int4"] < w["int8"] < w["fp32"], f"int4 < int8 < fp32 weight bytes does not hold:\n{q}"
    return "all checks passed"
