"""Serving, predicted: what a TP degree needs of a model for serving, how many collectives one forward pass
issues, replicas vs TP for a published model on real GPUs (the analytic deployment model), and the request
rate at which a server saturates (the knee of a request-rate sweep).

Pure Python (no torch, no pandas): memory from :mod:`labkit.theory.memory`, all-reduce time from
:mod:`labkit.theory.costmodel`, a roofline for prefill and decode, a utilisation argument for the knee
(:func:`knee_rate`). The tables are lists of dicts; chapters 10 and 12 make DataFrames of them.
"""

from __future__ import annotations

import math

from labkit.checks import check_divides, divisors, positive_float, positive_int
from labkit.theory import costmodel as cm
from labkit.theory import memory as mem
from labkit.theory import tensor as tensor_theory
from labkit.theory.spec import ModelSpec, flops_per_token, get_spec

#: what a GPU of data/hardware.yaml must have for the deployment model
GPU_KEYS = ("peak_bf16_tflops", "hbm_gbps", "nvlink")


def check_tp(spec: ModelSpec, tp: int, *, pad_vocab: bool = False) -> dict:
    """Raise ValueError unless ``tp`` can split ``spec`` for serving: :func:`labkit.theory.tensor.check_tp`
    with ``kv_cache=True`` (heads, ffn_hidden_size, vocabulary unless ``pad_vocab``, and tp must divide
    n_kv_heads: every rank keeps its own kv heads' cache, as :func:`labkit.theory.memory.kv_cache_bytes`
    counts it; replicated kv heads are not served here). Returns the plan."""
    return tensor_theory.check_tp(spec, tp, pad_vocab=pad_vocab, kv_cache=True)


def collectives_per_forward(spec: ModelSpec, tp: int) -> dict:
    """*Predicted* collectives of one TP forward pass (a prefill, or one decode step for the whole batch):
    :func:`labkit.theory.tensor.collectives_per_forward` with the logits gathered to sample —
    ``all_reduce`` = 2 per layer + 1 (the vocabulary-parallel embedding), ``all_gather`` = 1. Zero for
    tp = 1. Raises ValueError for a tp the model cannot use."""
    return tensor_theory.collectives_per_forward(spec, tp, gather_logits=True)


def gpus_with_data() -> list[str]:
    """The GPUs of data/hardware.yaml with every key of :data:`GPU_KEYS` (peak, HBM bandwidth, NVLink)."""
    return [n for n, d in cm.devices().items() if all(k in d for k in GPU_KEYS)]


