"""Serving under load, measured: one launch calibrates each mode's step costs, sweeps the request rate of an
open-loop workload (replicas and TP) past the knee the analytic model predicts, compares prefill-first with
chunked prefill, hot-swaps the weights while a cancel storm hits, and serves quantized replicas.

* :func:`make_load_plan` — every argument checked before a launch (ValueError naming the valid range);
* :func:`load_rank` — the rank function (:func:`calibrate`, :func:`sweep`, :func:`policies`,
  :func:`hot_swap`, :func:`quantized`);
* :func:`run_load` — launch it and return tables (:mod:`labkit.experiments.serving_metrics`).

The strategy is :mod:`labkit.parallel.serving`; the knee is :func:`labkit.theory.serving.knee_rate`.
"""

from __future__ import annotations

import math
import statistics

import pandas as pd
import torch
import torch.distributed as dist

from labkit.checks import check_choice, positive_float, positive_int
from labkit.experiments import serving_metrics as sm
from labkit.experiments import serving_workloads as wl
from labkit.experiments.serving import MODES, build, default_model, gather, replica_engine, tp_engine
from labkit.models import SyntheticLM, build_model, lm_loss, train_reference
from labkit.parallel.serving import quantize, weight_bytes
from labkit.runtime.timeline import now_ns
from labkit.theory import memory as mem
from labkit.theory import serving as st
from labkit.theory.spec import get_spec

WEIGHT_DTYPES = ("fp32", "int8", "int4")


