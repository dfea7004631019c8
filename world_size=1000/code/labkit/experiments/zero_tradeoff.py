"""Chapter 04's emulated trade-off: ZeRO stages' step time on a named cluster (emulated, charged as a preset)
beside their model-state bytes per rank (predicted: Rajbhandari et al. 2020, Figure 1), and a formula for the
step (:func:`predicted_zero_step_s`). The ranks run :func:`labkit.experiments.zero.run_rank`; this module
reads the emulated clock of its runs (:func:`emulated_run_steps`).
"""

from __future__ import annotations

from labkit.theory.zero import STAGE_OF

#: the collectives of one step per stage, as (op, multiple of the full bf16 parameter bytes S = 2N)
STAGE_COLLECTIVES = {0: (("all_reduce", 1),), 1: (("reduce_scatter", 1), ("all_gather", 1)),
                     2: (("reduce_scatter", 1), ("all_gather", 1)),
                     3: (("all_gather", 2), ("reduce_scatter", 1))}


def emulated_run_steps(result, emulation=None) -> dict:
    """{run label: emulated seconds per step} of a :func:`labkit.experiments.zero.run_rank` launch (each
    run's measured window, every rank's, mapped onto the emulated clock of ``emulation``, default the
    launch's; the slowest rank; divided by the run's timed steps)."""
    from labkit.experiments.common import _runs

    em = emulation or result.emulation
    out = {}
    for r, runs in enumerate(_runs(result)):
        for run in runs:
            lo, hi = run["window_ns"]
            s = (em.map_ns(r, hi) - em.map_ns(r, lo)) / 1e9 / max(len(run["step_s"]), 1)
            out[run["label"]] = max(out.get(run["label"], 0.0), s)
    return out


def predicted_zero_step_s(cluster, preset, seq_len: int, sequences_per_rank: int, n: int, stage: int) -> dict:
    """Predicted step of ZeRO ``stage`` on ``n`` GPUs of ``cluster`` for ``preset`` (a ModelSpec), nothing
    overlapped: compute flops_per_token(preset, seq_len) x sequences_per_rank x seq_len / (bf16 peak x
    compute_efficiency) (PaLM App. B) plus the stage's collectives of :data:`STAGE_COLLECTIVES` on the bf16
    parameters (S = 2N, ``cluster.collective_s``; Sec. 7.2 of the ZeRO paper: stage 3 = 1.5x DDP's bytes).
    Returns {"compute_s", "comm_s", "step_s"}."""
    from labkit.theory.spec import flops_per_token

    flops = flops_per_token(preset, seq_len) * sequences_per_rank * seq_len
    compute = flops / (cluster.device.peak_flops("bf16") * cluster.compute_efficiency)
    s = 2 * preset.n_params()
    comm = sum(k * cluster.collective_s(op, s, tuple(range(n))) for op, k in STAGE_COLLECTIVES[stage])
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm}


def tradeoff_rows(steps: dict, cluster, preset, seq_len: int, sequences_per_rank: int, n: int,
                  label: str) -> list[dict]:
    """One row per variant of ``steps`` (:func:`emulated_run_steps`): ``stage``, ``memory_gb`` (model states
    per rank, predicted: :func:`labkit.theory.memory.zero_model_state_bytes`, 2 + 2 + 12 bytes per
    parameter), ``fits`` (<= the device's memory), ``emulated_step_s``, ``predicted_step_s``, ``source``."""
    from labkit.theory import memory

    rows = []
    for variant, t in steps.items():
        stage = STAGE_OF[variant]
        mem = memory.zero_model_state_bytes(preset.n_params(), n, stage) / 1e9
        pred = predicted_zero_step_s(cluster, preset, seq_len, sequences_per_rank, n, stage)
        rows.append({"variant": variant, "stage": stage, "memory_gb": mem,
                     "fits": mem <= cluster.device.memory_bytes / 1e9, "emulated_step_s": t,
                     "predicted_step_s": pred["step_s"], "source": label})
    return rows