def deployment_rows(model: str | ModelSpec = "llama-2-13b", *, gpus: int = 8, gpu: str = "h100-80gb",
                    tps=None, concurrency: int = 64, prompt_len: int = 1024, output_len: int = 256,
                    weight_dtype: str = "bf16", mfu: float = 0.5, hbm_efficiency: float = 0.8,
                    link: str | None = None) -> list[dict]:
    """*Predicted* serving of ``model`` on ``gpus`` GPUs of one node: for each TP degree, ``gpus / tp``
    replicas share ``concurrency`` sequences evenly. One dict per TP degree:

    * memory per GPU — :func:`labkit.theory.memory.infer_memory` (weights, KV cache for batch × (prompt + output),
      workspace, headroom): ``peak_bytes_per_gpu``, ``fits``, ``max_batch_per_replica``
      (:func:`labkit.theory.memory.serving_rows`);
    * decode step (one token for every sequence of a replica) — a roofline: the larger of reading this
      GPU's weights and the batch's KV cache at mean context (prompt + output/2) from HBM
      (``hbm_gbps × hbm_efficiency``), and the FLOPs ``batch × flops_per_token(ctx, inference) / tp`` at
      ``peak × mfu``; plus 2 all-reduces per layer of ``batch × hidden × 2`` bytes over NVLink
      (:func:`labkit.theory.costmodel.collective_time`). Decode is memory-bound at small batch (Pope et al. 2022,
      "Efficiently Scaling Transformer Inference", Sec. 2-3); the all-reduces are Megatron's (Shoeybi et al.
      2019, Sec. 3). ``tpot_s`` = that step, ``tps_per_seq`` = 1 / tpot, ``throughput_tok_s`` = replicas ×
      batch / tpot;
    * ``ttft_s`` — prefill of one prompt alone on an idle replica (no queueing): the larger of its FLOPs
      (``prompt × flops_per_token(prompt, inference) / tp`` at ``peak × mfu``) and one read of the weights,
      plus 2 all-reduces per layer of ``prompt × hidden × 2`` bytes;
    * ``knee_rps`` — :func:`knee_rate` with that prefill and decode step: the request rate past which the
      queue grows (requests of ``prompt_len`` + ``output_len`` tokens, ``batch_per_replica`` in flight).

    ``mfu`` and ``hbm_efficiency`` are assumptions (keys ``assumed_mfu``, ``assumed_hbm_efficiency``);
    the GPU's peak, HBM bandwidth and NVLink come from data/hardware.yaml. ``tps`` defaults to every divisor
    of ``gpus`` that divides the model's heads, kv heads and ffn_hidden_size.

    Raises ValueError for an unknown model or GPU, a GPU without peak/bandwidth data, a TP degree that does
    not divide ``gpus`` or the model, or ``concurrency`` not a multiple of the number of replicas.
    """
    spec = get_spec(model) if isinstance(model, str) else model
    gpus = positive_int("gpus", gpus)
    concurrency = positive_int("concurrency", concurrency)
    mfu = positive_float("mfu", mfu)
    hbm_efficiency = positive_float("hbm_efficiency", hbm_efficiency)
    dev = cm.get_device(gpu)
    missing = [k for k in GPU_KEYS if k not in dev]
    if missing:
        raise ValueError(f"gpu={gpu!r} has no {', '.join(missing)} in data/hardware.yaml; "
                         f"use one of: {', '.join(gpus_with_data())}")
    link = link or dev["nvlink"]
    peak = dev["peak_bf16_tflops"] * 1e12
    hbm = dev["hbm_gbps"] * 1e9 * hbm_efficiency
    if tps is None:
        tps = []
        for t in divisors(gpus):
            try:
                check_tp(spec, t, pad_vocab=True)
                tps.append(t)
            except ValueError:
                pass
    act_bytes = 2  # bf16 activations on the wire
    avg_ctx = prompt_len + output_len // 2
    rows = []
    for tp in tps:
        check_divides("tp", tp, "gpus", gpus)
        check_tp(spec, tp, pad_vocab=True)
        replicas = gpus // tp
        check_divides("replicas", replicas, "concurrency", concurrency,
                      hint=f"gpus/tp = {replicas} replicas share the sequences evenly")
        batch = concurrency // replicas
        wl = {"batch": batch, "prompt_len": prompt_len, "output_len": output_len, "weight_dtype": weight_dtype}
        row = mem.serving_rows(spec, [wl], device=gpu, tp=tp)[0]
        est = mem.infer_memory(spec, mem.ParallelConfig(tp=tp), mem.InferConfig(**wl), device=gpu)
        weights = est.categories["parameters"]
        kv_dtype = {32: "fp32", 16: "bf16", 8: "fp8"}[mem.InferConfig(**wl).kv_bits()]
        kv_avg = mem.kv_cache_bytes(spec, batch * avg_ctx, kv_dtype, tp=tp)

        def allreduce_s(nbytes, _tp=tp):
            if _tp == 1:
                return 0.0
            return 2 * spec.n_layers * cm.collective_time("all_reduce", int(nbytes), _tp, link, None,
                                                          gpus_per_node=gpus)

        t_mem = (weights + kv_avg) / hbm
        t_flop = batch * flops_per_token(spec, avg_ctx, training=False) / tp / (peak * mfu)
        comm = allreduce_s(batch * spec.hidden_size * act_bytes)
        tpot = max(t_mem, t_flop) + comm
        pre_flop = prompt_len * flops_per_token(spec, prompt_len, training=False) / tp / (peak * mfu)
        pre_comm = allreduce_s(prompt_len * spec.hidden_size * act_bytes)
        ttft = max(pre_flop, weights / hbm) + pre_comm
        timing = {"ttft_s": ttft, "tpot_s": tpot, "tps_per_seq": 1 / tpot,
                  "throughput_tok_s": replicas * batch / tpot,
                  "knee_rps": knee_rate(prefill_s=ttft, decode_step_s=tpot, concurrency=batch,
                                        new_tokens=output_len, instances=replicas),
                  "decode_bound": "memory" if t_mem >= t_flop else "compute",
                  "decode_allreduce_s": comm, "prefill_allreduce_s": pre_comm}
        note = ""
        if not est.fits:  # a deployment that cannot be loaded has no latency: no timing predicted
            timing = dict.fromkeys(timing, float("nan")) | {"decode_bound": None}
            note = (f"does not fit: peak {est.total_bytes / mem.GiB:.1f} GiB > {est.device_bytes / mem.GiB:.1f} GiB "
                    f"per GPU, so no timing is predicted")
        rows.append({
            "tp": tp, "replicas": replicas, "batch_per_replica": batch, "fits": est.fits,
            "peak_bytes_per_gpu": est.total_bytes, "device_bytes": est.device_bytes, "weights_bytes_per_gpu": weights,
            "kv_bytes_per_gpu": est.categories["kv_cache"], "max_batch_per_replica": row["max_batch"], **timing,
            "max_sequences_total": None if row["max_batch"] is None else replicas * row["max_batch"],
            "note": note, "gpu": gpu, "link": link, "assumed_mfu": mfu, "assumed_hbm_efficiency": hbm_efficiency,
            "source": "predicted"})
    return rows