# ------------------------------------------------------------------------------------------------------
# the plan: everything checked before a launch
# ------------------------------------------------------------------------------------------------------
def make_load_plan(world_size: int, *, model: str | None = None, concurrency: int | None = None,
                   modes=MODES, rates=None, rate_factors=(0.5, 1.0, 3.0), n_requests: int | None = None,
                   arrival: str = "poisson", trace: str | None = None, burst_size: int = 4,
                   short_prompt=(8, 24), long_prompt=(64, 96), long_fraction: float = 0.25, output_len=(4, 12),
                   max_tokens: int | None = None, policies: bool = True, policy_model: str = "lab-small-llama",
                   token_budget: int = 16, policy_workload: dict | None = None, policy_rate_factor: float = 0.7,
                   policy_rounds: int = 1,
                   swap_to: str | None = "int8", swap_after: float = 0.4, swap_drain: str = "finish",
                   swap_cancel: bool = True, swap_rate_factor: float = 0.5, quant: bool = True,
                   quality_train_steps: int = 20, fixed_compute: dict | None = None, seed: int = 0) -> dict:
    """Validate the arguments of :func:`run_load` and build the plan :func:`load_rank` executes.

    * the sweep: ``concurrency`` requests in flight in total (default 4 x world_size; a multiple of
      world_size: each replica takes its share, TP all of it); ``n_requests`` per run (default 3 x
      concurrency: TP's one instance holds all of it, and a run past the knee must hold several batches'
      worth to saturate, not only ramp up and drain: TP on 4 ranks, concurrency 16, measured its knee at
      0.32x the model with 24 requests a run, 0.68x with 48); ``rates`` (requests/s) or ``rate_factors``
      (multiples of each mode's knee forecast from step costs measured in this launch); ``arrival``
      "poisson", "burst" or "trace" (``trace``: a CSV / JSON-lines file,
      :func:`~labkit.experiments.serving_workloads.load_trace`, replayed at each rate); the lengths of
      :func:`~labkit.experiments.serving_workloads.open_loop_workload`; ``fixed_compute``: ``{"step_s",
      "token_s"}`` pads every forward pass to :func:`labkit.theory.serving.fixed_step_s` (chapter 06's fixed
      compute) and forecasts the knee from those costs alone;
    * ``policies``: prefill-first vs chunked prefill (``token_budget`` tokens per step) on ``policy_model``
      with ``policy_workload`` (default: longer prompts) at ``policy_rate_factor`` of its knee, the two
      policies side by side on different ranks, ``policy_rounds`` times with the ranks swapped;
    * ``swap_to``: the hot swap's target — "int8", "int4" (a quantized copy) or a preset with the same
      vocabulary (None: no swap) — once each replica admitted ``swap_after`` of its requests, ``swap_drain``
      "finish" or "requeue", with a cancel storm one step after the drain starts (``swap_cancel``);
    * ``quant``: fp32 / int8 / int4 replicas (memory, speed, and quality after ``quality_train_steps`` steps
      of training; 0: the untrained model).

    Raises ValueError naming the valid range: rates or factors <= 0 or NaN, lengths beyond the model's
    context, a swap target with another vocabulary, a token budget below one token, concurrency not a
    multiple of world_size, unknown modes, arrival processes or drain modes.
    """
    world_size = positive_int("world_size", world_size)
    model = model or default_model(world_size)
    spec = get_spec(model)
    for m in modes:
        check_choice("mode", m, MODES)
    modes = ["replicas"] if world_size == 1 else list(modes)
    if "tp" in modes:
        st.check_tp(spec, world_size)
    conc = positive_int("concurrency", concurrency if concurrency is not None else 4 * world_size)
    if conc % world_size:
        raise ValueError(f"concurrency={conc} must be a multiple of world_size={world_size} (each replica takes "
                         f"concurrency / world_size at a time), e.g. {world_size * max(1, conc // world_size)}")
    sweep = {"rates": _floats("rates", rates, "a request rate (requests/s)")} if rates is not None \
        else {"rate_factors": _floats("rate_factors", rate_factors, "a multiple of the predicted knee")}
    check_choice("arrival", arrival, wl.ARRIVALS)
    n_requests = 3 * conc if n_requests is None else n_requests
    load = {"n_requests": positive_int("n_requests", n_requests), "arrival": arrival, "burst_size": burst_size,
            "short_prompt": short_prompt, "long_prompt": long_prompt, "long_fraction": long_fraction,
            "output_len": output_len, "max_tokens": max_tokens}
    if arrival == "trace":
        if not trace:
            raise ValueError("arrival='trace' needs trace=<path of a CSV or JSON-lines trace>")
        load["trace"] = [dict(r) for r in wl.load_trace(trace, max_seq_len=spec.max_seq_len, max_tokens=max_tokens)]
    else:
        wl.open_loop_workload(load["n_requests"], 1.0, **_lengths(load), max_seq_len=spec.max_seq_len)
    if fixed_compute is not None:
        sweep["fixed_compute"] = {"step_s": positive_float("fixed_compute step_s", fixed_compute["step_s"]),
                                  "token_s": positive_float("fixed_compute token_s", fixed_compute.get("token_s", 0.0),
                                                            allow_zero=True)}
    plan = {"model": model, "seed": seed, "world_size": world_size, "modes": modes, "concurrency": conc,
            "load": load, "sweep": sweep}
    if policies:
        pw = {"short_prompt": (8, 16), "long_prompt": (160, 224), "long_fraction": 0.3, "output_len": (8, 8),
              "n_requests": 24, **(policy_workload or {})}
        pspec = get_spec(policy_model)
        wl.open_loop_workload(positive_int("policy n_requests", pw["n_requests"]), 1.0, **_lengths(pw),
                              max_seq_len=pspec.max_seq_len)
        plan["policies"] = {"model": pspec.name, "workload": pw,
                            "rate_factor": positive_float("policy_rate_factor", policy_rate_factor),
                            "token_budget": positive_int("token_budget (tokens per step)", token_budget),
                            "rounds": positive_int("policy_rounds", policy_rounds)}
    if swap_to is not None:
        if swap_to not in ("int8", "int4"):
            target = get_spec(swap_to)  # ValueError for an unknown preset
            if target.vocab_size != spec.vocab_size:
                raise ValueError(f"swap_to={swap_to!r} has vocab_size={target.vocab_size}, {model!r} has "
                                 f"{spec.vocab_size}: a hot swap keeps the vocabulary (token ids must keep their "
                                 f"meaning); swap to 'int8', 'int4' or a preset with vocab_size={spec.vocab_size}")
            check_fits = wl.check_lengths  # the target's context must hold the same requests
            check_fits(target.max_seq_len, **{k: v for k, v in _lengths(load).items()
                                              if k in ("short_prompt", "long_prompt", "output_len", "max_tokens",
                                                       "long_fraction")})
        check_choice("swap_drain", swap_drain, ("finish", "requeue"))
        if not 0 < float(swap_after) < 1:
            raise ValueError(f"swap_after={swap_after!r} must be in (0, 1): the share of a replica's requests "
                             "admitted before it swaps")
        plan["swap"] = {"to": swap_to, "after": float(swap_after), "drain": swap_drain,
                        "cancel": bool(swap_cancel),
                        "rate_factor": positive_float("swap_rate_factor", swap_rate_factor)}
    if quant:
        plan["quant"] = {"train_steps": positive_int("quality_train_steps", quality_train_steps, minimum=0)}
    return plan


