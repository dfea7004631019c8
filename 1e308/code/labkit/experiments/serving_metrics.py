"""Serving metrics, measured: latency percentiles per run and per request class, the server's time series,
the knee of a request-rate sweep, fairness — tables (pandas) made from the engine's plain-data records and
series.

Percentiles are named for what they are: ``ttft_p95_s`` is the 95th percentile of time to first token (its
slow tail), ``tps_p95`` the 95th percentile of decode tokens per second (its *fast* tail) and ``tps_p5`` the
5th (its slow tail). Time per output token (TPOT: a request's decode time / its tokens after the first) and
inter-token latency (ITL: every gap between two consecutive tokens of a request, pooled over requests)
follow the definitions serving benchmarks use (vLLM's benchmark_serving, NVIDIA GenAI-Perf).
"""

from __future__ import annotations

import math

import pandas as pd

from labkit.theory.serving import fit_line, knee_rate

#: latency percentiles reported (slow tail of a time: the high ones)
PERCENTILES = (50, 95, 99)


def pct(values, p: float) -> float:
    """The ``p``-th percentile (0..100, linear interpolation) of the finite values; NaN when there are none."""
    s = pd.Series(list(values), dtype=float).dropna()
    return float(s.quantile(p / 100)) if len(s) else float("nan")


def jain_index(values) -> float:
    """Jain's fairness index (Jain, Chiu & Hawe 1984): (Σx)² / (n·Σx²), 1 when every x is equal, 1/n when
    one gets everything. NaN for no values."""
    xs = [float(x) for x in values if x == x]
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else float("nan")


def latency_columns(ok: pd.DataFrame) -> dict:
    """From the ``ok`` records of a run (or a class): TTFT, TPOT and ITL p50/p95/p99 (seconds), TPS p5 /
    p50 / p95 (tokens/s per request), and the mean normalised latency (e2e seconds per token of work:
    prompt + new tokens) with its Jain fairness index over requests."""
    out = {}
    itl = [g for gaps in ok.get("itl_s", pd.Series(dtype=object)) for g in (gaps or [])]
    for p in PERCENTILES:
        out[f"ttft_p{p}_s"] = pct(ok["ttft_s"], p)
        out[f"tpot_p{p}_s"] = pct(ok["tpot_s"], p) if "tpot_s" in ok else float("nan")
        out[f"itl_p{p}_s"] = pct(itl, p)
    for p in (5, 50, 95):
        out[f"tps_p{p}"] = pct(ok["tps"], p)
    norm = ok["e2e_s"] / (ok["prompt_len"] + ok["new_tokens"]) if len(ok) else pd.Series(dtype=float)
    out["norm_latency_mean_s"] = float(norm.mean()) if len(norm) else float("nan")
    out["fairness_jain"] = jain_index(norm)
    return out


def forward_costs(series: list[dict]) -> dict | None:
    """From one instance's series, its forward passes while requests waited (the saturated stretches): the
    mean prefill pass (``prefill_s``), the mean decode step with the fullest batch (``decode_step_s`` at
    ``concurrency`` in flight). None when it never saturated or never ran a full decode step then."""
    sat = [q for p, q in zip(series, series[1:]) if p["queue"] > 0]
    pre = [r["step_s"] for r in sat if r["event"] == "admit"]
    steps = [r for r in sat if r["event"] == "step" and r["prefill_tokens"] == 0]
    if not pre or not steps:
        return None
    c = max(r["in_flight"] + 0 for r in steps)
    full = [r["step_s"] for r in steps if r["decode_tokens"] == max(x["decode_tokens"] for x in steps)]
    return {"prefill_s": sum(pre) / len(pre), "decode_step_s": sum(full) / len(full),
            "concurrency": max(x["decode_tokens"] for x in steps), "in_flight_max": c}


def saturated(series: list[dict]) -> tuple[float, float]:
    """From one instance's series: (requests completed per second while requests were waiting in its queue,
    seconds it spent so). With a queue the server runs full, so this is its service rate at saturation: the
    knee, measured (NaN when the queue never held a request)."""
    done = span = 0.0
    for p, q in zip(series, series[1:]):
        if p["queue"] > 0:
            done += q["n_ok"] - p["n_ok"]
            span += q["t_s"] - p["t_s"]
    return (done / span if span > 0 else float("nan")), span


