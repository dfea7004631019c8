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
import functools
from pathlib import Path

import yaml

from labkit.paths import data_dir
from labkit.theory import costmodel
from labkit.theory import memory as mem
from labkit.theory.mesh import ParallelDims
from labkit.theory.spec import get_spec

#: the band the validation test holds every row's predicted/published MFU ratio to (tests/test_planner.py)
MFU_BAND = (0.75, 1.25)
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
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}  # libyaml when built


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


def validate_published(*, mfu: float | None = None, convention: str | None = None, activations: str | None = None,
                       headroom: float = mem.DEFAULT_HEADROOM, path: str | Path | None = None) -> list[dict]:
    """One row per published training run (and one per skipped row, with ``skipped`` = the reason).

    For each run: the published mesh (tp, pp, dp, cp), sequence and batch; ``accepted`` — the mesh rules and the
    memory calculator take the configuration (uneven stages included; ``error`` otherwise); ``fits`` and
    ``peak_gib`` — the calculator's peak on the heaviest stage against the GPU's usable memory, with the
    published settings (schedule family, recompute, ZeRO, micro-batch where stated or fixed, else the planner's
    fastest fitting choice: ``chosen``); ``predicted_mfu`` — the planner's time model for that configuration,
    with the FLOP count the source uses (``flops``: model FLOPs, or with the recomputed forward, which is
    Megatron-LM's and Megatron-DeepSpeed's count); ``published_mfu`` — the row's MFU, or its TFLOP/s over the
    GPU's dense peak; ``ratio`` = predicted / published; ``planner_rank`` — where :func:`plan` with the same
    cluster, batch and sequence (its own recompute and schedule choices) ranks the published mesh (None with
    ``planner_reason`` when it rejects it), ``n_ranked`` and the planner's ``best`` mesh.

    ``mfu``, ``convention``, ``activations``, ``headroom``: the planner's assumptions (defaults: the planner's).
    Pure given the data files, so the rows are computed once per set of arguments (copies are returned).
    """
    from labkit.theory import planner

    mfu = planner.DEFAULT_MFU if mfu is None else mfu
    convention = convention or planner.DEFAULT_CONVENTION
    activations = activations or planner.DEFAULT_ACTIVATIONS
    rows = _validate_cached(float(mfu), convention, activations, float(headroom), str(path) if path else None)
    return copy.deepcopy(list(rows))


@functools.lru_cache(maxsize=8)
def _validate_cached(mfu, convention, activations, headroom, path) -> tuple[dict, ...]:
    runs = load_training_runs(path)
    spec_file = validation_spec()
    out = []
    for row in runs:
        entry = next((e for e in spec_file.get("runs", []) if _matches(row, e["match"])), None)
        if entry is None:
            why = next((s["why"] for s in spec_file.get("skip", []) if _matches(row, s["match"])),
                       "no entry in data/reference/published/validation.yaml")
            out.append({"source": row["source"], "url": row["url"], "model": row["model"], "gpus": _int(row, "gpus"),
                        "skipped": why})
            continue
        out.append(_validate_row(row, entry, mfu=mfu, convention=convention, activations=activations,
                                 headroom=headroom))
    return tuple(out)


