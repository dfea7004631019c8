"""Chapter 04 (sharded data parallelism: ZeRO-1/2/3 and FSDP2): its parameter check, the one rank function
it launches, and the two tables it shows: model-state bytes predicted per (degree, variant), and bytes per
collective measured beside the formula.

The strategies are in :mod:`labkit.parallel.zero`, their formulas in :mod:`labkit.theory.zero`, the runs in
:mod:`labkit.experiments.zero`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import check_choice, positive_int
from labkit.experiments.common import _runs
from labkit.experiments.zero import memory_rank, run_rank
from labkit.theory.data import check_batch
from labkit.theory.zero import STAGE_OF, VARIANTS, layout_bytes, padded_params, predicted_comm_bytes


def check_chapter(*, world_size, model: str = "lab-tiny-llama", global_batch_size=8, steps=3, seq_len=32) -> dict:
    """Chapter 04's parameters, all checked before any launch (the chapter's first cell after its parameters).

    world_size >= 2 (with one rank nothing is sharded: every stage holds the same bytes and sends nothing);
    a known ``model`` small enough for the machine; ``steps`` >= 1; world_size divides ``global_batch_size``
    (then so does every degree the memory sweep uses, each a divisor of world_size); ``seq_len`` within the
    model's ``max_seq_len``. Returns the checked values. Raises ValueError naming the value and the fix.
    """
    from labkit.theory.spec import get_spec

    n = check_world_size("04", world_size, why="with one rank nothing is sharded, so every stage holds "
                                 "the same bytes and sends none")
    spec = get_spec(model)
    steps = positive_int("steps", steps)
    local = check_batch(n, global_batch_size, dp_name="world_size")
    seq_len = spec.check_seq_len(seq_len)
    check_fits_in_memory(spec, n, copies=2, what="chapter 04")
    return {"world_size": n, "model": spec.name, "global_batch_size": global_batch_size, "local_batch_size": local,
            "steps": steps, "seq_len": seq_len}


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
