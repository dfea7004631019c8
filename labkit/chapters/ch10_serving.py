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

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_int
from labkit.experiments.serving import default_model, make_plan
from labkit.theory import memory as mem
from labkit.theory import serving as st
from labkit.theory.spec import ModelSpec, get_spec


def check_chapter(*, world_size: int, model: str | None, n_requests: int, short_prompt: int, long_prompt: int,
                  output_len: int, ramp, cancel_step: int | None, lose_at_step: int | None, detect_timeout_s: float,
                  backend: str, big_model: str, gpus: int, gpu: str, concurrency_gpu: int, prompt_len_gpu: int,
                  output_len_gpu: int) -> dict:
    """Validate chapter 10's parameters before anything is launched (the chapter's first code cell). Returns
    ``{"model", "plan", "backend"}``: the model name (``model`` or :func:`default_model`), :func:`make_plan`'s
    plan and the backend the launch will use.

    Raises ValueError naming the value and the fix: world_size < 2 (replicas vs TP needs two ranks to split or
    replicate over), anything :func:`make_plan` refuses (tp = world_size not dividing the model's heads or kv
    heads, a concurrency that is not a multiple of world_size, a request longer than the model's max_seq_len,
    steps < 1, cancel_step or lose_at_step >= output_len), a model this machine's memory cannot hold, a backend
    the machine cannot run, what :func:`predict_deployments` refuses (unknown big model or GPU, sizes < 1), and
    a big model that fits on no TP degree of gpus x gpu (:func:`check_deployments_fit`)."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("10", world_size, why="replicas vs tensor parallelism on the same ranks")
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
    return {"model": plan["model"], "plan": plan, "backend": resolve_backend(backend, world_size)}


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