def _floats(name: str, values, what: str) -> list[float]:
    """``values`` as a non-empty list of finite numbers > 0; ValueError naming the first bad one."""
    try:
        vals = list(values)
    except TypeError:
        raise ValueError(f"{name}={values!r} must be a list of numbers > 0 ({what})") from None
    if not vals:
        raise ValueError(f"{name}=[] needs at least one value > 0 ({what})")
    return [positive_float(f"{name}[{i}] ({what})", v) for i, v in enumerate(vals)]


def _lengths(w: dict) -> dict:
    keys = ("short_prompt", "long_prompt", "long_fraction", "output_len", "max_tokens", "arrival", "burst_size")
    out = {k: w[k] for k in keys if k in w}
    if out.get("arrival") == "trace":
        out.pop("arrival")
    return out


def workload(load: dict, rate: float, seed: int, max_seq_len: int) -> list[dict]:
    """The requests of one run at ``rate`` requests/s (a trace replayed at that rate, else generated)."""
    if "trace" in load:
        return wl.scale_to_rate(load["trace"], rate)
    return wl.open_loop_workload(load["n_requests"], rate, **_lengths(load), max_seq_len=max_seq_len, seed=seed)


# ------------------------------------------------------------------------------------------------------
# the rank functions
# ------------------------------------------------------------------------------------------------------
def _engine(ctx, plan, full, mode, group=None):
    fc = plan["sweep"].get("fixed_compute")
    kw = {"step_time": lambda p, d: st.fixed_step_s(p + d, **fc)} if fc else {}
    return replica_engine(ctx, plan, full, **kw) if mode == "replicas" else tp_engine(ctx, plan, full, group, **kw)


def fixed_knee(plan: dict, mode: str, world_size: int, requests: list[dict]) -> float:
    """The knee *predicted* from the fixed compute costs alone (no measurement): :func:`labkit.theory.serving.
    knee_rate` with prefill = fixed_step_s(mean prompt) and decode step = fixed_step_s(concurrency)."""
    fc = plan["sweep"]["fixed_compute"]
    n = world_size if mode == "replicas" else 1
    c = plan["concurrency"] // n
    m = wl.mean_lengths(requests)
    return st.knee_rate(prefill_s=fc["step_s"] + fc["token_s"] * m["prompt_len"],
                        decode_step_s=st.fixed_step_s(c, **fc), concurrency=c, new_tokens=m["new_tokens"], instances=n)


def _share(ctx, mode, requests):
    return requests[ctx.rank :: ctx.world_size] if mode == "replicas" else requests


