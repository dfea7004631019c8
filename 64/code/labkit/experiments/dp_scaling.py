"""Data-parallel strong scaling in one launch (chapter 03): the same global batch trained on 1, 2, 4, ... of the
launch's ranks, naive (blocking all-reduces after backward) and bucketed (async all-reduces from gradient hooks,
overlapping backward). Meant to be emulated (``launch(..., emulate=...)``): on the laptop every rank shares two
cores, on the emulated cluster each has its own GPU, so the step time of each group size is what the cluster
would give and the point where adding ranks stops paying can be read off.

Rank function :func:`strong_scaling_rank`; caller's side :func:`strong_scaling_rows` (emulated step per group
size beside :func:`predicted_step_s`, a formula of the cluster and the charged model).
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

from labkit.checks import check_choice, positive_int

SCALING_VARIANTS = ("naive", "bucket")


def span_name(variant: str, n: int) -> str:
    """The timeline name of one step of ``variant`` on ``n`` ranks."""
    return f"{variant} n={n}"


def strong_scaling_rank(ctx, sizes=(1, 2, 4, 8), *, variants=SCALING_VARIANTS, model: str = "lab-tiny-llama",
                        seq_len: int = 32, global_batch_size: int = 8, steps: int = 2,
                        bucket_cap_bytes: int = 64 * 1024, seed: int = 0) -> dict:
    """Rank function: for each group size n of ``sizes`` (each <= world size, dividing ``global_batch_size``)
    and each variant, ranks 0..n-1 train ``steps`` steps of ``model`` on the same ``global_batch_size``
    sequences, each rank on global/n of them (n = 1: one rank, no wrapper, no communication). Each step is one
    ``ctx.timer(span_name(variant, n), "other", step=i)`` span with ``F``, ``B`` and ``optimizer`` spans inside
    (what the timeline draws); the other ranks wait at a barrier.

    Returns {span name: the global mean loss of the last step} on the group's members (the loss of the same
    global batch: equal across n up to fp32 rounding). Raises ValueError for a size that does not fit."""
    from labkit.experiments.data import build
    from labkit.models import SyntheticLM, build_model, lm_loss, make_optimizer, shard
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    gbs, steps = positive_int("global_batch_size", global_batch_size), positive_int("steps", steps)
    for n in sizes:
        positive_int("size", n)
        if n > ctx.world_size or gbs % n:
            raise ValueError(f"size {n}: every group size must be <= world_size={ctx.world_size} and divide "
                             f"global_batch_size={gbs}")
    for v in variants:
        check_choice("variant", v, SCALING_VARIANTS)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    out = {}
    for n in sizes:
        group = dist.new_group(list(range(n))) if n > 1 else None  # every rank takes part in new_group
        if ctx.rank < n:
            for variant in variants:
                module = build_model(spec, seed, device=ctx.device)
                if n > 1:
                    wrapped, opt = build(variant, module, ctx, group=group, bucket_cap_bytes=bucket_cap_bytes,
                                         log_comm=False)
                else:
                    wrapped, opt = module, make_optimizer(module.parameters())
                name = span_name(variant, n)
                for step in range(steps):
                    tokens, targets = data.batch(step, gbs)  # [gbs, T]
                    tokens, targets = shard(tokens, ctx.rank, n), shard(targets, ctx.rank, n)  # [gbs/n, T]
                    with ctx.timer(name, "other", step=step):
                        opt.zero_grad(set_to_none=True)
                        with ctx.timer("F", step=step):
                            loss = lm_loss(wrapped(tokens), targets)
                        with ctx.timer("B", step=step):
                            loss.backward()
                        if hasattr(wrapped, "finish_grad_sync"):
                            wrapped.finish_grad_sync()
                        with ctx.timer("optimizer", "other", step=step):
                            opt.step()
                if hasattr(wrapped, "close"):
                    wrapped.close()
                mean = loss.detach().reshape(1) / n  # this rank's share of the global mean loss
                if n > 1:
                    dist.all_reduce(mean, group=group)
                out[name] = float(mean)
        ctx.barrier()
    return out


def emulated_steps(frame, sizes, variants=SCALING_VARIANTS) -> dict:
    """{(variant, n): emulated step seconds} from an emulated timeline of :func:`strong_scaling_rank`: per step
    the slowest rank's span, median over steps."""
    out = {}
    for variant in variants:
        for n in sizes:
            g = frame[(frame["name"] == span_name(variant, n)) & (frame["stream"] != "comm")]
            if not len(g):
                continue
            per_step = [(d["end_ns"].max() - d["start_ns"].min()) / 1e9 for _, d in g.groupby("step")]
            out[(variant, n)] = statistics.median(per_step)
    return out


def predicted_step_s(cluster, preset, seq_len: int, global_batch_size: int, n: int) -> dict:
    """Predicted naive DP step on ``n`` GPUs of ``cluster`` for ``preset`` (a ModelSpec): compute
    ``C/n`` with C = flops_per_token(preset, seq_len) x global_batch_size x seq_len / (bf16 peak x
    compute_efficiency) (PaLM App. B), plus one all-reduce of the bf16 gradients (2 N bytes,
    ``cluster.collective_s``) when n > 1, nothing overlapped. Returns {"compute_s", "comm_s", "step_s"}."""
    from labkit.theory.spec import flops_per_token

    flops = flops_per_token(preset, seq_len) * global_batch_size * seq_len
    compute = flops / (cluster.device.peak_flops("bf16") * cluster.compute_efficiency) / n
    comm = cluster.collective_s("all_reduce", 2 * preset.n_params(), tuple(range(n))) if n > 1 else 0.0
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm}


def strong_scaling_rows(steps: dict, cluster, preset, seq_len: int, global_batch_size: int) -> list[dict]:
    """One row per (variant, n) of ``steps`` (:func:`emulated_steps`): ``emulated_step_s``, ``speedup`` and
    ``efficiency`` (T(1) / (n T(n)), emulated), and the naive formula's ``predicted_step_s`` /
    ``predicted_efficiency`` (:func:`predicted_step_s`)."""
    rows = []
    for (variant, n), t in sorted(steps.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        t1 = steps.get((variant, 1))
        p = predicted_step_s(cluster, preset, seq_len, global_batch_size, n)
        p1 = predicted_step_s(cluster, preset, seq_len, global_batch_size, 1)["step_s"]
        rows.append({"variant": variant, "n": n, "emulated_step_s": t,
                     "speedup": t1 / t if t1 else None, "efficiency": t1 / (n * t) if t1 else None,
                     "predicted_step_s": p["step_s"], "predicted_comm_s": p["comm_s"],
                     "predicted_efficiency": p1 / (n * p["step_s"])})
    return rows
