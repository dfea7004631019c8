"""Chapter 10 (notebooks/10_serving.ipynb): serving — KV cache, replicas vs tensor parallelism, what breaks.

The chapter's parameter check (:func:`check_chapter`, before any launch), the analytic question's table
(:func:`predict_deployments`, a DataFrame of :func:`labkit.theory.serving.deployment_rows`) and its
refusal when nothing fits (:func:`check_deployments_fit`), and the sentences it prints from the numbers
(:func:`ramp_findings`, :func:`deployment_findings`). The strategy is :mod:`labkit.parallel.serving`, its
formulas :mod:`labkit.theory.serving`, the rank function and the measured tables
:mod:`labkit.experiments.serving`.
"""

from __future__ import annotations

import math

import pandas as pd

from labkit.chapters.common import check_fits_in_memory, check_prediction, check_world_size
from labkit.checks import positive_int
from labkit.experiments.serving import default_model, make_plan
from labkit.theory import memory as mem
from labkit.theory import serving as st
from labkit.theory.spec import ModelSpec, get_spec


def check_chapter(*, world_size: int, model: str | None, n_requests: int, prompts=(16, 96), output_len: int,
                  ramp, cancel_step: int | None, lose_at_step: int | None, big_model: str, gpus: int,
                  gpu: str | None, concurrency_gpu: int, lens_gpu=(128, 128), emulate="dgx-h100", my_prediction=None,
                  detect_timeout_s: float = 1.0, backend: str = "auto", sweep_gpu=None) -> dict:
    """Validate chapter 10's parameters before anything is launched (the chapter's first code cell). Returns
    ``{"model", "plan", "backend", "gpu", "link", "sweep", "short_prompt", "long_prompt", "prompt_len_gpu",
    "output_len_gpu"}``: ``prompts`` = (short, long) prompt tokens of the lab workload, ``lens_gpu`` = (prompt,
    output) tokens of the GPU-side requests; the model name (``model`` or
    :func:`default_model`), :func:`make_plan`'s plan, the backend the launch will use, the GPU and link of the
    GPU-side questions (``gpu``, or the ``emulate`` profile's GPU and NVLink; h100-80gb when both are None) and
    the concurrencies of the crossover sweep (``sweep_gpu`` or :func:`default_sweep`).

    Raises ValueError naming the value and the fix: world_size < 2 (replicas vs TP needs two ranks to split or
    replicate over), anything :func:`make_plan` refuses (tp = world_size not dividing the model's heads or kv
    heads, a concurrency that is not a multiple of world_size, a request longer than the model's max_seq_len,
    steps < 1, cancel_step or lose_at_step >= output_len), a model this machine's memory cannot hold, a backend
    the machine cannot run, what :func:`predict_deployments` refuses (unknown big model or GPU, sizes < 1), and
    a big model that fits on no TP degree of gpus x gpu (:func:`check_deployments_fit`), an ``emulate`` the
    emulator refuses (unknown profile, a world size its nodes cannot hold), a ``sweep_gpu`` concurrency < 1,
    and a ``my_prediction`` that is not None or a positive number (sequences in flight)."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("10", world_size, why="replicas vs tensor parallelism on the same ranks")
    check_prediction(my_prediction, what="a positive number of sequences in flight (e.g. 256)", above=0.0)
    if emulate not in (None, False, ""):  # "" and False (as `labkit run -p emulate=` gives) mean off, like None
        from labkit.runtime.emulate import resolve

        resolve(emulate, world_size)
    short_prompt, long_prompt = _pair("prompts", prompts)
    prompt_len_gpu, output_len_gpu = _pair("lens_gpu", lens_gpu)
    prof_gpu, link = cluster_gpu(emulate)
    gpu = gpu or prof_gpu
    sweep = [positive_int("sweep_gpu concurrency", c) for c in sweep_gpu] if sweep_gpu else default_sweep(gpus)
    model = model or default_model(world_size)
    try:
        st.check_tp(get_spec(model), world_size)
    except ValueError as e:
        raise ValueError(f"chapter 10 runs tp = world_size={world_size} on {model}: {e}") from None
    plan = make_plan(world_size, model=model, n_requests=positive_int("n_requests", n_requests),
                     short_prompt=positive_int("short_prompt", short_prompt),
                     long_prompt=positive_int("long_prompt", long_prompt),
                     output_len=positive_int("output_len", output_len), ramp=ramp, cancel_step=cancel_step,
                     lose_at_step=lose_at_step, detect_timeout_s=detect_timeout_s)
    check_fits_in_memory(plan["model"], world_size, copies=1, what="chapter 10's serving runs")
    sizes = {"gpus": positive_int("gpus", gpus), "gpu": gpu,
             "concurrency": positive_int("concurrency_gpu", concurrency_gpu),
             "prompt_len": positive_int("prompt_len_gpu", prompt_len_gpu),
             "output_len": positive_int("output_len_gpu", output_len_gpu)}
    check_deployments_fit(predict_deployments(big_model, **sizes), big_model, **sizes)
    return {"model": plan["model"], "plan": plan, "backend": resolve_backend(backend, world_size), "gpu": gpu,
            "link": link, "sweep": sweep, "short_prompt": short_prompt, "long_prompt": long_prompt,
            "prompt_len_gpu": prompt_len_gpu, "output_len_gpu": output_len_gpu, "detect_timeout_s": detect_timeout_s}


def _pair(name: str, value) -> tuple[int, int]:
    """``value`` as two positive ints (ValueError naming ``name`` otherwise)."""
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be two token counts, e.g. (16, 96)") from None
    return positive_int(f"{name}[0]", a), positive_int(f"{name}[1]", b)


# ------------------------------------------------------------------------------------------------------
# predicted: replicas vs TP for a published model on real GPUs (no launch)
# ------------------------------------------------------------------------------------------------------
def predict_deployments(model: str | ModelSpec = "llama-2-13b", **kwargs) -> pd.DataFrame:
    """:func:`labkit.theory.serving.deployment_rows` as a DataFrame (one row per TP degree, every number
    *predicted*; the keyword arguments and errors are that function's)."""
    return pd.DataFrame(st.deployment_rows(model, **kwargs))


def check_deployments_fit(pred: pd.DataFrame, model: str | ModelSpec, *, gpus: int, gpu: str,
                          concurrency: int, prompt_len: int, output_len: int) -> None:
    """Raise ValueError unless at least one row of ``pred`` (:func:`predict_deployments` of ``model`` on
    ``gpus`` x ``gpu`` with these sizes) fits in memory. The message names the closest deployment and its
    shortfall per GPU, and what would fit instead: every GPU of data/hardware.yaml with peak and bandwidth data
    on which some TP degree fits, the largest preset of data/models.yaml that fits here, and more GPUs only
    when a larger TP degree exists (tp must divide the model's heads, kv heads and ffn_hidden_size)."""
    from labkit.theory.spec import presets

    if pred["fits"].any():
        return
    spec = get_spec(model) if isinstance(model, str) else model
    best = pred.loc[pred["peak_bytes_per_gpu"].idxmin()]
    short = (best["peak_bytes_per_gpu"] - best["device_bytes"]) / mem.GiB
    sizes = {"concurrency": concurrency, "prompt_len": prompt_len, "output_len": output_len}

    def fits(m, g, n):
        return st.any_fits(m, gpus=n, gpu=g, **sizes)

    gpus_ok = [g for g in st.gpus_with_data() if g != gpu and fits(spec, g, gpus)]
    fixes = []
    more = [n for n in (2 * gpus, 4 * gpus) if fits(spec, gpu, n)]
    if more:
        fixes.append(f"more GPUs (gpus={more[0]})")
    if gpus_ok:
        fixes.append(f"a GPU with more memory (gpu={' or '.join(repr(g) for g in gpus_ok)})")
    smaller = sorted(((p.n_params(), n) for n, p in presets().items()
                      if p.n_params() < spec.n_params() and not n.startswith("lab-")), reverse=True)
    smaller = [n for _, n in smaller if fits(n, gpu, gpus)][:1]
    if smaller:
        fixes.append(f"a smaller model (the largest preset that fits: big_model={smaller[0]!r})")
    max_tp = math.gcd(spec.n_heads, spec.n_kv_heads, spec.ffn_hidden_size)
    tail = "" if more else (f"; more GPUs alone would not (tried gpus={2 * gpus} and {4 * gpus}: tp can be at most "
                            f"{max_tp}, the largest divisor of n_heads, n_kv_heads and ffn_hidden_size, and more "
                            f"replicas do not shrink one; splitting it further needs pipeline parallelism, not "
                            f"modelled here)")
    raise ValueError(f"big_model={spec.name!r} fits on no deployment of {gpus} x {gpu} ({concurrency} sequences of "
                     f"{prompt_len} + {output_len} tokens): the closest is tp={int(best['tp'])} x "
                     f"{int(best['replicas'])} replica(s) at {best['peak_bytes_per_gpu'] / mem.GiB:.1f} GiB per GPU "
                     f"> {best['device_bytes'] / mem.GiB:.1f} GiB, short by {short:.1f} GiB; what would fit: "
                     f"{'; or '.join(fixes) or 'none of the presets or GPUs in data/'}{tail}")


# ------------------------------------------------------------------------------------------------------
# sentences computed from the numbers
# ------------------------------------------------------------------------------------------------------
def _trend(what: str, concs: list, values: list, fmt: str, unit: str) -> str:
    """'what rose from A unit at concurrency c1 to B unit at c2, then fell to C unit at c3' (one clause per
    change of direction; 'stayed at' for equal values)."""
    def word(a, b):
        return "rose" if b > a else "fell" if b < a else "stayed"

    def v(x):
        return f"{format(x, fmt)} {unit}"

    parts, i = [], 0
    while i < len(values) - 1:
        j, w = i + 1, word(values[i], values[i + 1])
        while j < len(values) - 1 and word(values[j], values[j + 1]) == w:
            j += 1
        start = f"from {v(values[i])} at concurrency {concs[i]} " if not parts else ""
        parts.append(f"{w} {start}{'at' if w == 'stayed' else 'to'} {v(values[j])} at {concs[j]}")
        i = j
    return f"{what} " + ", then ".join(parts) if parts else f"{what} was {v(values[0])} (one concurrency)"


def ramp_findings(summary: pd.DataFrame) -> list[str]:
    """What *this* run measured along the concurrency ramp, as sentences computed from
    :func:`~labkit.experiments.serving.summarize`'s table (so the chapter's prose cannot contradict its
    data): per mode, how TTFT p50, TPS p50 per request and total throughput moved with concurrency (each
    change of direction named), how far TPS p5 (the slow tail) sat below p50 at the top concurrency; TP
    against replicas on
    throughput at each concurrency, and the share of TP rank 0's prefill + decode time spent inside
    collectives. Every number is *measured*. Raises ValueError for a table without the columns of
    summarize."""
    need = {"mode", "concurrency", "ttft_p50_s", "tps_p50", "tps_p5", "throughput_tok_s", "comm_s", "prefill_s",
            "decode_s"}
    missing = sorted(need - set(summary.columns))
    if missing:
        raise ValueError(f"summary lacks columns {missing}; pass experiments.serving.summarize(...) / "
                         "run(...)['summary']")
    out = []
    for mode, g in summary.sort_values("concurrency").groupby("mode", sort=False):
        c = list(g["concurrency"])
        top = g.iloc[-1]
        out.append(f"{mode}: " + "; ".join([
            _trend("TTFT p50", c, list(g["ttft_p50_s"]), ".3f", "s"),
            _trend("TPS p50 per request", c, list(g["tps_p50"]), ".1f", "tok/s"),
            _trend("total throughput", c, list(g["throughput_tok_s"]), ".0f", "tok/s")])
            + f"; at concurrency {top['concurrency']} TPS p5 (the slowest 5 %) was "
              f"{top['tps_p5'] / top['tps_p50']:.0%} of p50 (measured).")
    modes = set(summary["mode"])
    if {"replicas", "tp"} <= modes:
        both = summary.pivot_table(index="concurrency", columns="mode", values="throughput_tok_s")
        both = both.dropna()
        ratio = both["tp"] / both["replicas"]
        slower = list(ratio.index[ratio < 1])
        if len(slower) == len(ratio):
            verdict = f"TP's total throughput was below replicas' at every concurrency ({ratio.min():.2f}x to " \
                      f"{ratio.max():.2f}x of it)"
        elif not slower:
            verdict = f"TP's total throughput was at or above replicas' at every concurrency ({ratio.min():.2f}x " \
                      f"to {ratio.max():.2f}x of it)"
        else:
            verdict = (f"TP's total throughput was below replicas' at concurrency {', '.join(map(str, slower))} "
                       f"only ({ratio.min():.2f}x to {ratio.max():.2f}x of it over the ramp)")
        tp = summary[summary["mode"] == "tp"]
        busy = float((tp["prefill_s"] + tp["decode_s"]).sum())
        comm = float(tp["comm_s"].sum())
        share = f"{comm / busy:.0%}" if busy > 0 else "n/a"
        out.append(f"{verdict}; collectives took {comm:.2f} s of TP rank 0's {busy:.2f} s of prefill + decode "
                   f"({share}) (measured).")
    return out


def deployment_findings(pred: pd.DataFrame, model: str) -> list[str]:
    """What :func:`predict_deployments`' table says, as sentences computed from it (every number *predicted*):
    which TP degrees fit and which do not (with the weights per GPU), and among those that fit, which has the
    lowest TTFT, the lowest time per output token, the highest total throughput and holds the most sequences;
    whether decode is memory- or compute-bound there. Raises ValueError when no row fits (nothing to compare:
    see :func:`check_deployments_fit`)."""
    ok = pred[pred["fits"]]
    if ok.empty:
        raise ValueError(f"no deployment of {model} fits (every row has fits=False); "
                         "check_deployments_fit says what would")
    g = pred.iloc[0]
    tp1 = pred[pred["tp"] == 1]
    whole = f"{tp1['weights_bytes_per_gpu'].iloc[0] / mem.GB:.1f} GB of weights per whole copy (GB = 10^9)" \
        if len(tp1) else ""
    fit_tp = ", ".join(f"TP{t}" for t in ok["tp"])
    bad = pred[~pred["fits"]]
    need = ", ".join(f"TP{t} ({b / mem.GiB:.1f} GiB)" for t, b in zip(bad["tp"], bad["peak_bytes_per_gpu"]))
    out = [f"{model} on {int(g['tp'] * g['replicas'])} x {g['gpu']}: {whole}; fits at {fit_tp}"
           + (f"; not at {need} > {g['device_bytes'] / mem.GiB:.1f} GiB per GPU, so those rows carry no timing"
              if len(bad) else "") + " (predicted)."]

    def best(col, fn, fmt, unit):
        r = ok.loc[getattr(ok[col], fn)()]
        return f"TP{int(r['tp'])} x {int(r['replicas'])} ({format(r[col] * (1e3 if unit == 'ms' else 1), fmt)} {unit})"

    out.append(f"Among those that fit: lowest TTFT {best('ttft_s', 'idxmin', '.1f', 'ms')}; lowest time per output "
               f"token {best('tpot_s', 'idxmin', '.2f', 'ms')}; highest total throughput "
               f"{best('throughput_tok_s', 'idxmax', ',.0f', 'tok/s')} (predicted).")
    seqs = ok.dropna(subset=["max_sequences_total"])
    if len(seqs):
        r = seqs.loc[seqs["max_sequences_total"].astype(float).idxmax()]
        out.append(f"Most sequences held in memory at once: TP{int(r['tp'])} x {int(r['replicas'])}, "
                   f"{int(r['max_sequences_total'])} (predicted).")
    bounds = ok.groupby("decode_bound")["tp"].apply(lambda t: ", ".join(f"TP{x}" for x in t))
    out.append("Decode is " + "; ".join(f"{b}-bound at {t}" for b, t in bounds.items()) + " (predicted).")
    return out


# ------------------------------------------------------------------------------------------------------
# the concurrency crossover: replicas vs TP as the number of sequences in flight grows
# ------------------------------------------------------------------------------------------------------
def default_sweep(gpus: int) -> list[int]:
    """Total concurrencies for the GPU-side sweep: gpus x 1, 4, 16, 64, 128, 256 (8 to 2048 on 8 GPUs)."""
    return [gpus * k for k in (1, 4, 16, 64, 128, 256)]


def cluster_gpu(emulate) -> tuple[str, str | None]:
    """The GPU and intra-node link of the ``emulate`` profile (a name of data/hardware.yaml's clusters, or a
    dict with ``cluster``); ``(default gpu, None)`` when emulate is None."""
    from labkit.theory.cluster import get_cluster

    if emulate in (None, False, ""):
        return "h100-80gb", None
    c = get_cluster(emulate["cluster"] if isinstance(emulate, dict) else emulate)
    return getattr(c.device, "name", c.device), getattr(c.intra, "name", c.intra)


def predict_crossover(big_model: str, *, gpus: int, gpu: str, prompt_len: int, output_len: int,
                      concurrencies=None, link: str | None = None) -> pd.DataFrame:
    """*Predicted* (:func:`labkit.theory.serving.deployment_rows`, the roofline of section 6) total throughput
    of every TP degree of ``big_model`` on ``gpus`` x ``gpu`` at each total concurrency (default
    :func:`default_sweep`). Rows that do not fit in memory have NaN throughput. Raises what deployment_rows
    raises."""
    rows = []
    kw = {"link": link} if link else {}
    for c in concurrencies or default_sweep(gpus):
        for r in st.deployment_rows(big_model, gpus=gpus, gpu=gpu, concurrency=int(c), prompt_len=prompt_len,
                                    output_len=output_len, **kw):
            rows.append({"concurrency": int(c), "tp": int(r["tp"]), "replicas": int(r["replicas"]),
                         "fits": bool(r["fits"]), "throughput_tok_s": r["throughput_tok_s"], "tpot_s": r["tpot_s"],
                         "decode_bound": r["decode_bound"], "source": "predicted (roofline)"})
    return pd.DataFrame(rows)


def crossover_point(pred: pd.DataFrame) -> float | None:
    """The first concurrency of :func:`predict_crossover`'s sweep at which the all-replicas deployment (TP1)
    gives at least the total throughput of the one-group deployment (the largest TP), both fitting; None when
    it never does within the sweep."""
    big = int(pred["tp"].max())
    piv = pred[pred["fits"]].pivot_table(index="concurrency", columns="tp", values="throughput_tok_s")
    if 1 not in piv or big not in piv:
        return None
    both = piv[[1, big]].dropna()
    won = both.index[both[1] >= both[big]]
    return float(won[0]) if len(won) else None


def crossover_findings(pred: pd.DataFrame, model: str) -> list[str]:
    """Sentences computed from :func:`predict_crossover`'s table (every number *predicted*): where replicas
    overtake the one TP group on total throughput (or that they do not within the sweep), and the best TP
    degree at each concurrency."""
    big = int(pred["tp"].max())
    gpus = int(pred["tp"].iloc[0] * pred["replicas"].iloc[0])
    ok = pred[pred["fits"]].dropna(subset=["throughput_tok_s"])
    best = ok.loc[ok.groupby("concurrency")["throughput_tok_s"].idxmax()]
    per = ", ".join(f"{c}: TP{t}" for c, t in zip(best["concurrency"], best["tp"]))
    x = crossover_point(pred)
    both = ok[ok["tp"].isin([1, big])].groupby("concurrency")["tp"].nunique()
    both = both[both == 2].index if (both == 2).any() else ok["concurrency"]
    lo, hi = int(min(both)), int(max(both))
    if x is None:
        head = (f"{model} on {gpus} GPUs: one TP{big} group gives more total throughput than {gpus} replicas at "
                f"every concurrency from {lo} to {hi} where both fit: no crossover in this sweep"
                + (f"; above {hi} the {gpus} replicas no longer fit in memory"
                   if hi < int(pred["concurrency"].max()) else ""))
    else:
        piv = ok.pivot_table(index="concurrency", columns="tp", values="throughput_tok_s")
        before = [c for c in piv.index if c < x]
        head = (f"{model} on {gpus} GPUs: TP{big} gives more total throughput than {gpus} replicas "
                + (f"up to concurrency {int(before[-1])}; " if before else "at no concurrency of the sweep; ")
                + f"from {int(x)} sequences in flight the {gpus} replicas give more "
                  f"({piv.loc[x, 1]:,.0f} vs {piv.loc[x, big]:,.0f} tok/s)")
    return [head + " (predicted).", f"Best TP degree by concurrency: {per} (predicted)."]


def replicas_vs_tp(table: pd.DataFrame, source: str) -> str:
    """One sentence from a table with ``mode``, ``concurrency`` and ``throughput_tok_s`` (measured or
    emulated): at which concurrencies TP's total throughput was above replicas', with the ratio range."""
    piv = table.pivot_table(index="concurrency", columns="mode", values="throughput_tok_s").dropna()
    if not {"replicas", "tp"} <= set(piv.columns) or piv.empty:
        return f"{source}: only one mode ran, nothing to compare."
    ratio = piv["tp"] / piv["replicas"]
    above = [int(c) for c in ratio.index[ratio > 1]]
    rng = f"{ratio.min():.2f}x to {ratio.max():.2f}x of replicas'"
    if not above:
        what = "below replicas' at every concurrency"
    elif len(above) == len(ratio):
        what = "above replicas' at every concurrency"
    else:
        what = f"above replicas' at concurrency {', '.join(map(str, above))} only"
    return f"TP's total throughput was {what} ({rng}) ({source})."


def crossover_figure(pred: pd.DataFrame, lab: pd.DataFrame, *, model: str, lab_model: str,
                     title: str | None = None):
    """Left: total throughput vs concurrency of every TP degree of ``model`` (*predicted*, the roofline),
    the crossover marked. Right: the lab model on this run's ranks, replicas (solid) vs TP (dashed), one
    colour per source of ``lab`` (``measured``, ``emulated (<profile>)``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from labkit.style import label_color

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=(
        f"{model}: every TP degree (predicted)", f"{lab_model} on this run's ranks"))
    dashes = ("solid", "dot", "dash", "longdash", "dashdot")
    for i, (tp, g) in enumerate(pred[pred["fits"]].groupby("tp")):
        name = f"predicted (roofline), TP{tp} x {int(g['replicas'].iloc[0])}"
        fig.add_trace(go.Scatter(x=g["concurrency"], y=g["throughput_tok_s"], mode="lines+markers", name=name,
                                 line={"color": label_color("predicted"), "dash": dashes[i % 5]},
                                 marker={"symbol": i}), row=1, col=1)
    x = crossover_point(pred)
    if x is not None:
        fig.add_vline(x=x, line={"color": "#888", "dash": "dot"}, row=1, col=1)
        fig.add_annotation(x=math.log10(x), y=0.02, xref="x", yref="y domain", xanchor="right", showarrow=False,
                           text=f"replicas overtake TP{int(pred['tp'].max())} at {int(x)}")
    for src, g in lab.groupby("source", sort=False):
        for mode, h in g.groupby("mode"):
            fig.add_trace(go.Scatter(x=h["concurrency"], y=h["throughput_tok_s"], mode="lines+markers",
                                     name=f"{src}, {mode}", line={"color": label_color(src),
                                                                   "dash": "solid" if mode == "replicas" else "dash"}),
                          row=1, col=2)
    fig.update_xaxes(type="log", title="sequences in flight (total)")
    fig.update_yaxes(type="log")
    fig.update_yaxes(title="total throughput (tok/s)", row=1, col=1)
    fig.update_layout(title=title or "replicas vs TP as concurrency grows", legend={"font": {"size": 10}})
    return fig


def measured_lab(summary: pd.DataFrame) -> pd.DataFrame:
    """The measured ramp's ``mode, concurrency, throughput_tok_s`` with source ``measured``."""
    t = summary[["mode", "concurrency", "throughput_tok_s"]].copy()
    t["source"] = "measured"
    return t


def check_run(run: dict, *, world_size: int, n_requests: int, output_len: int, per_step: dict, pred: pd.DataFrame,
              big_model: str, gpus: int) -> str:
    """Every check of chapter 10's run (AssertionError naming what is wrong): parity of cached decode and of the
    TP split, every ramp request served in full, percentiles in order, collectives per step = the prediction,
    KV bytes measured = predicted at every step and through the cancel storm, the rank-loss outcomes, and the
    deployment table's consistency. Returns "all checks passed"."""
    import torch

    from labkit.models import TOLERANCES

    tol = TOLERANCES[torch.float32]
    p, lim = run["parity"], tol["atol"] + tol["rtol"] * 10
    assert p["cached_vs_full_max_abs"] <= lim, f"cached decode differs from the full forward by more than {lim}: {p}"
    if world_size > 1:
        assert p["tp_vs_whole_max_abs"] <= lim, f"the TP-split model differs from the whole one by more than {lim}: {p}"
        assert p["tp_kv_bytes_per_rank"] * world_size == p["whole_kv_bytes"], f"TP ranks do not split the KV: {p}"
    summary, rec = run["summary"], run["records"]
    bad = rec[(rec["status"] != "ok") | (rec["new_tokens"] != output_len)]
    assert bad.empty, f"{len(bad)} ramp requests not served with {output_len} new tokens:\n{bad}"
    assert set(summary["requests"]) == {n_requests}, f"requests per run {set(summary['requests'])} != {n_requests}"
    s = summary
    tail = ((s["ttft_p50_s"] <= s["ttft_p95_s"]) & (s["ttft_p95_s"] <= s["ttft_p99_s"])
            & (s["itl_p50_s"] <= s["itl_p95_s"]) & (s["tps_p5"] <= s["tps_p50"]) & (s["tps_p50"] <= s["tps_p95"]))
    assert tail.all(), f"a percentile is out of order:\n{s[~tail]}"
    pf = s["prefill_fraction"]
    assert ((pf > 0) & (pf < 1)).all(), f"prefill_fraction outside (0, 1): {list(pf)}"
    tp_rows = s[s["mode"] == "tp"]
    for col, want in (("decode_all_reduce_per_step", per_step["all_reduce"]),
                      ("decode_all_gather_per_step", per_step["all_gather"]),
                      ("prefill_all_reduce_per_prompt", per_step["all_reduce"])):
        assert (tp_rows[col] == want).all(), f"{col} measured {list(tp_rows[col])}, predicted {want}"
    kv = run["kv"]
    off = kv[kv["kv_bytes_measured"] != kv["kv_bytes_predicted"]]
    assert off.empty, f"KV bytes measured != predicted at {len(off)} steps:\n{off}"
    c = run["cancel"]
    assert (c["kv_bytes_freed_measured"] == c["kv_bytes_freed_predicted"]).all() \
        and (c["kv_bytes_freed_measured"] > 0).all(), f"the cancel storm freed other bytes than predicted:\n{c}"
    assert (c["kv_bytes_at_end_measured"] == 0).all(), f"KV bytes still alive after every request ended:\n{c}"
    e = run["errors"].set_index("experiment")
    assert e.loc["cancel storm", "cancelled"] == c["cancelled"].sum(), f"error and cancel tables disagree:\n{e}"
    assert e.loc["cancel storm", "failed_final"] == 0 and e.loc["cancel storm", "error_rate"] == 0, \
        f"client cancellations counted as failures:\n{e}"
    if world_size > 1 and "lost_rank" in run["rank_loss"]:
        for exp in ("rank loss: replicas", "rank loss: tp"):
            assert e.loc[exp, "failed_final"] == 0 and e.loc[exp, "requests"] == n_requests, \
                f"{exp}: not every request was served in the end:\n{e}"
        assert e.loc["rank loss: replicas", "rank_lost"] >= 1, f"losing a replica failed no request:\n{e}"
        assert e.loc["rank loss: tp", "comm_timeout"] >= 1, f"losing a TP rank timed out no request:\n{e}"
        f = run["failures"]
        first = f[(f["experiment"] == "rank loss: replicas") & (f["attempt"] == 1)]
        others = first[first["replica"] != run["rank_loss"]["lost_rank"]]
        assert (others["status"] == "ok").all(), f"surviving replicas stopped serving their own requests:\n{others}"
    assert (pred["replicas"] * pred["tp"] == gpus).all(), f"replicas x tp != gpus={gpus}"
    w1, want_w = pred.loc[pred["tp"] == 1, "weights_bytes_per_gpu"].iloc[0], 2 * get_spec(big_model).n_params()
    assert w1 == want_w, f"TP1 weights {w1} B != 2 bytes x {get_spec(big_model).n_params()} parameters"
    timing = ["ttft_s", "tpot_s", "throughput_tok_s"]
    assert pred.loc[pred["fits"], timing].notna().all().all(), "a deployment that fits has no predicted timing"
    assert pred.loc[~pred["fits"], timing].isna().all().all(), "a deployment that does not fit carries a timing"
    return "all checks passed"


def run_emulated(world_size: int, *, model: str, emulate, kernel_overhead_s: float = 5e-6) -> dict | None:
    """The emulated crossover run (:func:`labkit.experiments.serving_crossover.run_crossover`) of the lab
    model on ``emulate``'s cluster, with ``kernel_overhead_s`` per operation (an assumption: a CUDA kernel
    launch costs a few microseconds, and the lab's tiny operations are launch-bound on a GPU). None when
    ``emulate`` is None (emulation off)."""
    from labkit.experiments.serving_crossover import run_crossover

    if emulate in (None, False, ""):
        return None
    emu = dict(emulate) if isinstance(emulate, dict) else {"cluster": emulate}
    emu.setdefault("kernel_overhead_s", kernel_overhead_s)
    return run_crossover(world_size, model=model, emulate=emu)


def lab_table(summary: pd.DataFrame, emulated: dict | None) -> pd.DataFrame:
    """The lab model's throughput by mode and concurrency: measured (the ramp) and, when it ran, emulated."""
    parts = [measured_lab(summary)]
    if emulated is not None:
        parts.append(emulated["emulated"][["mode", "concurrency", "throughput_tok_s", "source"]])
    return pd.concat(parts, ignore_index=True)
