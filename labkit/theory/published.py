"""The planner and the memory calculator against published training runs: for every run of
``data/reference/published/training.csv`` that names a mesh, does the calculator accept the published
configuration, does it fit, where does the planner rank the published mesh, and predicted vs published MFU.

Pure Python: the CSV is read with :mod:`csv` (no pandas), the lab's reading of each row (which preset, GPU and
network stand for it, which FLOP count the published number uses, what the source states elsewhere and what
is assumed) with its reasons is ``data/reference/published/validation.yaml``. :func:`validate_published`
returns plain rows; :func:`validation_table` formats them (``labkit plan --validate``; chapter 09 shows them).

Every predicted number is labelled ``predicted``; every published one ``published (<source>)``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import functools
from pathlib import Path

from labkit.paths import data_dir
from labkit.theory import costmodel
from labkit.theory import memory as mem
from labkit.theory.mesh import ParallelDims
from labkit.theory.spec import get_spec
from labkit.yamlload import load_path

#: the band the tests hold every row's predicted/published MFU ratio to (tests/test_validation.py); the goal
#: (within MFU_TOLERANCE of 1 on every validation row) is benchmarks/validate_training.py's
MFU_BAND = (0.85, 1.15)
_SCHEDULES = {"1f1b": "1f1b", "interleaved": "interleaved"}


def published_dir() -> Path:
    """Where training.csv and validation.yaml live (data/reference/published)."""
    return data_dir() / "reference" / "published"


@functools.lru_cache(maxsize=4)
def _read_csv(path: str) -> tuple[dict, ...]:
    with open(path, newline="", encoding="utf-8") as f:
        return tuple(dict(r) for r in csv.DictReader(f))


def load_training_runs(path: str | Path | None = None) -> list[dict]:
    """The rows of data/reference/published/training.csv as dicts of strings (empty string = not stated), read
    with the standard library's csv reader; the same file :func:`labkit.runtime.records.load_published` reads
    with pandas."""
    return [dict(r) for r in _read_csv(str(path or published_dir() / "training.csv"))]


@functools.lru_cache(maxsize=4)
def _read_yaml(path: str) -> dict:
    return load_path(path) or {}  # PyYAML (libyaml when built), else labkit.yamlload's reader


def validation_spec(path: str | Path | None = None) -> dict:
    """data/reference/published/validation.yaml: ``runs`` (how each validated row is read) and ``skip``."""
    return _read_yaml(str(path or published_dir() / "validation.yaml"))


def _matches(row: dict, match: dict) -> bool:
    return all(str(row.get(k, "")) == str(v) for k, v in match.items())


def _int(row: dict, key: str) -> int | None:
    v = row.get(key, "")
    return int(float(v)) if str(v).strip() else None


def _float(row: dict, key: str) -> float | None:
    v = row.get(key, "")
    return float(v) if str(v).strip() else None


def _setting(entry: dict, key: str, default=None):
    for kind in ("fixed", "assumed"):
        if key in (entry.get(kind) or {}):
            return entry[kind][key]["value"], kind
    return default, None


def _schedules(row: dict, entry: dict) -> tuple[tuple, str]:
    value, kind = _setting(entry, "schedules")  # the lab's reading of the row first (validation.yaml says why)
    if value:
        return tuple(value), kind
    text = (row.get("schedule") or "").lower()
    for key, name in _SCHEDULES.items():
        if text.startswith(key):
            return (name,), "published"
    from labkit.theory.planner import SCHEDULE_CHOICES

    return SCHEDULE_CHOICES, "planner"


def _recompute(row: dict, entry: dict) -> tuple[str, str]:
    value, kind = _setting(entry, "recompute")
    if value:
        return value, kind
    text = (row.get("recompute") or "").lower()
    if text.startswith("full"):
        return "full", "published"
    if text.startswith("selective"):
        return "selective", "published"
    return "auto", "planner"


ARCH_COLUMNS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k")
#: the goals benchmarks/validate_training.py holds every validation row to (issue 26)
MFU_TOLERANCE = 0.10
MAX_RATIO_SPREAD = 1.2
STEP_VS_BEST = 1.10


def validate_published(*, mfu: float | None = None, convention: str | None = None, activations: str | None = None,
                       headroom: float = mem.DEFAULT_HEADROOM, path: str | Path | None = None,
                       sustained: float | None = None, rank: bool = True, roles=None) -> list[dict]:
    """One row per published training run (and one per skipped row, with ``skipped`` = the reason).

    For each run: ``role`` (``calibration`` rows fit :func:`fit_sustained`; ``validation`` rows never do), the
    published mesh (tp, pp, dp, cp), sequence and batch; ``accepted`` — the mesh rules and the memory calculator
    take the configuration (``error`` otherwise); ``fits`` and ``peak_gib`` — the calculator's peak on the
    heaviest stage against the GPU's usable memory, with the *source's own* schedule (and model chunks v),
    recompute and sharding (from training.csv or validation.yaml's ``fixed`` / ``assumed``: no free choice;
    ``schedule_from`` / ``recompute_from`` say where each came from); ``predicted_mfu`` — the planner's time
    model for that configuration, with the FLOP count the source uses (``flops``: model FLOPs, or with the
    recomputed forward, Megatron-LM's and Megatron-DeepSpeed's count); ``published_mfu`` — the row's MFU, or
    its TFLOP/s over the GPU's dense peak; ``ratio`` = predicted / published; with ``rank``:
    ``planner_rank`` — where the published configuration's step time falls among every mesh :func:`plan`
    ranks for the same cluster, batch and sequence (its own recompute and schedule choices), ``n_ranked``,
    ``best`` and ``best_step_s``, ``step_vs_best`` (published step time / the top pick's) and
    ``top5_tp_across_nodes`` (how many of the top 5 put a TP group across nodes).

    ``path``: a CSV in training.csv's schema (a user's own runs); a row without a validation.yaml entry names
    its model by ``preset`` (or a ``model`` that is a preset name) or by the architecture columns
    :data:`ARCH_COLUMNS`, its GPU by a data/hardware.yaml device name. ``roles``: only rows of these roles.
    ``mfu``: None (kernel model) or the constant-efficiency model's fraction; ``sustained``: None = the fitted
    value. Pure given the data files: rows are computed once per set of arguments (copies are returned).
    """
    from labkit.theory import planner

    convention = convention or planner.DEFAULT_CONVENTION
    activations = activations or planner.DEFAULT_ACTIVATIONS
    from labkit.theory.steptime import mutation_key

    rows = _validate_cached(None if mfu is None else float(mfu), convention, activations, float(headroom),
                            str(path) if path else None, None if sustained is None else float(sustained), bool(rank),
                            tuple(roles) if roles else None, mutation_key())
    return copy.deepcopy(list(rows))


def _entry_for(row: dict, spec_file: dict, user: bool) -> dict | None:
    entry = next((e for e in spec_file.get("runs", []) if _matches(row, e["match"])), None)
    if entry is not None or not user:
        return entry
    from labkit.theory.spec import ModelSpec, presets

    name = (row.get("preset") or "").strip() or (row.get("model") or "").strip()
    if name in presets():
        spec = get_spec(name)
    elif all(str(row.get(c, "")).strip() for c in ARCH_COLUMNS[:6]):
        try:
            spec = ModelSpec(n_layers=_int(row, "layers"), hidden_size=_int(row, "hidden"), n_heads=_int(row, "heads"),
                             n_kv_heads=_int(row, "kv_heads"), ffn_hidden_size=_int(row, "ffn"),
                             vocab_size=_int(row, "vocab"), n_experts=_int(row, "experts") or 0,
                             top_k=_int(row, "top_k") or 0, name=row.get("model") or "custom")
        except (TypeError, ValueError) as e:
            raise ValueError(f"row {row.get('model')!r}: the architecture columns do not make a model: {e}") from None
    else:
        raise ValueError(f"row {row.get('model')!r} names no preset (column 'preset', or 'model' = a preset of "
                         f"data/models.yaml) and not all of the architecture columns {', '.join(ARCH_COLUMNS[:6])}")
    gpu = (row.get("gpu") or "").strip()
    from labkit.theory.steptime import plannable_gpus

    if gpu not in plannable_gpus():
        raise ValueError(f"row {row.get('model')!r}: gpu={gpu!r} must be a device of data/hardware.yaml the planner "
                         f"can use: {', '.join(plannable_gpus())}")
    link = (row.get("inter_link") or "").strip() or ("ib-hdr" if gpu.startswith("a100") else "ib-ndr")
    flops = (row.get("flops") or "model").strip()
    sharding = (row.get("sharding") or "").lower()
    zero = 3 if ("fsdp" in sharding or "zero-3" in sharding) else 1
    return {"spec": spec, "preset": spec.name, "gpu": gpu, "inter_link": link, "flops": flops,
            "fixed": {"zero": {"value": zero, "source": f"sharding column {row.get('sharding')!r}"}}, "assumed": {}}


@functools.lru_cache(maxsize=32)
def _validate_cached(mfu, convention, activations, headroom, path, sustained, rank, roles, _mutation=()
                     ) -> tuple[dict, ...]:
    runs = load_training_runs(path)
    spec_file = validation_spec()
    out = []
    for row in runs:
        role = (row.get("role") or "validation").strip()
        if roles and role not in roles:
            continue
        entry = _entry_for(row, spec_file, path is not None)
        if entry is None:
            why = next((s["why"] for s in spec_file.get("skip", []) if _matches(row, s["match"])),
                       "no entry in data/reference/published/validation.yaml")
            out.append({"source": row.get("source", ""), "url": row.get("url", ""), "model": row.get("model", ""),
                        "gpus": _int(row, "gpus"), "role": role, "skipped": why})
            continue
        res = _validate_row(row, entry, mfu=mfu, convention=convention, activations=activations,
                            headroom=headroom, sustained=sustained, rank=rank)
        res["role"] = role
        out.append(res)
    return tuple(out)


def _schedule_options(schedules, vpp, pp) -> list | None:
    """The one (schedule, v) the source ran (None: the planner prices every option of ``schedules``)."""
    if pp == 1:
        return [("1f1b", 1)]
    if len(schedules) != 1:
        return None
    name = schedules[0]
    if name == "interleaved":
        return [("interleaved", int(vpp))] if vpp else None
    return [(name, 1)]


def _validate_row(row, entry, *, mfu, convention, activations, headroom, sustained=None, rank=True) -> dict:
    from labkit.theory import planner

    spec = entry.get("spec") or get_spec(entry["preset"])
    gpus = _int(row, "gpus")
    g = _int(row, "gpus_per_node") or 8
    tp, pp, cp = _int(row, "tp") or 1, _int(row, "pp") or 1, _int(row, "cp") or 1
    dp = _setting(entry, "dp", _int(row, "dp"))[0] or gpus // (tp * pp * cp)
    seq, gbs = _int(row, "seq_len"), _int(row, "global_batch_size")
    nics = entry.get("nics_per_node") or _int(row, "nics_per_node") or g
    zero = _setting(entry, "zero", 1)[0]
    split = _setting(entry, "layers_per_stage")[0]
    schedules, sched_from = _schedules(row, entry)
    vpp = _setting(entry, "vpp")[0] or _int(row, "vpp")
    recompute, rec_from = _recompute(row, entry)
    mbs_row = _int(row, "micro_batch_size")
    mbs_list = [mbs_row] if mbs_row else list(_setting(entry, "micro_batch_sizes", [1])[0])
    dev = costmodel.get_device(entry["gpu"])
    peak = float(dev["peak_bf16_tflops"])
    pub_mfu = _float(row, "mfu")
    if pub_mfu is None and _float(row, "tflops_per_gpu") is not None:
        pub_mfu = _float(row, "tflops_per_gpu") / peak
    res = {"source": row.get("source", ""), "url": row.get("url", ""), "model": row.get("model", ""),
           "preset": entry["preset"],
           "gpus": gpus, "gpu": entry["gpu"], "tp": tp, "pp": pp, "dp": dp, "cp": cp, "seq_len": seq,
           "global_batch_size": gbs, "flops": entry["flops"], "published_mfu": pub_mfu,
           "published_tflops": _float(row, "tflops_per_gpu"), "note": entry.get("note", ""),
           "assumed": {k: v["value"] for k, v in (entry.get("assumed") or {}).items()},
           "fixed": {k: v["value"] for k, v in (entry.get("fixed") or {}).items()},
           "schedule_from": sched_from, "recompute_from": rec_from, "skipped": None}
    common = dict(gpus=gpus, global_batch_size=gbs, seq_len=seq, gpu=entry["gpu"], gpus_per_node=g, zero=zero,
                  mfu=mfu, inter_link=entry["inter_link"], headroom=headroom, convention=convention,
                  activations=activations, nics_per_node=nics, layers_per_stage=split, sustained=sustained)
    # 1. accepted: the mesh rules and the calculator take the published configuration
    try:
        if seq is None or gbs is None or gpus is None:
            raise ValueError("seq_len, global_batch_size and gpus must all be stated")
        dims = ParallelDims(gpus, dp=dp, tp=tp, pp=pp, cp=cp)
        viol = {mbs: dims.violations(spec, seq_len=seq, global_batch_size=gbs, micro_batch_size=mbs,
                                     gpus_per_node=g, layers_per_stage=split) for mbs in mbs_list}
        ok = [mbs for mbs, v in viol.items() if not v]
        if not ok:
            raise ValueError("; ".join(v.message for v in viol[mbs_list[0]]))
        mbs_list = ok
        par = mem.ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=tp > 1,
                                 layers_per_stage=split)
        mem.train_memory(spec, par, mem.TrainConfig(micro_batch_size=mbs_list[0], seq_len=seq,
                                                    n_microbatches=max(1, gbs // (dp * mbs_list[0])),
                                                    convention=convention, activation_model=activations))
        res.update(accepted=True, error="")
    except ValueError as e:
        res.update(accepted=False, error=str(e), fits=None, predicted_mfu=None, ratio=None)
        return res
    # 2. the published configuration, scored by the planner's own code with the source's settings
    st, _, _, _ = planner._setup(spec, micro_batch_sizes=mbs_list, recompute=recompute, max_tp=None, max_vpp=8,
                                 first_stage_layers=None, last_stage_layers=None, sequence_parallel=True,
                                 schedules=schedules, **common)
    opts = _schedule_options(schedules, vpp, pp)
    best = None
    for mbs in mbs_list:
        c = planner.score_mesh(st, dims, mbs, schedules=opts)
        if best is None or (c.fits, -(c.step_time_s or 0)) > (best.fits, -(best.step_time_s or 0)):
            best = c
    res.update(fits=best.fits, peak_gib=(best.peak_bytes_per_gpu or 0) / mem.GiB, peak_stage=best.peak_stage,
               layers_per_stage=mem.format_split(best.layers_per_stage) if best.layers_per_stage else "-",
               schedule=best.schedule_text(), recompute=best.recompute, micro_batch_size=best.micro_batch_size,
               capacity_gib=st.topo.memory_bytes / mem.GiB, fit_reason="" if best.fits else best.reason)
    if not best.fits and entry.get("memory_override"):  # the source ran it: price it, say the calculator disagrees
        res["memory_note"] = f"{best.reason} (priced anyway: {entry['memory_override']})"
        roomy = dataclasses.replace(st, topo=dataclasses.replace(st.topo, memory_bytes=1 << 62))
        best = min((planner.score_mesh(roomy, dims, mbs, schedules=opts) for mbs in mbs_list),
                   key=lambda c: c.step_time_s or float("inf"))
        res.update(schedule=best.schedule_text(), recompute=best.recompute)
    if best.fits:
        pred = best.predicted_hfu if entry["flops"] == "with_recompute" else best.predicted_mfu
        res.update(predicted_mfu=pred, ratio=pred / pub_mfu if pub_mfu else None, step_time_s=best.step_time_s,
                   dominant=best.dominant, parts=dict(best.parts))
    else:
        res.update(predicted_mfu=None, ratio=None, step_time_s=None)
    if not rank:
        return res
    # 3. where the published configuration ranks among every mesh the planner prices for this cluster
    try:
        p = planner.plan(spec, micro_batch_sizes=mbs_list, recompute="auto", schedules=planner.SCHEDULE_CHOICES,
                         **common)
        t_pub = res.get("step_time_s")
        pos = sum(1 for c in p.candidates if t_pub is not None and c.step_time_s < t_pub * (1 - 1e-9)) + 1
        top5 = sum(1 for c in p.candidates[:5] if c.links.get("tp") not in ("-", p.assumptions["intra_link"]))
        res.update(planner_rank=pos if t_pub is not None else None, n_ranked=len(p.candidates),
                   best=p.best.mesh() + f" {p.best.schedule_text()} {p.best.recompute}", best_mfu=p.best.predicted_mfu,
                   best_step_s=p.best.step_time_s, step_vs_best=t_pub / p.best.step_time_s if t_pub else None,
                   top5_tp_across_nodes=top5,
                   planner_reason="" if t_pub else "the published configuration does not fit")
        # the same question with the source's own settings held (its recompute and schedule family): which mesh
        same = planner.plan(spec, micro_batch_sizes=mbs_list, recompute=best.recompute or "auto",
                            schedules=schedules, **common)
        pos_s = sum(1 for c in same.candidates if t_pub is not None and c.step_time_s < t_pub * (1 - 1e-9)) + 1
        res.update(same_settings_rank=pos_s if t_pub is not None else None, same_settings_n=len(same.candidates),
                   same_settings_best=same.best.mesh() + f" {same.best.schedule_text()} {same.best.recompute}",
                   step_vs_best_same_settings=t_pub / same.best.step_time_s if t_pub else None,
                   top5_tp_across_nodes_same_settings=sum(
                       1 for c in same.candidates[:5] if c.links.get("tp") not in ("-", p.assumptions["intra_link"])))
    except ValueError as e:
        res.update(planner_rank=None, n_ranked=0, best="-", best_mfu=None, best_step_s=None, step_vs_best=None,
                   top5_tp_across_nodes=None, planner_reason=str(e))
    return res


def fit_sustained(*, path: str | Path | None = None, lo: float = 0.40, hi: float = 1.0, step: float = 0.005) -> dict:
    """Fit the one free parameter of the training model per GPU, the sustained fraction of the kernel
    benchmarks' rate (:func:`labkit.theory.steptime.sustained_fraction`), on the rows whose ``role`` is
    ``calibration`` ONLY: for each GPU with calibration rows, the grid value in [lo, hi] (``step`` apart)
    minimising the sum of squared log ratios predicted / published MFU over that GPU's calibration rows.
    Returns ``value`` ({gpu: fraction}), ``rows`` (the calibration rows used) and ``residuals`` (each row's
    ratio at its fitted value). Validation rows are never priced by the fit (tests/test_training_validation.py
    changes them and checks the fit does not move). Raises ValueError when no calibration row can be priced."""
    import math

    grid = [round(lo + i * step, 6) for i in range(int(round((hi - lo) / step)) + 1)]
    by_gpu: dict = {}
    for f in grid:
        for r in validate_published(path=path, sustained=f, rank=False, roles=("calibration",)):
            if r.get("ratio"):
                by_gpu.setdefault(r["gpu"], {}).setdefault(f, []).append(r)
    if not by_gpu:
        raise ValueError("no calibration row (role == 'calibration') could be priced; nothing to fit")
    value, rows, residuals = {}, [], {}
    for gpu, per_f in sorted(by_gpu.items()):
        f = min(per_f, key=lambda x: (sum(math.log(r["ratio"]) ** 2 for r in per_f[x]), x))
        value[gpu] = f
        for r in per_f[f]:
            name = f"{r['model']} on {r['gpus']} GPUs (seq {r['seq_len']})"
            rows.append(name)
            residuals[name] = round(r["ratio"], 4)
    return {"value": value, "rows": rows, "residuals": residuals}


def store_fit(fit: dict | None = None, path: str | Path | None = None) -> dict:
    """Write :func:`fit_sustained`'s value and residuals into validation.yaml's ``fitted.sustained_fraction``
    (the ``value:`` and ``residuals:`` lines, in place; comments kept) and return the fit. Run it after a change
    to the model (tests/test_training_validation.py fails while the stored value is stale)."""
    import json
    import re

    fit = fit or fit_sustained()
    target = Path(path or published_dir() / "validation.yaml")
    text = target.read_text(encoding="utf-8")
    value = "{" + ", ".join(f"{k}: {v}" for k, v in fit["value"].items()) + "}"
    res = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fit["residuals"].items()) + "}"
    block = text.index("  sustained_fraction:")
    head, tail = text[:block], text[block:]
    tail = re.sub(r"(?m)^    value: .*$", f"    value: {value}", tail, count=1)
    tail = re.sub(r"(?m)^    residuals: .*$", f"    residuals: {res}", tail, count=1)
    target.write_text(head + tail, encoding="utf-8")
    _read_yaml.cache_clear()
    from labkit.theory import steptime

    steptime.sustained_fraction.cache_clear()
    return fit


def validation_table(rows: list[dict] | None = None) -> str:
    """The rows of :func:`validate_published` as aligned text (role, mesh, the source's schedule and recompute,
    predicted and published MFU, ratio, the published configuration's rank among the planner's meshes and its
    step time over the top pick's), then the goals (:func:`training_goals`) and the skipped rows."""
    rows = validate_published() if rows is None else rows
    lines = ["PREDICTED vs PUBLISHED training runs (published: data/reference/published/training.csv; predicted: "
             "labkit.theory.planner, compute priced kernel by kernel, one fitted parameter per GPU: "
             "calibration rows fit it, validation rows never do)",
             f"{'model':<18} {'role':<5} {'GPUs':>6} {'tp/pp/dp/cp':>12} {'fits':>5} {'peak GiB':>8} "
             f"{'schedule':>14} {'recomp':>9} {'MFU pred':>8} {'MFU pub':>7} {'ratio':>6} {'rank':>8} "
             f"{'vs #1':>6} {'same-settings':>13}  FLOPs counted"]
    for r in rows:
        if r.get("skipped"):
            continue
        mesh = f"{r['tp']}/{r['pp']}/{r['dp']}/{r['cp']}"
        role = r.get("role", "")[:5]
        if not r["accepted"]:
            lines.append(f"{r['model']:<18} {role:<5} {r['gpus']:>6} {mesh:>12}  not accepted: {r['error']}")
            continue
        rank = f"{r['planner_rank']}/{r['n_ranked']}" if r.get("planner_rank") else "-"
        pred = f"{r['predicted_mfu']:.1%}" if r.get("predicted_mfu") is not None else "-"
        pub = f"{r['published_mfu']:.1%}" if r.get("published_mfu") is not None else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") is not None else "-"
        vs = f"{r['step_vs_best']:.2f}x" if r.get("step_vs_best") else "-"
        same = (f"{r['same_settings_rank']}/{r['same_settings_n']} {r['step_vs_best_same_settings']:.2f}x"
                if r.get("step_vs_best_same_settings") else "-")
        fits = "yes" if r["fits"] else ("over" if r.get("memory_note") else "NO")
        lines.append(f"{r['model']:<18} {role:<5} {r['gpus']:>6} {mesh:>12} {fits:>5} {r['peak_gib']:>8.1f} "
                     f"{r['schedule']:>14} {r['recompute']:>9} {pred:>8} {pub:>7} {ratio:>6} {rank:>8} {vs:>6} "
                     f"{same:>13}  {r['flops']}")
    lines += ["", "rank / vs #1: where the published configuration's predicted step falls among every mesh the "
              "planner prices (its own recompute and schedule choices) and its step over the top pick's; "
              "same-settings: the same with the source's recompute and schedule family held",
              "fits 'over': the calculator puts the source's own schedule over memory; priced anyway "
              "(validation.yaml memory_override)"]
    goals = training_goals(rows)
    lines += [""] + [f"goal {g['goal']}: {'met' if g['met'] else 'NOT met'} ({g['detail']})" for g in goals]
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += ["", "not validated:"] + [f"  {r['source']}: {r['model']} on {r['gpus']} GPUs — {r['skipped']}"
                                           for r in skipped]
    return "\n".join(lines)


def training_goals(rows: list[dict], *, tolerance: float = MFU_TOLERANCE, spread: float = MAX_RATIO_SPREAD,
                   step_vs_best: float = STEP_VS_BEST) -> list[dict]:
    """The issue's goals on the ``validation`` rows of :func:`validate_published` (calibration rows excluded):

    * ``mfu``: every ratio predicted / published MFU within 1 +- ``tolerance``;
    * ``spread``: max / min of the ratios <= ``spread``;
    * ``planner``: every published configuration's step time within ``step_vs_best`` of the planner's top pick
      (free choice of recompute and schedule), and ``planner_same_settings`` with the source's held;
    * ``tp_across_nodes``: no top-5 pick with a TP group across nodes.

    Each a dict: ``goal``, ``met``, ``detail`` (the worst row). Rows without a ratio count as misses."""
    val = [r for r in rows if not r.get("skipped") and r.get("role", "validation") == "validation"]
    ratios = [(r.get("ratio"), f"{r['model']}/{r['gpus']}") for r in val]
    out = []
    bad = [(x, n) for x, n in ratios if x is None or abs(x - 1) > tolerance]
    worst = max(ratios, key=lambda t: abs((t[0] or 0) - 1)) if ratios else (None, "-")
    out.append({"goal": f"mfu within +-{tolerance:.0%} on {len(val)} validation rows", "met": bool(val) and not bad,
                "detail": f"{len(bad)} outside; furthest {worst[1]} at {worst[0] and round(worst[0], 3)}"})
    xs = [x for x, _ in ratios if x]
    sp = max(xs) / min(xs) if xs else float("inf")
    out.append({"goal": f"max/min of the ratios <= {spread}", "met": sp <= spread, "detail": f"{sp:.3f}"})
    for key, name in (("step_vs_best", "planner"), ("step_vs_best_same_settings", "planner_same_settings")):
        vs = [(r.get(key), f"{r['model']}/{r['gpus']}") for r in val]
        miss = [(x, n) for x, n in vs if x is None or x > step_vs_best]
        far = max(vs, key=lambda t: t[0] or float("inf")) if vs else (None, "-")
        out.append({"goal": f"{name}: published step within {step_vs_best - 1:.0%} of the top pick's",
                    "met": bool(vs) and not miss, "detail": f"{len(miss)} of {len(vs)} beyond; furthest {far[1]} "
                                                            f"at {far[0] and round(far[0], 3)}x"})
    tp = [(r.get("top5_tp_across_nodes"), f"{r['model']}/{r['gpus']}") for r in val]
    tp_bad = [(x, n) for x, n in tp if x]
    out.append({"goal": "tp_across_nodes: no top-5 pick with TP across nodes", "met": not tp_bad,
                "detail": ", ".join(f"{n}: {x}" for x, n in tp_bad) or "none"})
    return out
