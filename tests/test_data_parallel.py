"""Replicated data parallelism (labkit.parallel.data) on gloo: parity with the single-process reference,
replicas identical, communication bytes equal to theory, and the gradient-accumulation field case.

Two launches (2 and 4 ranks); each checks several variants. Tolerance: labkit.models.TOLERANCES[fp32]
(rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from labkit import launch
from labkit.models import TOLERANCES, build_model, train_reference
from labkit.parallel import data, harness
from labkit.spec import get_spec

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
    out = data.run_rank(ctx, runs, model=MODEL, steps=STEPS, global_batch_size=GLOBAL_BATCH, seq_len=SEQ)
    demo = None
    if ctx.world_size == 2:
        demo = {(v, s): data.accumulation_demo(ctx, v, s) for v in data.VARIANTS for s in (None, 0)}
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
    harness.assert_ranks_identical([r["grads"] for r in per_rank], f"{label} gradients")
    harness.assert_ranks_identical([r["state"] for r in per_rank], f"{label} weights")
    harness.assert_state_close(per_rank[0]["state"], ref["state_dict"], torch.float32, f"{label} weights")
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
        harness.assert_state_close(_by_label(res)[label][0]["grads"], reference["grads"], torch.float32, label)


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
    """Every variant all-reduces exactly 2(n-1)/n · Ψ · 4 bytes per rank per step (accumulation: once per
    step, thanks to no_sync); the timeline's comm events carry the same bytes."""
    n, res = launched
    psi = get_spec(MODEL).n_params()
    expected = data.predicted_allreduce_bytes(psi, n)
    for label, per_rank in _by_label(res).items():
        r0 = per_rank[0]
        assert set(r0["comm"]) == {"all_reduce"}, label
        assert r0["comm_bytes_per_step"] == pytest.approx(expected, rel=1e-12), label
        events = harness.window(res.timeline, r0["window_ns"])
        comm = events[(events["kind"] == "comm") & (events["rank"] == 0)]
        assert comm["nbytes"].sum() == psi * 4 * STEPS, label
    # naive: one call per gradient tensor; bucketed: one per bucket (fewer)
    n_tensors = len(list(build_model(MODEL).parameters()))
    assert _by_label(res)["naive"][0]["comm"]["all_reduce"]["calls"] == pytest.approx(n_tensors)
    assert 1 < _by_label(res)["bucket"][0]["comm"]["all_reduce"]["calls"] < n_tensors


def test_accumulation_demo_reproduces_4_vs_7(launched):
    n, res = launched
    if n != 2:
        pytest.skip("the demo's numbers are for 2 ranks")
    d0, d1 = res[0]["demo"], res[1]["demo"]
    for v in data.VARIANTS:
        assert d0[(v, None)] == d1[(v, None)] == 5.5, v
        assert (d0[(v, 0)], d1[(v, 0)]) == (4.0, 7.0), v


def test_model_state_bytes_replicated(launched):
    """labkit.measure on every replica: 4Ψ parameters, 4Ψ gradients, 8Ψ AdamW moments + one 4-byte step
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
    assert data.predicted_allreduce_bytes(1000, 1) == 0
    assert data.predicted_allreduce_bytes(1000, 2) == 4000
    assert data.predicted_allreduce_bytes(1000, 4, bytes_per_element=2) == 3000
    with pytest.raises(ValueError, match="world_size=0"):
        data.predicted_allreduce_bytes(1000, 0)


def test_batch_helpers_reject_bad_sizes():
    from labkit.models import SyntheticLM

    d = SyntheticLM(32, 8)
    tk, tg = harness.local_batch(d, 0, 8, 1, 4)
    assert tk.shape == (2, 8) and torch.equal(tk, d.batch(0, 8)[0][2:4])
    with pytest.raises(ValueError, match="dp=3 does not divide global_batch_size=8"):
        harness.local_batch(d, 0, 8, 0, 3)
    with pytest.raises(ValueError, match="n_microbatches=3"):
        harness.microbatches(tk, tg, 3)


def test_carve_removes_blocking_intervals():
    spans = [("B", 0, 100, {})]
    assert harness._carve(spans, [(10, 20), (50, 120)]) == [("B", 0, 10, {}), ("B", 20, 50, {})]
    assert harness._carve(spans, []) == spans

