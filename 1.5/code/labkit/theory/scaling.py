"""Strong and weak scaling, predicted (pure Python, no torch): the runs of a series and the work of the
lab's data-parallel training step before it runs.

* **Strong scaling** keeps the total work fixed and spreads it over more ranks: each of ``n`` ranks does
  ``total / n``. Ideal: the time falls as ``n0 / n``.
* **Weak scaling** keeps the work per rank fixed: ``n`` ranks do ``n`` times the work. Ideal: the time stays
  flat.

The measured side (the experiments, the series runner, speedup and efficiency with their baseline) is
:mod:`labkit.experiments.scaling`.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.checks import check_divides, positive_int
from labkit.theory.spec import flops_per_token, flops_per_token_terms, get_spec

MODES = ("strong", "weak")


def cases_for(world_size: int, *, strong_total: int | None = None, weak_per_rank: int | None = None) -> list[dict]:
    """The runs at one world size: ``{"mode", "work_per_rank", "total_work"}`` for strong (``strong_total``
    split evenly) and/or weak (``weak_per_rank`` each). Raises ValueError if world_size does not divide
    strong_total (listing the world sizes that do) or neither mode is asked for."""
    world_size = positive_int("world_size", world_size)
    if strong_total is None and weak_per_rank is None:
        raise ValueError("give strong_total (strong scaling), weak_per_rank (weak scaling) or both")
    out = []
    if strong_total is not None:
        strong_total = positive_int("strong_total", strong_total)
        check_divides("world_size", world_size, "strong_total", strong_total,
                      hint="strong scaling splits the total work evenly over the ranks")
        out.append({"mode": "strong", "work_per_rank": strong_total // world_size, "total_work": strong_total})
    if weak_per_rank is not None:
        weak_per_rank = positive_int("weak_per_rank", weak_per_rank)
        out.append({"mode": "weak", "work_per_rank": weak_per_rank, "total_work": weak_per_rank * world_size})
    return out


def predict_train(model: str = "lab-tiny-llama", world_sizes: Sequence[int] = (1, 2, 4), *, seq_len: int = 32,
                  strong_total: int | None = None, weak_per_rank: int | None = None, peak_flops_per_rank: float,
                  cores: int, threads_per_rank: int = 1, bytes_per_param: int = 4) -> list[dict]:
    """*Predicted* work of :func:`labkit.experiments.scaling.train_experiment` per (mode, world size), before
    running it, one dict per row:

    * ``flops`` — one step over every rank: tokens × :func:`labkit.theory.spec.flops_per_token` (training,
      PaLM Appendix B), and its two terms, ``flops_dense`` (tokens × 6N) and ``flops_attention`` (tokens ×
      12·L·heads·head_dim·T) (:func:`labkit.theory.spec.flops_per_token_terms`);
    * ``compute_s_at_peak`` — one rank's FLOPs at ``peak_flops_per_rank``, slowed by ``n·threads / cores``
      when the ranks need more cores than there are (they take turns): a lower bound on the step time;
    * ``allreduce_bytes_per_rank`` — what DDP's ring all-reduce of the gradients sends per rank per step,
      ``2(n-1)/n × n_params × bytes_per_param`` (Patarasuk & Yuan 2009), 0 on one rank.

    Raises ValueError as :func:`cases_for`, or for an unknown model."""
    spec = get_spec(model)
    cores = positive_int("cores", cores)
    threads_per_rank = positive_int("threads_per_rank", threads_per_rank)
    fpt = flops_per_token(spec, seq_len, training=True)
    terms = flops_per_token_terms(spec, seq_len, training=True)
    rows = []
    for n in world_sizes:
        for case in cases_for(n, strong_total=strong_total, weak_per_rank=weak_per_rank):
            per_rank = case["work_per_rank"] * seq_len * fpt
            slow = max(1.0, n * threads_per_rank / cores)
            rows.append({"mode": case["mode"], "world_size": n, "work_per_rank": case["work_per_rank"],
                         "tokens": case["total_work"] * seq_len, "flops": case["total_work"] * seq_len * fpt,
                         "flops_dense": case["total_work"] * seq_len * terms["dense"],
                         "flops_attention": case["total_work"] * seq_len * terms["attention"],
                         "compute_s_at_peak": per_rank / peak_flops_per_rank * slow,
                         "allreduce_bytes_per_rank": int(2 * (n - 1) / n * spec.n_params() * bytes_per_param),
                         "source": "predicted"})
    return rows
