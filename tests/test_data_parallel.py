"""Replicated data parallelism (labkit.parallel.data; runs in labkit.experiments.data) on gloo: parity with
the single-process reference, replicas identical, communication bytes equal to theory, and the
gradient-accumulation field case.

Two launches (2 and 4 ranks); each checks several variants. Tolerance: labkit.models.TOLERANCES[fp32]
(rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

import labkit.chapters.common as chapters_common
from labkit import launch
from labkit.chapters import ch03_data_parallel as ch
from labkit.chapters.common import check_exercise, check_fits_in_memory
from labkit.experiments import data as dpx
from labkit.experiments.common import (
    PAYLOAD,
    RING,
    SOCKET,
    assert_ranks_identical,
    assert_state_close,
    ratio_verdict,
    summarize,
    window,
    wire_table,
)
from labkit.models import TOLERANCES, build_model, train_reference
from labkit.runtime.training import _carve, local_batch, microbatches
from labkit.theory.data import predicted_allreduce_bytes
from labkit.theory.spec import get_spec

MODEL = "lab-tiny-llama"
STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
CAP = 64 * 1024  # small buckets so the bucketed variants have several (overlap is possible)
RUNS_2 = [
    {"variant": "naive"},
    {"variant": "bucket", "bucket_cap_bytes": CAP},
    {"variant": "ddp", "bucket_cap_bytes": CAP},
    {"variant": "naive", "n_microbatches": 2, "label": "naive-acc"},
    {"variant": "bucket", "n_microbatches": 2, "bucket_cap_bytes": CAP, "label": "bucket-acc"},
    {"variant": "ddp", "n_microbatches": 2, "label": "ddp-acc"},
    # the field case: the sync flag on the wrong micro-batch
    {"variant": "ddp", "n_microbatches": 2, "sync_microbatch": 0, "label": "ddp-wrong-sync"},
    {"variant": "bucket", "n_microbatches": 2, "sync_microbatch": 0, "bucket_cap_bytes": CAP,
     "label": "bucket-wrong-sync"},
]
RUNS_4 = [RUNS_2[0], RUNS_2[1], RUNS_2[2], RUNS_2[5], RUNS_2[6]]


def rank_fn(ctx, runs):
    """Test rank function: the training variants, then the hand-checkable accumulation demo."""
    out = dpx.run_rank(ctx, runs, model=MODEL, steps=STEPS, global_batch_size=GLOBAL_BATCH, seq_len=SEQ)
    demo = None
    if ctx.world_size == 2:
        demo = {(v, s): dpx.accumulation_demo(ctx, v, s) for v in dpx.VARIANTS for s in (None, 0)}
    return {"runs": out, "demo": demo}


@pytest.fixture(scope="module")
def reference():
    return train_reference(MODEL, steps=STEPS, global_batch_size=GLOBAL_BATCH, seq_len=SEQ, return_grads=True)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def launched(request):
    n = request.param
    res = launch(rank_fn, n, RUNS_2 if n == 2 else RUNS_4, timeout_s=300)
    return n, res


def check_run(per_rank: list[dict], ref: dict) -> None:
    """What a correct data-parallel run must satisfy; raises AssertionError otherwise."""
    label = per_rank[0]["label"]
    assert_ranks_identical([r["grads"] for r in per_rank], f"{label} gradients")
    assert_ranks_identical([r["state"] for r in per_rank], f"{label} weights")
    assert_state_close(per_rank[0]["state"], ref["state_dict"], torch.float32, f"{label} weights")
    torch.testing.assert_close(per_rank[0]["losses"], ref["losses"], **TOLERANCES[torch.float32])


def _by_label(res):
    runs = [r["runs"] for r in res]
    return {runs[0][i]["label"]: [rr[i] for rr in runs] for i in range(len(runs[0]))}


def test_parity_with_reference_and_replicas_identical(launched, reference):
    n, res = launched
    for label, per_rank in _by_label(res).items():
        if "wrong" in label:
            continue
        check_run(per_rank, reference)
    # without accumulation the gradients themselves match the reference's last-step gradients
    for label in ("naive", "bucket", "ddp"):
        assert_state_close(_by_label(res)[label][0]["grads"], reference["grads"], torch.float32, label)


def test_wrong_sync_microbatch_is_caught(launched, reference):
    """The accumulation field case: syncing on micro-batch 0 instead of the last leaves ranks with different
    gradients. The same check that passes for the correct runs must fail here (so it can fail)."""
    n, res = launched
    wrong = {k: v for k, v in _by_label(res).items() if "wrong" in k}
    assert wrong
    for label, per_rank in wrong.items():
        with pytest.raises(AssertionError, match="differs from rank 0"):
            check_run(per_rank, reference)
        g0, g1 = per_rank[0]["grads"], per_rank[1]["grads"]
        assert max(float((g0[k] - g1[k]).abs().max()) for k in g0) > 1e-3, label


def test_comm_bytes_equal_ring_allreduce_theory(launched):
    """Every variant hands Ψ · 4 bytes per step to all_reduce (measured payload; accumulation: once per step,
    thanks to no_sync), whose ring model is 2(n-1)/n · Ψ · 4 per rank; the timeline's comm events carry the
    same bytes."""
    n, res = launched
    psi = get_spec(MODEL).n_params()
    expected = predicted_allreduce_bytes(psi, n)
    for label, per_rank in _by_label(res).items():
        r0 = per_rank[0]
        assert set(r0["comm"]) == {"all_reduce"}, label
        assert r0["payload_bytes_per_step"] == psi * 4, label
        assert r0["ring_bytes_per_step"] == pytest.approx(expected, rel=1e-12), label
        events = window(res.timeline, r0["window_ns"])
        comm = events[(events["kind"] == "comm") & (events["rank"] == 0)]
        assert comm["nbytes"].sum() == psi * 4 * STEPS, label
    # naive: one call per gradient tensor; bucketed: one per bucket (fewer)
    n_tensors = len(list(build_model(MODEL).parameters()))
    assert _by_label(res)["naive"][0]["comm"]["all_reduce"]["calls"] == pytest.approx(n_tensors)
    assert 1 < _by_label(res)["bucket"][0]["comm"]["all_reduce"]["calls"] < n_tensors


def test_socket_bytes_are_measured_not_modelled(launched):
    """The bytes gloo actually wrote to its sockets (/proc/self/io, over the timed steps) sit beside the ring
    model, in their own column: a real measurement, at least the ring's bytes (gloo's CPU all-reduce is a
    ring) plus headers, and not the model itself (a value folded from the model would be exactly equal)."""
    from labkit.runtime.probes import socket_bytes_written

    n, res = launched
    if socket_bytes_written() is None:
        pytest.skip("no /proc/self/io on this platform")
    table = summarize(res).set_index("label")
    wire = wire_table(res).set_index("label")
    for label, per_rank in _by_label(res).items():
        for r in per_rank:
            sock, ring = r["socket_bytes_per_step"], r["ring_bytes_per_step"]
            assert ring <= sock < 1.1 * ring, (label, sock, ring)
        sock0 = per_rank[0]["socket_bytes_per_step"]
        assert table.loc[label, SOCKET] == sock0 != table.loc[label, RING]
        assert 1.0 <= wire.loc[label, "measured / gloo model"] < 1.1, label
    assert {PAYLOAD, RING, SOCKET} <= set(table.columns)
    assert "comm_bytes_per_step" not in table.columns  # the old name mixed a model into a "measured" column


def test_accumulation_demo_reproduces_4_vs_7(launched):
    n, res = launched
    if n != 2:
        pytest.skip("the demo's numbers are for 2 ranks")
    d0, d1 = res[0]["demo"], res[1]["demo"]
    for v in dpx.VARIANTS:
        assert d0[(v, None)] == d1[(v, None)] == 5.5, v
        assert (d0[(v, 0)], d1[(v, 0)]) == (4.0, 7.0), v


def test_model_state_bytes_replicated(launched):
    """labkit.runtime.measure on every replica: 4Ψ parameters, 4Ψ gradients, 8Ψ AdamW moments + one 4-byte step
    counter per parameter tensor."""
    n, res = launched
    psi = get_spec(MODEL).n_params()
    n_tensors = len(list(build_model(MODEL).parameters()))
    for label, per_rank in _by_label(res).items():
        for r in per_rank:
            assert r["optimizer_steps"] == 4 * n_tensors, label
            assert r["memory"] == {"parameters": 4 * psi, "gradients": 4 * psi,
                                   "optimizer": 8 * psi + 4 * n_tensors}, label


# ------------------------------------------------------------------------------------------------------
# no launch
# ------------------------------------------------------------------------------------------------------
def test_predicted_allreduce_bytes():
    assert predicted_allreduce_bytes(1000, 1) == 0
    assert predicted_allreduce_bytes(1000, 2) == 4000
    assert predicted_allreduce_bytes(1000, 4, bytes_per_element=2) == 3000
    with pytest.raises(ValueError, match="world_size=0"):
        predicted_allreduce_bytes(1000, 0)


def test_batch_helpers_reject_bad_sizes():
    from labkit.models import SyntheticLM

    d = SyntheticLM(32, 8)
    tk, tg = local_batch(d, 0, 8, 1, 4)
    assert tk.shape == (2, 8) and torch.equal(tk, d.batch(0, 8)[0][2:4])
    with pytest.raises(ValueError, match="dp=3 does not divide global_batch_size=8"):
        local_batch(d, 0, 8, 0, 3)
    with pytest.raises(ValueError, match="n_microbatches=3"):
        microbatches(tk, tg, 3)


def test_carve_removes_blocking_intervals():
    spans = [("B", 0, 100, {})]
    assert _carve(spans, [(10, 20), (50, 120)]) == [("B", 0, 10, {}), ("B", 20, 50, {})]
    assert _carve(spans, []) == spans



def test_check_chapter_refuses_bad_parameters_before_any_launch():
    """Chapter 03's parameters are all checked in one call before anything starts, each error naming the
    value and the fix (the field reports: world_size=1 failing late with a misleading assertion, dp=3 and
    steps=0 arriving from inside the ranks, world_size=8 leaving one sequence per rank for 2 micro-batches)."""
    with pytest.raises(ValueError, match=r"chapter 03 needs world_size >= 2, got world_size=1"):
        ch.check_chapter(world_size=1)
    with pytest.raises(ValueError, match=r"world_size=3 does not divide global_batch_size=8.* 6 \(e.g. 6 or 12\)"):
        ch.check_chapter(world_size=3, global_batch_size=8)
    with pytest.raises(ValueError, match=r"n_microbatches=2 does not divide local_batch_size=1.*8 / 8"):
        ch.check_chapter(world_size=8, global_batch_size=8)
    # a batch the user did not set adapts to the world size (issue 19)
    assert ch.check_chapter(world_size=3)["global_batch_size"] == 12
    assert ch.check_chapter(world_size=8)["local_batch_size"] == 4
    with pytest.raises(ValueError, match=r"steps=0"):
        ch.check_chapter(world_size=2, steps=0)
    with pytest.raises(ValueError, match=r"n_microbatches=1: .*>= 2"):
        ch.check_chapter(world_size=2, n_microbatches=1)
    with pytest.raises(ValueError, match=r"seq_len=999 exceeds"):
        ch.check_chapter(world_size=2, seq_len=999)
    with pytest.raises(ValueError, match=r"scaling_batch_sizes=\(\) is empty"):
        ch.check_chapter(world_size=2, scaling_batch_sizes=())
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'"):
        ch.check_chapter(world_size=2, model="nope")
    ok = ch.check_chapter(world_size=3, global_batch_size=6)
    assert ok["local_batch_size"] == 2 and ok["n_microbatches"] == 2


def test_chapter_rank_passes_the_users_values_down(monkeypatch):
    seen = {}
    monkeypatch.setattr(ch, "run_rank", lambda ctx, runs=None, **kw: seen.setdefault("runs", kw))
    monkeypatch.setattr(ch, "accumulation_demo_rank", lambda ctx: {})
    monkeypatch.setattr(ch, "scaling_rank", lambda ctx, sizes, **kw: seen.setdefault("scaling", (sizes, kw)))
    ch.chapter_rank(None, model="lab-tiny-gpt", seq_len=16, seed=2, global_batch_size=6, scaling_batch_sizes=(1, 2))
    assert seen["runs"] == {"model": "lab-tiny-gpt", "seq_len": 16, "seed": 2, "global_batch_size": 6}
    assert seen["scaling"] == ((1, 2), {"steps": 2, "model": "lab-tiny-gpt", "seq_len": 16, "seed": 2})


def test_check_fits_in_memory(monkeypatch):
    monkeypatch.setattr(chapters_common, "available_memory_bytes", lambda: 8 * 10**9)
    check_fits_in_memory("lab-tiny-llama", 4)
    with pytest.raises(ValueError, match=r"model='llama-3-8b' .* choose a CPU-sized preset"):
        check_fits_in_memory("llama-3-8b", 2)
    monkeypatch.setattr(chapters_common, "available_memory_bytes", lambda: None)  # not Linux: no check
    check_fits_in_memory("llama-3-8b", 2)


# ------------------------------------------------------------------------------------------------------
# the chapters this engineer owns (03-06): parameters, validation first, exercises
# ------------------------------------------------------------------------------------------------------
CHAPTERS = {"03_data_parallel": "ch.check_chapter(", "04_zero_fsdp": "ch.check_chapter(",
            "05_tensor_parallel": "ch.check_chapter(", "06_pipeline_parallel": "ch.check_chapter("}


@pytest.mark.parametrize("name", sorted(CHAPTERS))
def test_chapter_parameters_parsed_and_checked_before_anything(name):
    """Every name in the parameters cell is one papermill can override (no '=' in a trailing comment hides a
    line), and the first code cell after it passes every one of them to the chapter's check function, before
    any launch; the exercise's self-check goes through ``labkit.chapters.exercises.check`` with this chapter's
    number (67c44a3: the reference is computed there, out of the notebook's sight), and no cell computes or
    names a reference itself."""
    import ast
    from pathlib import Path

    import nbformat

    from labkit import notebooks

    path = Path(__file__).resolve().parent.parent / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(path, 4)
    i = next(k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    names = [t.id for stmt in ast.parse(nb.cells[i].source).body for t in stmt.targets]
    assert names == list(notebooks.declared_parameters(path)), "papermill must see every parameter"
    first = next(c for c in nb.cells[i + 1:] if c.cell_type == "code")
    assert CHAPTERS[name] in first.source
    call = next(n for n in ast.walk(ast.parse(first.source)) if isinstance(n, ast.Call)
                and ast.unparse(n.func) + "(" == CHAPTERS[name])
    passed = {k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg}
    assert set(names) <= passed, f"not validated before the launch: {set(names) - passed}"
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    checks = [src for src in code if "exercises.check(" in src or "check_exercise(" in src]
    assert checks, "the exercise has a self-check"
    for src in checks:
        calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)]
        names = {ast.unparse(n.func) for n in calls}
        assert names == {"exercises.check"}, f"the exercise cell calls only exercises.check, not {names}"
        chapter = calls[0].args[0]
        assert isinstance(chapter, ast.Constant) and chapter.value == name[:2], \
            f"{name}'s exercise checks chapter {ast.unparse(chapter)}"
    assert not any("check_exercise(" in src or "exercises.reference(" in src or "EXERCISES[" in src for src in code)
    assert not any("reference answer" in c.source or "Reference:" in c.source for c in nb.cells)


def test_check_exercise_never_shows_the_answer(capsys):
    check_exercise(None, 1_523_648, hint="count the all-reduces", wrong="no")
    out = capsys.readouterr().out
    assert out.startswith("not attempted yet") and "count the all-reduces" in out
    assert "1523648" not in out.replace(",", "") and "1.52" not in out
    with pytest.raises(AssertionError) as e:
        check_exercise(1_000_000, 1_523_648, hint="h", wrong="think about no_sync")
    assert "think about no_sync" in str(e.value) and "1523648" not in str(e.value).replace(",", "")
    check_exercise(1_523_648.0000001, 1_523_648, hint="h", wrong="w")
    assert capsys.readouterr().out.strip() == "correct"


def test_ratio_verdict_prints_spread_and_misses():
    line, met = ratio_verdict("ratio a/b", [1.2, 0.9, 1.05], 1.0, higher_is_better=False)
    assert not met and "= 1.050" in line and "0.900 to 1.200" in line and "NOT met" in line
    line, met = ratio_verdict("ratio a/b", [0.97, 0.99], 0.95, higher_is_better=True)
    assert met and line.endswith("met") and "0.970 to 0.990" in line
    with pytest.raises(ValueError, match="finite"):
        ratio_verdict("r", [], 1.0, higher_is_better=True)


def _load_benchmark(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dp_benchmark_exits_nonzero_when_a_goal_is_missed(monkeypatch, capsys):
    bench = _load_benchmark("dp_vs_torch")

    class Fake(list):
        backend = "gloo"

    slow = {"bucket": [80.0, 90.0, 85.0], "ddp": [100.0] * 3, "zero3": [95.0] * 3, "fsdp2": [100.0] * 3}
    monkeypatch.setattr(bench, "launch", lambda *a, **k: Fake([slow, slow]))
    assert bench.main([]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "bucket/ddp" in out[-2] and "0.800 to 0.900" in out[-2] and "NOT met" in out[-2]
    assert "zero3/fsdp2" in out[-1] and out[-1].endswith("met")
    fast = dict(slow, bucket=[99.0, 100.0, 101.0])
    monkeypatch.setattr(bench, "launch", lambda *a, **k: Fake([fast, fast]))
    assert bench.main([]) == 0


def test_scaling_findings_follow_the_numbers():
    def rows(effs):
        return [{"local_batch_size": b, "efficiency": e} for b, e in zip((1, 2, 4, 8), effs)]

    # the tester's world_size=4 run: no monotone trend -> no claim that efficiency rose
    mixed = ch.scaling_findings(rows([0.60, 0.36, 0.86, 0.56]))
    assert "b=1: 0.60, b=2: 0.36, b=4: 0.86, b=8: 0.56" in mixed and "no monotone trend" in mixed
    assert "rose" not in mixed
    assert "rose with the local batch" in ch.scaling_findings(rows([0.3, 0.5, 0.5, 0.9]))
    assert "FELL" in ch.scaling_findings(list(reversed(rows([0.9, 0.5, 0.4, 0.3]))))  # rows sorted by b first
    with pytest.raises(ValueError, match="got no rows"):
        ch.scaling_findings([])
    with pytest.raises(ValueError, match=r"lack \['efficiency'\]"):
        ch.scaling_findings([{"local_batch_size": 1}])
