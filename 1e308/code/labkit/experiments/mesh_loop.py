"""Estimate, then measure (chapter 09): the planner's predicted step for a few meshes of ``world_size`` GPUs,
beside an emulated run of the same mesh — the lab's model trained for real on dp x tp x pp ranks
(:func:`labkit.experiments.emulate.step3d_rank`) and charged as a named model on a named cluster
(:mod:`labkit.runtime.emulate`). One warm pool of ``world_size`` ranks runs every mesh (one launch each: a launch
charges every group with one mesh's dims, so meshes are not mixed in one launch).
"""

from __future__ import annotations

import pandas as pd

from labkit.checks import positive_int

#: the parts of the planner's prediction the table keeps (seconds, predicted)
PLANNER_PARTS = ("compute_s", "bubble_s", "tp_s", "pp_s", "dp_s")


def candidate_meshes(world_size: int, lab_model: str = "lab-tiny-llama", preset: str = "llama-3-8b",
                     global_batch_size: int | None = None) -> list[tuple]:
    """Every (dp, tp, pp) with dp*tp*pp = ``world_size`` and pp >= 2 (the run is a 1F1B pipeline) that both the
    lab model (which the ranks run) and ``preset`` (what the run is charged as) can take: tp divides the heads
    and kv heads, pp the layers; with ``global_batch_size``, dp divides it into at least pp micro-batches of one
    sequence per dp rank."""
    from labkit.theory.spec import get_spec

    n = positive_int("world_size", world_size)
    specs = [get_spec(lab_model), get_spec(preset)]
    out = []
    for tp in range(1, n + 1):
        for pp in range(2, n // tp + 1):  # step3d_rank runs a 1F1B pipeline: pp >= 2
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if global_batch_size is not None and (global_batch_size % dp or global_batch_size // dp < pp):
                continue
            if all(s.n_heads % tp == 0 and s.n_kv_heads % tp == 0 and s.n_layers % pp == 0 for s in specs):
                out.append((dp, tp, pp))
    return out


def default_global_batch(world_size: int) -> int:
    """The loop's global batch chosen from ``world_size``: world_size sequences (the default meshes then have
    at least pp micro-batches per dp rank)."""
    return positive_int("world_size", world_size)


def default_meshes(world_size: int, lab_model: str = "lab-tiny-llama", preset: str = "llama-3-8b",
                   global_batch_size: int | None = None) -> list[tuple]:
    """Up to three contrasting meshes of ``world_size`` GPUs: the shallowest pipeline with the most data
    parallelism, the widest tensor parallelism, and the deepest pipeline. ValueError naming the valid world
    sizes when there is none (an odd world size: pp >= 2 and the lab model's 4 layers)."""
    gbs = default_global_batch(world_size) if global_batch_size is None else global_batch_size
    cands = candidate_meshes(world_size, lab_model, preset, gbs)
    if not cands:
        raise ValueError(f"no dp x tp x pp mesh of {world_size} GPUs with pp >= 2 fits {lab_model} run as {preset} "
                         "(pp divides the layers, tp the heads); use an even world_size (2, 4, 8, ...)")
    picks = [min(cands, key=lambda m: (m[2], -m[0])),
             max(cands, key=lambda m: (m[1], -m[2])),
             max(cands, key=lambda m: (m[2], m[0]))]
    out = []
    for m in picks:
        if m not in out:
            out.append(m)
    return out


def mesh_name(mesh) -> str:
    dp, tp, pp = mesh
    return f"dp={dp} tp={tp} pp={pp}"


def run_loop(world_size: int, meshes, *, cluster="dgx-h100", preset: str = "llama-3-8b", seq_len: int = 8192,
             global_batch_size: int | None = None, steps: int = 1, lab_model: str = "lab-tiny-llama",
             lab_seq_len: int = 32, timeout_s: float = 300.0) -> pd.DataFrame:
    """For each (dp, tp, pp) of ``meshes``: one emulated launch of :func:`step3d_rank` on ``world_size`` warm
    ranks charged as ``preset`` (``seq_len`` tokens; the same ``global_batch_size`` sequences for every mesh,
    default :func:`default_global_batch`: micro-batches of one sequence, global_batch_size / dp per dp rank)
    on ``cluster``, and :func:`labkit.experiments.emulate.step3d_vs_planner` for the same mesh.

    Returns one row per mesh: ``mesh``, ``dp``, ``tp``, ``pp``, ``m`` (micro-batches per dp rank),
    ``emulated_s``, ``planner_s``, ``ratio``
    (emulated / planner), ``imbalance``, ``simulated_s``, ``balanced_s``, the planner's parts
    (:data:`PLANNER_PARTS`), ``losses_ok`` (the real run's losses equal the single-process reference's, rel
    1e-5). ``attrs``: ``label`` (``emulated (<profile>, as <preset>)``), ``cmps`` (the comparisons),
    ``timelines`` (mesh name -> emulated timeline), ``wall_s`` (measured, all launches). Raises ValueError for a
    mesh that does not multiply to ``world_size`` or that a model cannot take, before any launch."""
    import math
    import time

    from labkit.experiments.emulate import step3d_charge, step3d_rank
    from labkit.models import train_reference
    from labkit.runtime.launcher import launch
    from labkit.theory.mesh import ParallelDims

    n = positive_int("world_size", world_size)
    gbs = default_global_batch(n) if global_batch_size is None else positive_int("global_batch_size", global_batch_size)
    valid = candidate_meshes(n, lab_model, preset, gbs)
    meshes = [tuple(int(x) for x in mesh) for mesh in meshes]
    for mesh in meshes:
        if mesh not in valid:
            raise ValueError(f"mesh dp, tp, pp = {mesh} is not a valid mesh of {n} GPUs for {lab_model} run as "
                             f"{preset} with a global batch of {gbs}; valid: {valid}")
    runs = []
    t0 = time.perf_counter()
    for dp, tp, pp in meshes:
        dims, m = ParallelDims(n, dp=dp, tp=tp, pp=pp), gbs // dp
        charge = step3d_charge(dims, preset=preset, seq_len=seq_len, lab_model=lab_model, lab_seq_len=lab_seq_len,
                               cluster=cluster)
        res = launch(step3d_rank, n, dp, tp, pp, model=lab_model, seq_len=lab_seq_len, n_microbatches=m,
                     steps=steps, emulate=charge, keep_warm=True, echo=False, timeout_s=timeout_s)
        ref = train_reference(lab_model, steps=steps, global_batch_size=dp * m, seq_len=lab_seq_len,
                              n_microbatches=m)
        ok = all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(res[-1]["losses"], ref["losses"]))
        runs.append({"dims": dims, "m": m, "emulation": res.emulation, "timeline": res.timeline, "losses_ok": ok})
    df = compare_meshes(runs, preset=preset, seq_len=seq_len)
    df.attrs.update(lab_seq_len=lab_seq_len, lab_model=lab_model, global_batch_size=gbs,
                    wall_s=time.perf_counter() - t0)
    return df


def compare_meshes(runs: list[dict], *, preset: str, seq_len: int) -> pd.DataFrame:
    """The table of :func:`run_loop` from its ``attrs["runs"]`` (each: ``dims``, ``m``, ``emulation``, the
    measured ``timeline``, ``losses_ok``): the emulated step of each mesh beside the planner's for the same mesh."""
    from labkit.experiments.emulate import step3d_vs_planner

    rows, cmps, timelines = [], {}, {}
    for run in runs:
        dims, emu = run["dims"], run["emulation"]
        frame = emu.retime(run["timeline"])
        cmp = step3d_vs_planner(emu, frame, dims, preset=preset, seq_len=seq_len, n_microbatches=run["m"])
        name = mesh_name((dims.dp, dims.tp, dims.pp))
        cmps[name], timelines[name] = cmp, frame
        rows.append({"mesh": name, "dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "m": run["m"],
                     "emulated_s": cmp["emulated_s"],
                     "planner_s": cmp["planner_s"], "ratio": cmp["ratio"], "imbalance": cmp["imbalance"],
                     "simulated_s": cmp["simulated_s"], "balanced_s": cmp["balanced_s"],
                     **{k: cmp["planner"][k] for k in PLANNER_PARTS}, "losses_ok": run["losses_ok"]})
    df = pd.DataFrame(rows)
    df.attrs.update(label=runs[0]["emulation"].label if runs else None, cmps=cmps, timelines=timelines,
                    preset=preset, seq_len=seq_len, runs=runs)
    return df


def reprice(df: pd.DataFrame, cluster) -> pd.DataFrame:
    """:func:`run_loop`'s table re-priced on another cluster profile without running again (the recorded
    traces charged on ``cluster``: a name, e.g. ``"dgx-a100"``, or a Cluster)."""
    from labkit.experiments.emulate import step3d_charge

    a = df.attrs
    runs = [{**r, "emulation": r["emulation"].reprice(step3d_charge(
        r["dims"], preset=a["preset"], seq_len=a["seq_len"], lab_model=a.get("lab_model", "lab-tiny-llama"),
        lab_seq_len=a.get("lab_seq_len", 32), cluster=cluster))} for r in a["runs"]]
    out = compare_meshes(runs, preset=a["preset"], seq_len=a["seq_len"])
    out.attrs.update({k: a[k] for k in ("lab_model", "lab_seq_len", "global_batch_size") if k in a})
    return out
