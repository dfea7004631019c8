"""The pipeline-stage split: which layers a pipeline rank holds, and how many micro-batches' activations
it keeps in flight under each schedule. Pure Python.

The training budget and the parameter placement (:func:`labkit.theory.memory.params.local_param_tensors`)
take their layers per pipeline rank from :func:`stage_layers`, so a stage split other than n_layers/pp goes here.
"""

from __future__ import annotations

from labkit.checks import check_choice, check_divides, positive_int
from labkit.theory.memory.conventions import SCHEDULES


def stage_layers(n_layers: int, pp: int, vpp: int, stage: int) -> list[int]:
    """Layers held by pipeline rank ``stage``: with vpp model chunks per rank, chunk c of rank i holds the
    (c·pp + i)-th block of n_layers/(pp·vpp) consecutive layers (Narayanan et al. 2021, Sec. 2.2.2).
    Raises ValueError unless pp·vpp divides n_layers and 0 <= stage < pp."""
    pp, vpp = positive_int("pp", pp), positive_int("vpp", vpp)
    check_divides("pp*vpp", pp * vpp, "n_layers", n_layers)
    if not (isinstance(stage, int) and 0 <= stage < pp):
        raise ValueError(f"stage={stage!r} must be a pipeline rank in 0..{pp - 1}")
    per_chunk = n_layers // (pp * vpp)
    return [(c * pp + stage) * per_chunk + j for c in range(vpp) for j in range(per_chunk)]



def in_flight_microbatches(schedule: str, pp: int, n_microbatches: int, vpp: int = 1, stage: int = 0) -> float:
    """How many micro-batches' activations pipeline rank ``stage`` holds at its peak, in units of its whole
    share of layers.

    * pp = 1: 1 (gradient accumulation runs each micro-batch's forward and backward in turn);
    * GPipe (Huang et al. 2019): all m;
    * 1F1B (Narayanan et al. 2021, PipeDream-Flush): min(m, pp - stage);
    * interleaved with v chunks (Megatron-LM's warm-up of 2(pp - stage - 1) + (v - 1)·pp chunks, plus one):
      min(m, (2(pp - stage - 1) + (v - 1)·pp + 1)/v); on stage 0 this is pp·(1 + (pp - 1)/(pp·v)),
      Korthikanti et al. 2022, Sec. 4.2.3.
    """
    check_choice("schedule", schedule, SCHEDULES)
    pp, m, vpp = positive_int("pp", pp), positive_int("n_microbatches", n_microbatches), positive_int("vpp", vpp)
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} must be in 0..{pp - 1}")
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - stage))
    return float(min(m, (2 * (pp - stage - 1) + (vpp - 1) * pp + 1) / vpp))