def calibrate(ctx, plan: dict, eng, mode: str, sample: list[dict], *, waves: int = 1) -> dict:
    """This instance's unloaded costs, measured through the engine (its own overhead included): ``waves``
    closed waves of ``c`` requests (its concurrency) with the prompts of ``sample`` (the workload's), 6 new
    tokens each. ``prefill_s``: the mean time an admission took (prompt, cache, prefill; the extremes
    trimmed); ``decode_step_s``: the median time between decode steps with all ``c`` in flight, plus (TP)
    ``sync_s``, the median broadcast by which group rank 0 tells the others what has arrived."""
    c = plan["concurrency"] // (ctx.world_size if mode == "replicas" else 1)
    reqs = [{"rid": 90_000 + i, "kind": "calibration", "prompt_len": sample[i % len(sample)]["prompt_len"],
             "max_new_tokens": 6} for i in range(waves * c)]
    ctx.barrier()
    ser = eng.serve(reqs, c)["series"]
    admits = sorted(q["t_s"] - p["t_s"] for p, q in zip([{"t_s": 0.0}] + ser, ser) if q["event"] == "admit")
    admits = admits[1:-1] if len(admits) >= 5 else admits
    steps = [s for s in ser if s["event"] == "step"]
    gaps = [q["t_s"] - p["t_s"] for p, q in zip(steps, steps[1:]) if p["in_flight"] == q["in_flight"] == c]
    sync = 0.0
    if mode == "tp":
        t = torch.zeros(1, dtype=torch.long, device=ctx.device)  # NCCL takes only CUDA tensors (as the engine's)
        times = []
        for _ in range(5):
            t1 = now_ns()
            dist.broadcast(t, 0)
            times.append((now_ns() - t1) / 1e9)
        sync = statistics.median(times)
    return {"mode": mode, "instance": ctx.rank if mode == "replicas" else 0, "concurrency": c,
            "prefill_s": sum(admits) / len(admits), "decode_step_s": statistics.median(gaps) + sync, "sync_s": sync,
            "source": "measured (unloaded, through the engine)"}


def predict_knee(costs: list[dict], requests: list[dict]) -> float:
    """:func:`labkit.theory.serving.knee_rate` of ``requests`` (their mean new tokens) summed over the
    instances whose unloaded ``costs`` :func:`calibrate` measured."""
    m = wl.mean_lengths(requests)
    return sum(st.knee_rate(prefill_s=c["prefill_s"], decode_step_s=c["decode_step_s"], concurrency=c["concurrency"],
                            new_tokens=m["new_tokens"]) for c in costs)


def measure_knee(ctx, plan, eng, mode, sample, **kw) -> tuple[float, list[dict]]:
    """:func:`calibrate` every instance of ``mode`` now and :func:`predict_knee` (requests/s, all instances)."""
    costs = calibrate(ctx, plan, eng, mode, sample, **kw)
    costs = gather(costs) if mode == "replicas" else [costs]
    return predict_knee(costs, sample), costs


def serve_open(ctx, plan, eng, mode, requests, *, label: dict, **kw) -> dict:
    """One open-loop run: every instance starts its clock together; returns rank 0's view of all instances
    (records with ``instance``, series per instance, the run summary)."""
    c = plan["concurrency"] // (ctx.world_size if mode == "replicas" else 1)
    ctx.barrier()
    t0 = now_ns()
    out = eng.serve(_share(ctx, mode, requests), c, t0_ns=t0, **kw)
    mine = {"records": [dict(r, instance=ctx.rank) for r in out["records"]], "series": out["series"],
            "swap": out["swap"], "cancel": out["cancel"], "unserved": len(out["unserved"])}
    got = gather(mine) if mode == "replicas" else [mine]
    recs = [r for g in got for r in g["records"]]
    series = [{**label, "instance": i, "series": g["series"]} for i, g in enumerate(got)]
    row = {**label, **sm.run_summary(recs, [g["series"] for g in got]),
           "unserved": sum(g["unserved"] for g in got)}
    return {"row": row, "records": [dict(r, **label) for r in recs], "series": series,
            "swap": [g["swap"] for g in got], "cancel": [g["cancel"] for g in got]}


