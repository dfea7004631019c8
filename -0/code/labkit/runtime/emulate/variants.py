"""Which variants of the lab can be emulated, and why (the table docs/emulation.md shows).

A variant is emulatable when every operation and collective it runs is seen by the rank-side tracer
(:mod:`labkit.runtime.emulate.tracer`) in the order the program runs it, and nothing it does depends on real
time. Experiment entry points call :func:`check_emulatable` before launching, so a variant that cannot be
emulated fails with a ValueError before any process starts instead of producing a wrong timeline.
"""

from __future__ import annotations

#: "area:variant" -> (emulatable, how its work is observed or why it cannot be emulated)
VARIANTS: dict[str, tuple[bool, str]] = {
    "data:naive": (True, "one blocking dist.all_reduce per gradient after backward"),
    "data:bucket": (True, "asynchronous dist.all_reduce per bucket from gradient hooks, waited in "
                          "finish_grad_sync: the overlap with backward is the program's own"),
    "data:ddp": (True, "torch DDP: with the lab's comm hook its all-reduces are dist.all_reduce calls; without "
                       "one the C++ reducer's all-reduces are seen as c10d ops; both are asynchronous and waited "
                       "where backward returns (DDP's finalize_backward waits for every bucket there)"),
    "zero:zero1": (True, "hand-written ZeRO-1: reduce-scatter / all-gather through the Python API"),
    "zero:zero2": (True, "hand-written ZeRO-2: reduce-scatter / all-gather through the Python API"),
    "zero:zero3": (True, "hand-written ZeRO-3: all-gathers and reduce-scatters through the Python API"),
    "zero:fsdp2": (True, "FSDP2 fully_shard: its all-gathers and reduce-scatters go through dist's Python API "
                         "(async, waited by FSDP2), so its prefetch overlap is the program's own"),
    "tensor:hand": (True, "hand-written Megatron TP: blocking all-reduces inside the f/g autograd functions"),
    "tensor:hand_sp": (True, "hand-written TP + SP: all-gathers and reduce-scatters inside autograd functions"),
    "tensor:dtensor": (True, "DTensor parallelize_module: functional collectives seen in the dispatch mode, "
                             "waited at wait_tensor"),
    "tensor:dtensor_sp": (True, "DTensor with sequence parallelism: functional collectives, as tensor:dtensor"),
    "pipeline:labkit": (True, "hand-written schedules: isend/irecv and their waits; fixed compute's time.sleep "
                              "stand-ins are charged their seconds"),
    "pipeline:torch": (True, "torch.distributed.pipelining: batch_isend_irecv through the traced isend/irecv"),
    "context:ring": (True, "ring attention: p2p or collectives through the Python API"),
    "context:allgather": (True, "all-gather context parallelism: collectives through the Python API"),
    "context:ulysses": (True, "Ulysses: all-to-alls through the Python API"),
    "expert:ep": (True, "expert parallelism: all-to-alls through the Python API"),
    "composed:dp_tp": (True, "DTensor TP + FSDP2 on a 2-D mesh (as tensor:dtensor and zero:fsdp2)"),
    "composed:dp_tp_hand": (True, "hand-written TP + bucketed DP on the mesh's groups"),
    "composed:pp_dp": (True, "torch pipelining + FSDP2 (as pipeline:torch and zero:fsdp2)"),
    "composed:dp_tp_pp": (True, "labkit.experiments.emulate.step3d_rank: hand-written TP, a 1F1B pipeline "
                                "and bucketed DP on the mesh's groups"),
    "collectives:sweep": (True, "each timed collective is a blocking call between barriers; its emulated time "
                                "is the replay's (S can be charged larger than the tensor moved: charge_bytes)"),
    "serving:engine": (True, "the decode loop's tensor-parallel all-reduces; its latencies (ttft, tps) stay "
                             "measured wall time, only its timeline is re-timed"),
    "serving:rank_loss": (False, "a lost rank is detected by a real (gloo) timeout, which has no emulated "
                                 "equivalent: the replay would see a collective some rank never issues"),
    "torch_compile": (False, "torch.compile'd code runs its operations and collectives inside compiled graphs "
                             "that the dispatch mode does not see (torch.compile raises in an emulated rank)"),
    "background_thread": (False, "collectives issued from another thread than the rank function's: the "
                                 "tracer sees only the main thread's compute (it raises RuntimeError)"),
    "recv_any_source": (False, "irecv(src=None): which send it matches depends on real timing"),
    "backend:nccl": (False, "emulation re-times the CPU/gloo run; on NCCL, CUDA streams overlap work the "
                            "CPU-side program order does not show"),
}


def emulatable() -> list[str]:
    """The variants that can be emulated, sorted."""
    return sorted(k for k, (ok, _) in VARIANTS.items() if ok)


def check_emulatable(variant: str) -> str:
    """Return ``variant`` ("area:variant", e.g. ``"data:ddp"``) if it can be emulated; else ValueError saying
    why (for a known variant that cannot) or naming the known variants (for an unknown one), before any process
    starts."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a known variant; emulatable variants: "
                         f"{', '.join(emulatable())}")
    ok, why = VARIANTS[variant]
    if not ok:
        raise ValueError(f"variant={variant!r} cannot be emulated: {why}; emulatable variants: "
                         f"{', '.join(emulatable())}")
    return variant


def table() -> list[dict]:
    """One row per variant: ``variant``, ``emulatable``, ``how`` (how its work is observed, or why not)."""
    return [{"variant": k, "emulatable": ok, "how": why} for k, (ok, why) in VARIANTS.items()]