def run_summary(records: list[dict], series: list[list[dict]]) -> dict:
    """One run's row, all *measured*: requests and outcomes, latency (:func:`latency_columns`),
    ``achieved_rps`` (requests completed / the window from the first arrival to the last completion) and
    output ``throughput_tok_s``, summed over instances (``series``: one list per instance, records carry
    ``instance``); ``saturated_rps`` (:func:`saturated`, summed over instances), ``saturated_share`` (of
    the run's time with requests waiting) and ``saturated_by_instance`` ((completions, seconds) each);
    ``knee_predicted_rps``: :func:`labkit.theory.serving.knee_rate` on the forward passes this run's instances
    made while saturated (:func:`forward_costs`; NaN unless every instance saturated); the
    queue (max, and ``queue_growth_rps``: the least-squares slope of its length over the time the requests
    were arriving, summed over instances); KV utilisation (bytes written / reserved, mean over steps); the
    mean batch in flight."""
    recs = pd.DataFrame(records)
    ok = recs[recs["status"] == "ok"] if len(recs) else recs
    row = {"requests": int(recs["rid"].nunique()) if len(recs) else 0, "ok": len(ok)}
    row.update({f"n_{s}": int((recs["status"] == s).sum()) for s in sorted(set(recs.get("status", [])) - {"ok"})})
    rate = tok = sat = sat_span = growth = model = 0.0
    per_instance, modelled = [], 0
    groups = dict(list(recs.groupby("instance"))) if "instance" in recs else {0: recs}
    for i, ser in enumerate(series):
        g = groups.get(i, recs.iloc[:0])
        window = (g["end_at_s"].max() - g["arrival_at_s"].min()) if len(g) else 0.0
        done = g[g["status"] == "ok"]
        if window > 0:
            rate += len(done) / window
            tok += done["new_tokens"].sum() / window
        r, span = saturated(ser)
        per_instance.append((0.0 if math.isnan(r) else r * span, span))
        costs = forward_costs(ser)
        if costs is not None and len(done):
            model += knee_rate(prefill_s=costs["prefill_s"], decode_step_s=costs["decode_step_s"],
                               concurrency=costs["concurrency"], new_tokens=float(done["new_tokens"].mean()))
            modelled += 1
        sat += 0.0 if math.isnan(r) else r
        sat_span += span / max(window, 1e-9) / len(series)
        win = [x for x in ser if len(g) and x["t_s"] <= g["arrival_at_s"].max()]
        if len(win) > 1:
            growth += fit_line([x["t_s"] for x in win], [x["queue"] for x in win])[1]
    row.update({"achieved_rps": rate, "throughput_tok_s": tok, "saturated_rps": sat if sat_span > 0 else float("nan"),
                "saturated_share": sat_span, "saturated_by_instance": per_instance, "queue_growth_rps": growth,
                "knee_predicted_rps": model if modelled == len(series) else float("nan")})
    row.update(latency_columns(ok))
    ser = pd.DataFrame([x for s_ in series for x in s_])
    if len(ser):
        row["queue_max"] = int(ser["queue"].max())
        res = ser["kv_bytes_measured"]
        row["kv_utilisation_mean"] = float((ser["kv_bytes_used"] / res.where(res > 0)).mean())
        row["batch_mean"] = float(ser.loc[ser["event"] == "step", "in_flight"].mean())
    row["source"] = "measured"
    return row


def class_rows(records: list[dict], **labels) -> list[dict]:
    """One row per request class (``kind``: short / long) of a run's ``ok`` records: its latency columns."""
    recs = pd.DataFrame(records)
    ok = recs[recs["status"] == "ok"]
    return [{**labels, "kind": kind, "requests": len(g), **latency_columns(g), "source": "measured"}
            for kind, g in ok.groupby("kind")]


def series_frame(runs: list[dict]) -> pd.DataFrame:
    """The time series of several runs in one frame: every series row with its run's labels (``mode``,
    ``rate_rps``, ``policy``, ``instance``, ... whatever keys each run dict has besides ``series``)."""
    rows = []
    for r in runs:
        labels = {k: v for k, v in r.items() if k != "series"}
        rows += [{**labels, **s} for s in r["series"]]
    return pd.DataFrame(rows)


def knee_table(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per mode, the knee three ways (requests/s):

    * ``knee_measured_rps`` — the service rate at saturation: completions per second while requests waited
      in the queue, pooled over every run of the sweep per instance (``saturated_by_instance``), summed over
      the instances (past the knee completions flatten there while the queue grows);
    * ``knee_predicted_rps`` — :func:`labkit.theory.serving.knee_rate` on the forward passes the server made
      in those saturated stretches (the runs' ``knee_predicted_rps``, their median): what the
      model says the knee is, given how long a prefill and a full decode step took under that load — the gap
      to the measurement is the time the engine spent outside forward passes and batches that were not full;
    * ``knee_forecast_rps`` — knee_rate on step costs measured *unloaded* just before each run (the median of
      the runs' ``knee_forecast_rps``): the forecast an operator makes before sending any load, the one the
      sweep's rates were set from; on shared CPUs it drifts with the machine's load.

    Also the ratios to the measurement, the seconds of saturation it rests on, and the first offered rate
    whose queue grew (``queue_growth_rps`` above a tenth of the offered rate)."""
    rows = []
    for mode, g in sweep.groupby("mode", sort=False):
        n = max(len(x) for x in g["saturated_by_instance"])
        done = [sum(x[i][0] for x in g["saturated_by_instance"] if i < len(x)) for i in range(n)]
        span = [sum(x[i][1] for x in g["saturated_by_instance"] if i < len(x)) for i in range(n)]
        meas = sum(d / s for d, s in zip(done, span)) if all(s > 0 for s in span) else float("nan")
        pred = float(g["knee_predicted_rps"].median())
        fore = float(g["knee_forecast_rps"].median())
        grew = g[g["queue_growth_rps"] > 0.1 * g["rate_rps"]]
        rows.append({"mode": mode, "knee_measured_rps": meas, "knee_predicted_rps": pred, "knee_forecast_rps": fore,
                     "measured_over_predicted": meas / pred, "measured_over_forecast": meas / fore,
                     "saturated_s": min(span),
                     "first_rate_queue_grew_rps": float(grew["rate_rps"].min()) if len(grew) else float("nan"),
                     "source": "measured / predicted (knee_rate on the saturated forward passes) / forecast "
                               "(knee_rate on unloaded step costs)"})
    return pd.DataFrame(rows)


def before_after(records: pd.DataFrame) -> pd.DataFrame:
    """A hot-swap run's ``ok`` requests split by ``model_version`` (0: served before the swap, 1: after):
    requests, TTFT p50/p95, TPOT p50, TPS p50 — the swap's effect on latency, *measured*."""
    ok = records[records["status"] == "ok"]
    rows = []
    for v, g in ok.groupby("model_version"):
        lat = latency_columns(g)
        rows.append({"model_version": int(v), "served": "before the swap" if v == 0 else "after the swap",
                     "requests": len(g), **{k: lat[k] for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tps_p50")},
                     "source": "measured"})
    return pd.DataFrame(rows)