def load_rank(ctx, plan: dict) -> dict:
    """Every experiment of a :func:`make_load_plan` plan in one launch; rank 0's result is the one to read."""
    torch.manual_seed(plan["seed"])
    full = build(plan).to(ctx.device)
    spec = full.spec
    load = plan["load"]
    base = workload(load, 1.0, plan["seed"], spec.max_seq_len)
    out = {"calibration": [], "sweep": [], "records": [], "series": [], "phase_s": {}}
    tick = [now_ns()]

    def phase(name):
        t = now_ns()
        out["phase_s"][name] = out["phase_s"].get(name, 0.0) + (t - tick[0]) / 1e9
        tick[0] = t

    engines = {m: _engine(ctx, plan, full, m, dist.group.WORLD) for m in plan["modes"]}
    for mode, eng in engines.items():
        calibrate(ctx, plan, eng, mode, base)  # warm-up: the first passes of each shape are slow
        fixed = "fixed_compute" in plan["sweep"]
        if fixed:
            knee = fixed_knee(plan, mode, ctx.world_size, base)
        else:
            knee, costs = measure_knee(ctx, plan, eng, mode, base)
            out["calibration"] += [dict(c, when="before the sweep") for c in costs]
        phase(f"calibrate {mode}")
        rates = plan["sweep"].get("rates") or [f * knee for f in plan["sweep"]["rate_factors"]]
        for rate in rates:
            now_knee = knee
            if not fixed:  # measured again just before the run: this machine's load drifts
                now_knee, costs = measure_knee(ctx, plan, eng, mode, base)
                out["calibration"] += [dict(c, when=f"before rate {rate:.3g}") for c in costs]
            res = serve_open(ctx, plan, eng, mode, workload(load, rate, plan["seed"], spec.max_seq_len),
                             label={"experiment": "sweep", "mode": mode, "rate_rps": rate,
                                    "rate_over_knee": rate / knee, "knee_forecast_rps": now_knee})
            _keep(out, res, "sweep")
        phase(f"sweep {mode}")
    if "policies" in plan:
        res = policies(ctx, plan, full)
        out["policies"], out["classes"] = res["rows"], res["classes"]
        _merge(out, res)
        phase("policies")
    if "swap" in plan:
        res = hot_swap(ctx, plan, full)
        out["swap"] = {k: res[k] for k in ("row", "info", "requests")}
        _merge(out, res)
        phase("hot swap")
    if "quant" in plan:
        out["quant"] = quantized(ctx, plan, full)
        phase("quantized")
    return out if ctx.rank == 0 else {"rank": ctx.rank}


def policies(ctx, plan: dict, full) -> dict:
    """Prefill-first vs chunked prefill (a token budget per step) on ``plan["policies"]["model"]``: every
    rank serves the whole open-loop workload (at ``rate_factor`` of one instance's forecast prefill-first
    knee) with one policy while its neighbour runs the other (then they swap, ``rounds`` > 1), so both
    policies meet the same machine load. Returns ``rows`` (one per policy:
    :func:`~labkit.experiments.serving_metrics.run_summary` over every instance that ran it), ``classes``
    (one per policy and request class), the ``records`` and the ``series``."""
    from labkit.parallel.serving import POLICIES

    p = plan["policies"]
    pplan = {**plan, "model": p["model"]}
    pfull = full if p["model"] == plan["model"] else build(pplan).to(ctx.device)
    eng = replica_engine(ctx, pplan, pfull)
    pw = {**p["workload"], "arrival": "poisson"}
    base = workload(pw, 1.0, plan["seed"] + 1, pfull.spec.max_seq_len)
    eng.serve(base[:2], 2)  # warm-up
    costs = gather(calibrate(ctx, pplan, eng, "replicas", base))
    rate = p["rate_factor"] * min(predict_knee([c], base) for c in costs)  # each rank serves it all
    reqs = workload(pw, rate, plan["seed"] + 1, pfull.spec.max_seq_len)
    c = plan["concurrency"] // ctx.world_size
    runs = []
    for rnd in range(p["rounds"] if ctx.world_size > 1 else 1):
        for k in range(1 if ctx.world_size > 1 else 2):
            policy = POLICIES[(ctx.rank + rnd + k) % 2]
            budget = p["token_budget"] if policy == "chunked" else None
            ctx.barrier()
            res = eng.serve(reqs, c, policy=policy, token_budget=budget, t0_ns=now_ns())
            runs.append({"policy": policy, "round": rnd + k, "records": res["records"], "series": res["series"]})
    got = [r for g in gather(runs) for r in g]
    out = {"rows": [], "classes": [], "records": [], "series": []}
    for policy in POLICIES:
        mine = [r for r in got if r["policy"] == policy]
        label = {"experiment": "policy", "mode": "replicas", "model": p["model"], "policy": policy, "rate_rps": rate,
                 "token_budget": p["token_budget"] if policy == "chunked" else None}
        recs = [dict(x, instance=i, **label) for i, r in enumerate(mine) for x in r["records"]]
        out["rows"].append({**label, **sm.run_summary(recs, [r["series"] for r in mine])})
        out["classes"] += sm.class_rows(recs, **label)
        out["records"] += recs
        out["series"] += [{**label, "instance": i, "series": r["series"]} for i, r in enumerate(mine)]
    return out