def _validate_row(row, entry, *, mfu, convention, activations, headroom) -> dict:
    from labkit.theory import planner

    spec = get_spec(entry["preset"])
    gpus = _int(row, "gpus")
    g = _int(row, "gpus_per_node") or 8
    tp, pp, cp = _int(row, "tp") or 1, _int(row, "pp") or 1, _int(row, "cp") or 1
    dp = _setting(entry, "dp", _int(row, "dp"))[0] or gpus // (tp * pp * cp)
    seq, gbs = _int(row, "seq_len"), _int(row, "global_batch_size")
    nics = entry.get("nics_per_node") or _int(row, "nics_per_node") or g
    zero = _setting(entry, "zero", 1)[0]
    split = _setting(entry, "layers_per_stage")[0]
    schedules, sched_from = _schedules(row, entry)
    recompute, rec_from = _recompute(row, entry)
    mbs_row = _int(row, "micro_batch_size")
    mbs_list = [mbs_row] if mbs_row else list(_setting(entry, "micro_batch_sizes", [1])[0])
    dev = costmodel.get_device(entry["gpu"])
    peak = float(dev["peak_bf16_tflops"])
    pub_mfu = _float(row, "mfu")
    if pub_mfu is None and _float(row, "tflops_per_gpu") is not None:
        pub_mfu = _float(row, "tflops_per_gpu") / peak
    res = {"source": row["source"], "url": row["url"], "model": row["model"], "preset": entry["preset"],
           "gpus": gpus, "gpu": entry["gpu"], "tp": tp, "pp": pp, "dp": dp, "cp": cp, "seq_len": seq,
           "global_batch_size": gbs, "flops": entry["flops"], "published_mfu": pub_mfu,
           "published_tflops": _float(row, "tflops_per_gpu"), "note": entry.get("note", ""),
           "assumed": {k: v["value"] for k, v in (entry.get("assumed") or {}).items()},
           "fixed": {k: v["value"] for k, v in (entry.get("fixed") or {}).items()},
           "schedule_from": sched_from, "recompute_from": rec_from, "skipped": None}
    common = dict(gpus=gpus, global_batch_size=gbs, seq_len=seq, gpu=entry["gpu"], gpus_per_node=g, zero=zero,
                  mfu=mfu, inter_link=entry["inter_link"], headroom=headroom, convention=convention,
                  activations=activations, nics_per_node=nics, schedules=schedules,
                  layers_per_stage=split)
    # 1. accepted: the mesh rules and the calculator take the published configuration
    try:
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
    # 2. the published configuration, scored by the planner's own code (fits, schedule, predicted MFU)
    st, _, _, _ = planner._setup(spec, micro_batch_sizes=mbs_list, recompute=recompute, max_tp=None, max_vpp=8,
                                 first_stage_layers=None, last_stage_layers=None, sequence_parallel=True, **common)
    best = None
    for mbs in mbs_list:
        c = planner.score_mesh(st, dims, mbs)
        if best is None or (c.fits, -(c.step_time_s or 0)) > (best.fits, -(best.step_time_s or 0)):
            best = c
    res.update(fits=best.fits, peak_gib=(best.peak_bytes_per_gpu or 0) / mem.GiB, peak_stage=best.peak_stage,
               layers_per_stage=mem.format_split(best.layers_per_stage) if best.layers_per_stage else "-",
               schedule=best.schedule_text(), recompute=best.recompute, micro_batch_size=best.micro_batch_size,
               capacity_gib=st.topo.memory_bytes / mem.GiB, fit_reason="" if best.fits else best.reason)
    if best.fits:
        pred = best.predicted_hfu if entry["flops"] == "with_recompute" else best.predicted_mfu
        res.update(predicted_mfu=pred, ratio=pred / pub_mfu if pub_mfu else None, step_time_s=best.step_time_s,
                   dominant=best.dominant)
    else:
        res.update(predicted_mfu=None, ratio=None)
    # 3. where the planner ranks the published mesh among every mesh of the cluster
    try:
        p = planner.plan(spec, micro_batch_sizes=mbs_list, recompute="auto", **common)
        c = p.find(dp=dp, tp=tp, pp=pp, cp=cp)
        res.update(planner_rank=c.rank if c else None, n_ranked=len(p.candidates), best=p.best.mesh()
                   + f" {p.best.schedule_text()} {p.best.recompute}", best_mfu=p.best.predicted_mfu,
                   planner_reason="" if c and c.rank else (c.reason if c else "not enumerated"))
    except ValueError as e:
        res.update(planner_rank=None, n_ranked=0, best="-", best_mfu=None, planner_reason=str(e))
    return res


def validation_table(rows: list[dict] | None = None) -> str:
    """The rows of :func:`validate_published` as aligned text, then the skipped rows with their reasons."""
    rows = validate_published() if rows is None else rows
    lines = ["PREDICTED vs PUBLISHED training runs (published: data/reference/published/training.csv; predicted: "
             "labkit.theory.planner with its default assumptions)",
             f"{'model':<18} {'GPUs':>6} {'mesh tp/pp/dp/cp':>17} {'acc':>4} {'fits':>5} {'peak GiB':>8} "
             f"{'split':>10} {'schedule':>14} {'recomp':>9} {'rank':>9} {'MFU pred':>8} {'MFU pub':>7} {'ratio':>6}"
             "  FLOPs counted"]
    for r in rows:
        if r.get("skipped"):
            continue
        mesh = f"{r['tp']}/{r['pp']}/{r['dp']}/{r['cp']}"
        if not r["accepted"]:
            lines.append(f"{r['model']:<18} {r['gpus']:>6} {mesh:>17} {'no':>4}  {r['error']}")
            continue
        rank = f"{r['planner_rank']}/{r['n_ranked']}" if r.get("planner_rank") else "rejected"
        pred = f"{r['predicted_mfu']:.1%}" if r.get("predicted_mfu") is not None else "-"
        pub = f"{r['published_mfu']:.1%}" if r.get("published_mfu") is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else "-"
        lines.append(f"{r['model']:<18} {r['gpus']:>6} {mesh:>17} {'yes':>4} {'yes' if r['fits'] else 'NO':>5} "
                     f"{r['peak_gib']:>8.1f} {r['layers_per_stage']:>10} {r['schedule']:>14} {r['recompute']:>9} "
                     f"{rank:>9} {pred:>8} {pub:>7} {ratio:>6}  {r['flops']}")
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += ["", "not validated:"] + [f"  {r['source']}: {r['model']} on {r['gpus']} GPUs — {r['skipped']}"
                                           for r in skipped]
    return "\n".join(lines)