def any_fits(model, *, gpus: int, gpu: str, **sizes) -> bool:
    """Whether some TP degree of :func:`deployment_rows` fits (False where the rows cannot be made)."""
    try:
        return any(r["fits"] for r in deployment_rows(model, gpus=gpus, gpu=gpu, **sizes))
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------------
# load: where the queue starts to grow
# ------------------------------------------------------------------------------------------------------
def fit_line(xs, ys) -> tuple[float, float]:
    """Least-squares ``y = a + b·x`` through the points; returns (a, b). One distinct x: a flat line
    through their mean. Raises ValueError for no points or unequal lengths."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if not xs or len(xs) != len(ys):
        raise ValueError(f"fit_line needs as many y as x values, at least one (got {len(xs)} x, {len(ys)} y)")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def knee_rate(*, prefill_s: float, decode_step_s: float, concurrency: int, new_tokens: float,
              instances: int = 1) -> float:
    """*Predicted* request rate (requests/s) at which a prefill-first, continuously batching server saturates:
    above it the queue grows without bound, below it stays bounded (stable iff utilisation < 1; Kleinrock
    1975, "Queueing Systems", Vol. 1, Sec. 1.4).

    At saturation every one of ``instances`` instances keeps ``concurrency`` requests in flight. Per second
    it spends ``λ·prefill_s`` on prefills (each request's first token comes from its prefill), the rest on
    decode steps of ``concurrency`` tokens, each ``decode_step_s`` long; each request needs ``new_tokens -
    1`` decode tokens: ``λ (new_tokens - 1) = concurrency (1 - λ prefill_s) / decode_step_s``, so

        λ* = instances · concurrency / ((new_tokens - 1) · decode_step_s + concurrency · prefill_s)

    ``prefill_s``: the mean prefill time of one request of the workload; ``decode_step_s``: one decode step
    at batch ``concurrency``; ``new_tokens``: the mean tokens a request gets (>= 1). Raises ValueError for
    non-positive times or sizes."""
    pre, dec = positive_float("prefill_s", prefill_s), positive_float("decode_step_s", decode_step_s)
    c, n = positive_int("concurrency", concurrency), positive_float("new_tokens", new_tokens)
    if n < 1:
        raise ValueError(f"new_tokens={new_tokens} must be >= 1 (the first token comes from the prefill)")
    return positive_int("instances", instances) * c / ((n - 1) * dec + c * pre)


def fixed_step_s(tokens: int, *, step_s: float, token_s: float) -> float:
    """A *fixed compute* cost model of one forward pass: ``step_s + token_s · tokens`` seconds (a fixed
    cost per pass — kernel launches, weight reads — plus a cost per token in it). Raises ValueError for
    negative arguments."""
    return positive_float("step_s", step_s) + positive_float("token_s", token_s, allow_zero=True) * \
        positive_int("tokens", tokens, minimum=0)


def queue_growth_rps(rate_rps: float, knee_rps: float) -> float:
    """*Predicted* growth of the queue (requests/s) at offered ``rate_rps``: ``max(0, rate - knee)`` — past
    the knee every extra request per second waits, and the wait grows with time."""
    return max(0.0, positive_float("rate_rps", rate_rps) - positive_float("knee_rps", knee_rps))


def replicas_needed(rate_rps: float, knee_per_replica_rps: float, *, utilisation: float = 0.8) -> int:
    """Replicas to serve ``rate_rps`` with each at most ``utilisation`` of its knee (headroom for bursts):
    ``ceil(rate / (utilisation · knee))``. The sizing rule behind "scale up when TTFT p95 rises and
    throughput flattens at constant traffic". Raises ValueError for a utilisation outside (0, 1]."""
    u = positive_float("utilisation", utilisation)
    if u > 1:
        raise ValueError(f"utilisation={utilisation} must be in (0, 1]: the share of a replica's knee to use")
    return max(1, math.ceil(positive_float("rate_rps", rate_rps) / (u * positive_float("knee_per_replica_rps",
                                                                                        knee_per_replica_rps))))
