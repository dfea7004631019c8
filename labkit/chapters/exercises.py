"""Every chapter's exercise, checked here so its reference answer never appears in a notebook.

A notebook's exercise cell holds the reader's answer and one call, ``check(chapter, answer)``: the reference is
computed in this module (from the lab's theory, validated elsewhere against measurements, or from a real run for
chapter 00), for data the chapter never prints — never shown, and not the result of any call the notebook makes.
Not attempted: a hint (a concept, no constants). A wrong answer: ``AssertionError`` whose message is a second,
more specific hint — still never the answer. Right: prints "correct". ``tests/test_notebooks.py`` executes each
notebook's exercise cell with no answer, a wrong one and the right one (:func:`reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.chapters import common


@dataclass(frozen=True)
class Exercise:
    """One chapter's exercise: how the answer is compared (``rel_tol`` / ``abs_tol``, see
    :func:`labkit.chapters.common.check_exercise`), the hint shown before an attempt (``hint``) and the one a
    wrong attempt raises (``wrong``)."""

    hint: str
    wrong: str
    rel_tol: float = 1e-6
    abs_tol: float = 0.0


EXERCISES: dict[str, Exercise] = {
    "00": Exercise(hint="MAX keeps one of the contributions: whose?",
                   wrong="every rank ends with the largest contribution of all ranks: which rank contributes the most, "
                         "and what is its rank ** 2?", rel_tol=0),
    "01": Exercise(hint="AdamW keeps two fp32 moments per element and a 4-byte step per tensor: which of these "
                        "does FSDP2 shard, and how does it cut a tensor over 6 ranks?",
                   wrong="the two moments are sharded like the parameters (dim-0 chunks of ceil(d0 / 6) rows, rank 0 "
                         "a full chunk of every tensor); the 4-byte step stays one per parameter tensor", rel_tol=0),
    "02": Exercise(hint="a ring all-reduce is a reduce-scatter followed by an all-gather: how many of the n chunks "
                        "of S/n does each GPU send in each half?",
                   wrong="each half sends n - 1 chunks of S/n; section 1's factor column names the product for "
                         "all-reduce", rel_tol=0.01),
    "03": Exercise(hint="how many gradient all-reduces per optimizer step does no_sync leave?",
                   wrong="no_sync skips the all-reduce on every micro-batch but the last: one all-reduce of all "
                         "gradients per optimizer step, at 8 ranks (section 2's formula)"),
    "04": Exercise(hint="of the three model states (parameters 2Ψ, gradients 2Ψ, optimizer 12Ψ bytes), which does "
                        "stage 2 divide over the ranks?",
                   wrong="stage 2 shards the optimizer state and the gradients; every rank keeps all 2Ψ bytes of "
                         "parameters", rel_tol=0, abs_tol=0.1),
    "05": Exercise(hint="count one layer's TP+SP collectives in section 1 (forward, backward, the re-gathers), "
                        "each sending a fraction of S per rank; then all the layers",
                   wrong="recount the backward: the transposes of the forward collectives, and the re-gathers; each "
                         "sends (tp - 1)/tp of S per rank", rel_tol=0, abs_tol=1),
    "06": Exercise(hint="ZB-H1's idle time per rank is in section 1's formula table; the fraction is idle over "
                        "the makespan (busy + idle)",
                   wrong="idle per rank (p - 1)(F + B - W); busy per rank m(F + B + W); fraction = idle / (busy + "
                         "idle)", rel_tol=0, abs_tol=1e-3),
    "07": Exercise(hint="count the causal blocks each rank computes: contiguous shards give the last rank the "
                        "most; zigzag pairs an early chunk with a late one",
                   wrong="count again: how many blocks does the busiest rank compute under each sharding, with 2cp "
                         "chunks for zigzag?", abs_tol=0.01),
    "08": Exercise(hint="an expert's capacity is its fair share of one rank's assignments, stretched by the "
                        "capacity factor, rounded up",
                   wrong="fair share = tokens x top_k / experts; times the capacity factor; round up", rel_tol=0),
    "10": Exercise(hint="what does each layer keep per token for attention, and for how many heads?",
                   wrong="K and V (two tensors), every layer, every kv head, head_dim elements of 2 bytes each in "
                         "bf16", rel_tol=0),
    "11": Exercise(hint="efficiency compares the speedup with the ideal speedup from the baseline, not from 1 GPU",
                   wrong="speedup = T(8) / T(64); ideal = 64 / 8; efficiency = speedup / ideal", abs_tol=0.01),
    "12": Exercise(hint="per second the replica spends rate x prefill on prefills and the rest on decode steps of "
                        "4 requests: when can it no longer keep up?",
                   wrong="each request needs 8 decode tokens after its prefill's first one: balance rate x 8 against "
                         "what 4-request steps give in the time prefills leave", rel_tol=0.01),
}


def _max_of_squares(ctx):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank ** 2)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reference(chapter: str, *, world_size: int = 2, timeout_s: float = 120.0, model: str = "lab-tiny-llama"):
    """Chapter ``chapter``'s reference answer ("00".."12" without "09", whose two answers are
    :func:`labkit.chapters.ch09_composing_meshes.exercise_reference`). ``world_size`` / ``timeout_s``: chapter
    00's real run (its answer depends on the world size); ``model``: chapter 03's model. Raises ValueError for a
    chapter without an exercise here, naming the valid ones. Never printed by the chapters."""
    if chapter == "00":
        from labkit.runtime.launcher import launch

        out = launch(_max_of_squares, world_size, timeout_s=timeout_s)
        assert len(set(out)) == 1, f"after all_reduce every rank must hold the same value, got {out}"
        return out[0]
    if chapter == "01":  # the calculator: section 2 holds it to rank 0's measured FSDP2 bytes, byte for byte
        from labkit.theory import memory as mem

        train = mem.TrainConfig(micro_batch_size=2, seq_len=64, convention="torch-fp32", attention="flash",
                                kernels="cpu", act_dtype="fp32")
        par = mem.ParallelConfig(dp=6, zero=3, shard_layout="dim0")
        return int(mem.train_memory("lab-tiny-llama", par, train, headroom=0.0, workspace_bytes=0,
                                    dp_rank=0).categories["optimizer"])
    if chapter == "02":
        from labkit.theory import costmodel as cm

        return int(cm.bus_factor("all_reduce", 16) * 3_000_000_000)
    if chapter == "03":
        from labkit.theory.data import predicted_allreduce_bytes
        from labkit.theory.spec import get_spec

        return predicted_allreduce_bytes(get_spec(model).n_params(), 8)
    if chapter == "04":
        from labkit.theory import memory

        return memory.zero_model_state_bytes(13_000_000_000, 32, 2) / 1e9
    if chapter == "05":
        from labkit.theory import tensor
        from labkit.theory.spec import get_spec

        rows = tensor.comm_theory_model(get_spec("llama-3-8b"), 1, 4096, 8, sequence_parallel=True, regather=True)
        return sum(x["bytes_per_rank"] for x in rows if x["where"].startswith("layer"))
    if chapter == "06":
        from labkit.theory import simulate as sim

        ref = sim.bubble_formula("zb-h1", 5, 10)
        assert abs(ref - sim.bubble_fraction("zb-h1", 5, 10)) < 1e-12, "formula and simulator disagree"
        return ref
    if chapter == "07":
        from labkit.theory import context

        return max(context.predicted_blocks(6)) / max(context.predicted_blocks(6, load_balance=True))
    if chapter == "08":
        from labkit.theory import expert

        return expert.expert_capacity(384, 16, 2, 1.5)
    if chapter == "10":
        from labkit.theory import memory
        from labkit.theory.spec import get_spec

        return memory.kv_cache_bytes(get_spec("llama-2-13b"), 1, "bf16")
    if chapter == "11":
        t8, t64 = 12.0, 2.0
        return (t8 / t64) / (64 / 8)
    if chapter == "12":
        from labkit.theory import serving

        return serving.knee_rate(prefill_s=0.010, decode_step_s=0.008, concurrency=4, new_tokens=9)
    raise ValueError(f"chapter={chapter!r} has no exercise here; valid: {', '.join(sorted(EXERCISES))}")


def check(chapter: str, answer, **context) -> None:
    """The exercise's self-check for chapter ``chapter`` (see the module docstring): ``answer`` None prints
    "not attempted yet" and a hint; a wrong answer raises AssertionError with a second hint; the right one
    prints "correct". ``context``: what :func:`reference` needs (chapter 00's ``world_size`` and ``timeout_s``,
    chapter 03's ``model``). The reference is computed either way (chapter 00 runs its launch) and never shown.
    Raises ValueError for an unknown chapter."""
    if chapter not in EXERCISES:
        raise ValueError(f"chapter={chapter!r} has no exercise here; valid: {', '.join(sorted(EXERCISES))}")
    e = EXERCISES[chapter]
    ref = reference(chapter, **context)
    common.check_exercise(answer, ref, hint=e.hint, wrong=e.wrong, rel_tol=e.rel_tol, abs_tol=e.abs_tol)