def _keep(out: dict, res: dict, key: str) -> None:
    out.setdefault(key, []).append(res["row"])
    _merge(out, res)


def _merge(out: dict, res: dict) -> None:
    if out is not res:
        out["records"] += res["records"]
        out["series"] += res["series"]


def swap_target(plan: dict, full):
    """What the hot swap serves next: a quantized copy of ``full`` or another preset's model."""
    to = plan["swap"]["to"]
    if to in ("int8", "int4"):
        return lambda old: quantize(full, to)
    return lambda old: build_model(to, seed=plan["seed"]).to(full.embed.weight.device)


def hot_swap(ctx, plan: dict, full) -> dict:
    """Replicas under an open-loop load; once ``after`` of its requests were admitted each stops admitting,
    drains (finish or requeue), swaps its weights (:func:`swap_target`) and resumes, while a cancel storm
    (every other in-flight request) hits the step after the drain starts. Returns the run's row, every
    record (``model_version`` 0 before, 1 after), the series and each replica's swap info (drain, swap and
    pause times measured)."""
    sw = plan["swap"]
    spec = full.spec
    base = workload(plan["load"], 1.0, plan["seed"] + 2, spec.max_seq_len)
    eng = replica_engine(ctx, plan, full)
    rate = sw["rate_factor"] * measure_knee(ctx, plan, eng, "replicas", base)[0]
    reqs = workload(plan["load"], rate, plan["seed"] + 2, spec.max_seq_len)
    label = {"experiment": "hot swap", "mode": "replicas", "rate_rps": rate}
    share = len(_share(ctx, "replicas", reqs))
    res = serve_open(ctx, plan, eng, "replicas", reqs, label=label,
                     swap={"after_admitted": max(1, int(sw["after"] * share)), "model_fn": swap_target(plan, full),
                           "drain": sw["drain"], "cancel_storm": sw["cancel"]})
    return {"row": res["row"], "records": res["records"], "series": res["series"],
            "info": [dict(s or {}, instance=i, cancel=c) for i, (s, c) in enumerate(zip(res["swap"], res["cancel"]))],
            "requests": len(reqs)}


def quantized(ctx, plan: dict, full) -> list[dict]:
    """fp32, int8 and int4 replicas of the same weights: weight bytes measured (:func:`~labkit.parallel.
    serving.quant.weight_bytes`) and predicted (the calculator's ``parameters``); TTFT / TPS serving the same
    closed load, the three interleaved over two rounds (on every rank but rank 0, which meanwhile measures
    the quality); the quality against fp32 on a fixed text (SyntheticLM, after ``train_steps`` steps of
    training so the loss means something): loss, perplexity, teacher-forced top-1 agreement, and the share
    of greedy tokens generated alike."""
    spec = full.spec
    models = {"fp32": full, **{wd: quantize(full, wd) for wd in ("int8", "int4")}}
    quality, speed = {}, {wd: [] for wd in models}
    if ctx.rank == 0:
        trained = build(plan)
        if plan["quant"]["train_steps"]:  # trained in place
            train_reference(spec, steps=plan["quant"]["train_steps"], global_batch_size=4, seq_len=32, lr=1e-2,
                            model=trained)
        quality = _quality(trained.eval(), spec)
    if ctx.rank != 0 or ctx.world_size == 1:
        reqs = [{"rid": 80_000 + i, "kind": "quant", "prompt_len": 16 + 8 * (i % 3), "max_new_tokens": 6}
                for i in range(6)]
        for _ in range(2):
            for wd, m in models.items():
                out = replica_engine(ctx, plan, m).serve(reqs, 3)
                speed[wd] += [(r["ttft_s"], r["tps"]) for r in out["records"]]
    got = gather(speed)
    rows = []
    for wd, m in models.items():
        pairs = [p for g in got for p in g[wd]]
        pred = mem.infer_memory(spec, mem.ParallelConfig(), mem.InferConfig(weight_dtype=wd))
        rows.append({"weight_dtype": wd, "weight_bytes_measured": weight_bytes(m),
                     "weight_bytes_predicted": pred.categories["parameters"],
                     "ttft_p50_s": sm.pct([p[0] for p in pairs], 50), "tps_p50": sm.pct([p[1] for p in pairs], 50),
                     **quality.get(wd, {}), "source": "measured / predicted (labkit.theory.memory.infer_memory)"})
    return rows


