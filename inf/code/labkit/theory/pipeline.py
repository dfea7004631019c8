"""A pipeline run's configuration, checked before anything launches: how the layers split into stages and
every option of a job of :func:`labkit.experiments.pipeline.run_pipelines`.

Pure Python (no torch): the schedules themselves and their simulator are in :mod:`labkit.theory.simulate`.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.theory import simulate as sim
from labkit.theory.simulate import OpCosts

COMPUTE_MODES = ("fixed", "real")
IMPLS = ("labkit", "torch")
COMPUTE_OPS = ("F", "B", "W")
#: default stand-in op costs (seconds) for fixed compute: long enough that scheduling noise is small
DEFAULT_FIXED_COSTS = OpCosts(f=0.02, b=0.02, w=0.02)
#: every option a job dict may carry
JOB_OPTIONS = frozenset({"schedule", "n_microbatches", "v", "compute", "impl", "costs", "spec", "global_batch_size",
                         "seq_len", "layers_per_stage", "steps", "warmup_steps", "lr", "seed", "data_seed",
                         "fixed_nbytes", "return_grads", "label"})


def stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers held by each global stage: equal (``n_layers / n_stages`` each) or ``layers_per_stage``.

    Raises ValueError when ``n_stages`` (= pp*v) does not divide ``n_layers`` and no explicit split is given,
    or when the explicit split has the wrong length, a stage with no layer, or the wrong total.
    """
    n_layers = positive_int("n_layers", n_layers)
    n_stages = positive_int("pp*v", n_stages)
    if layers_per_stage is None:
        check_divides("pp*v", n_stages, "n_layers", n_layers,
                      hint="or give an uneven split with layers_per_stage=(...) (one count per stage)")
        return (n_layers // n_stages,) * n_stages
    counts = tuple(positive_int(f"layers_per_stage[{i}]", c) for i, c in enumerate(layers_per_stage))
    if len(counts) != n_stages:
        raise ValueError(f"layers_per_stage has {len(counts)} entries but pp*v={n_stages} stages need one each")
    if sum(counts) != n_layers:
        raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, not n_layers={n_layers}")
    return counts


def check_job(job: dict, pp: int) -> dict:
    """Validate one pipeline configuration and fill its defaults; returns the completed job dict.

    Checks, each raising ValueError that names the fix: schedule name, pp >= 2, v, n_microbatches enough
    for the schedule (and a multiple of pp for interleaved), compute mode and impl, costs (fixed), the model
    spec, ``global_batch_size`` divisible by ``n_microbatches`` (equal micro-batches: an uneven split such as
    8 over 3 gives (3, 3, 2) and the averaged loss no longer matches), ``n_layers`` divisible by pp*v unless
    ``layers_per_stage`` is given, ``seq_len`` within the model's ``max_seq_len``, and the torch impl's limits.
    """
    job = dict(job)
    unknown = sorted(set(job) - JOB_OPTIONS)
    if unknown:
        raise ValueError(f"unknown pipeline option(s) {', '.join(unknown)}; valid: {', '.join(sorted(JOB_OPTIONS))}")
    job.setdefault("schedule", "1f1b")
    job.setdefault("v", 2 if job["schedule"] == "interleaved" else 1)
    job.setdefault("n_microbatches", 2 * pp)
    job.setdefault("compute", "fixed")
    job.setdefault("impl", "labkit")
    name, p, m, v = sim.check_schedule_args(job["schedule"], pp, job["n_microbatches"], job["v"])
    job.update(schedule=name, n_microbatches=m, v=v)
    check_choice("compute", job["compute"], COMPUTE_MODES)
    check_choice("impl", job["impl"], IMPLS)
    job["steps"] = positive_int("steps", job.get("steps", 2))
    job["warmup_steps"] = positive_int("warmup_steps", job.get("warmup_steps", 1), minimum=0)
    job.setdefault("return_grads", False)
    vs = f" v={v}" if v > 1 else ""
    job.setdefault("label", f"{job['impl']} {name} pp={p} m={m}{vs} ({job['compute']})")
    if job["impl"] == "torch" and job["compute"] != "real":
        raise ValueError("impl='torch' runs the model (torch.distributed.pipelining drives real stage modules); "
                         "use compute='real' with impl='torch', or impl='labkit' for fixed compute")
    if job["compute"] == "fixed":
        costs = job.get("costs") or DEFAULT_FIXED_COSTS
        if not isinstance(costs, OpCosts):
            raise ValueError(f"costs={costs!r} must be a labkit.theory.simulate.OpCosts (seconds per op)")
        costs.resolve(p * v)  # raises for bad values / wrong per-stage length
        job["costs"] = costs
        job["fixed_nbytes"] = positive_int("fixed_nbytes", job.get("fixed_nbytes", 4096), minimum=4)
        return job
    from labkit.theory.spec import ModelSpec, get_spec

    spec = job.get("spec") or "lab-tiny-llama"
    spec = get_spec(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec={spec!r} must be a ModelSpec or a preset name")
    if spec.is_moe:
        raise ValueError(f"spec {spec.name!r} is a mixture-of-experts model; the pipeline runner splits dense "
                         "models (use a dense preset such as 'lab-tiny-llama')")
    job["spec"] = spec
    job["layers_per_stage"] = stage_layer_counts(spec.n_layers, p * v, job.get("layers_per_stage"))
    gbs = positive_int("global_batch_size", job.get("global_batch_size") or 2 * m)
    check_divides("n_microbatches", m, "global_batch_size", gbs,
                  hint=f"micro-batches must be equal, e.g. global_batch_size={m * max(1, round(gbs / m))}")
    job["global_batch_size"] = gbs
    job["seq_len"] = spec.check_seq_len(job.get("seq_len", 32))
    job["lr"] = positive_float("lr", job.get("lr", 1e-3), allow_zero=True)
    job["seed"] = int(job.get("seed", 0))
    job["data_seed"] = int(job.get("data_seed", 0))
    return job