@torch.inference_mode()
def _quality(model, spec) -> dict:
    """Loss, perplexity and agreement with the fp32 ``model`` of its int8 / int4 copies on a fixed text."""
    x, y = SyntheticLM(spec.vocab_size, 64).batch(10_000, 4)  # the fixed text: 4 x 64 tokens of the chain trained on
    ref = model(x)  # (4, 64, V)
    prompts = x[:, :16]
    gen_ref = _greedy(model, prompts, 8)
    out = {}
    for wd in WEIGHT_DTYPES:
        m = model if wd == "fp32" else quantize(model, wd)
        lg = m(x)
        loss = float(lm_loss(lg, y))
        out[wd] = {"loss": loss, "perplexity": math.exp(loss),
                   "top1_agreement": float((lg.argmax(-1) == ref.argmax(-1)).float().mean()),
                   "greedy_agreement": float((_greedy(m, prompts, 8) == gen_ref).float().mean())}
    return out


def _greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens after each prompt (full forward each step: a reference, not the engine)."""
    seq = prompts
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1]:]


# ------------------------------------------------------------------------------------------------------
# one launch, then tables
# ------------------------------------------------------------------------------------------------------
def run_load(world_size: int = 2, *, backend: str = "auto", timeout_s: float = 300.0, **kwargs) -> dict:
    """Launch every experiment of :func:`make_load_plan` once and return tables: ``calibration`` (step
    costs per instance), ``sweep`` (one row per mode x rate: :func:`~labkit.experiments.serving_metrics.
    run_summary`), ``knee`` (predicted vs measured: :func:`~labkit.experiments.serving_metrics.knee_table`),
    ``policies`` and ``classes`` (prefill-first vs chunked, per request class), ``swap`` (the hot-swap run's
    row) and ``swap_info`` (per replica: drain, swap and pause seconds), ``quant`` (per weight dtype), and
    ``records``, ``series`` (every run's time series, labelled), ``timeline``, ``plan``, ``wall_s``."""
    from labkit.runtime.launcher import launch

    plan = make_load_plan(world_size, **kwargs)
    res = launch(load_rank, world_size, plan, backend=backend, timeout_s=timeout_s)
    r0 = res[0]
    sweep = pd.DataFrame(r0["sweep"])
    out = {"plan": plan, "calibration": pd.DataFrame(r0["calibration"]), "sweep": sweep,
           "knee": sm.knee_table(sweep) if len(sweep) else pd.DataFrame(), "records": pd.DataFrame(r0["records"]),
           "series": sm.series_frame(r0["series"]), "timeline": res.timeline, "wall_s": res.wall_s,
           "backend": res.backend, "phase_s": r0["phase_s"]}
    for key in ("policies", "classes", "quant"):
        out[key] = pd.DataFrame(r0.get(key, []))
    if "swap" in r0:
        out["swap"] = pd.DataFrame([r0["swap"]["row"]])
        out["swap_info"] = pd.DataFrame(r0["swap"]["info"])
        out["swap_requests"] = r0["swap"]["requests"]
        recs = out["records"]
        out["swap_compare"] = sm.before_after(recs[recs["experiment"] == "hot swap"])
    return out
