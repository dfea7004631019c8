"""labkit.experiments.fullscale: the lab's strategies at a real model's shapes under fake tensors.

The memory checks compare MemTracker's measurement of the strategy as it runs (an independent observation)
with labkit.theory.memory's prediction; the emulation checks compare the rank-symmetric replay (two traced
ranks, relabelled) with the replay of every rank traced, which a wrong relabelling or role choice fails.
Sizes are cut (2-4 layers, short sequences) so each case runs in seconds on 2 cores; the full-size table is
in docs/fullscale.md.
"""

from __future__ import annotations

import pytest

from labkit.experiments import fullscale as fs

GiB = 2**30


def test_model_states_and_activations_match_the_calculator():
    r = fs.measure_memory("llama-3-8b", "zero1", 4, n_layers=2, seq_len=512)
    assert r["label"] == "measured (fake tensors)"
    # ZeRO-1: optimizer state sharded over 4 ranks, parameters and gradients whole (bf16, torch AdamW in bf16),
    # all resident right after the optimizer step
    for cat in ("optimizer", "gradients"):
        assert r["after_step"][cat] == pytest.approx(r["predicted"][cat], rel=0.01), cat
    assert r["after_step"]["parameters"] == pytest.approx(r["predicted"]["parameters"], rel=0.02)  # + rope buffers
    # what autograd saved by the end of the forward (the logits and loss are the calculator's temporaries)
    assert r["after_forward"]["activations"] == pytest.approx(r["predicted"]["activations"], rel=0.05)
    assert r["peak_phase"] in ("forward", "backward", "optimizer")
    assert 0.8 < r["ratio"] < 1.25


def test_sharding_shrinks_the_measured_state_as_the_zero_stage_rises():
    got = {s: fs.measure_memory("llama-3-8b", s, 4, n_layers=2, seq_len=256)["after_step"] for s in ("ddp", "zero1")}
    # ZeRO-1 holds a quarter of DDP's optimizer state: measured, not computed
    assert got["zero1"]["optimizer"] == pytest.approx(got["ddp"]["optimizer"] / 4, rel=0.01)


def test_a_layout_that_does_not_fit_names_the_category_and_the_phase():
    r = fs.measure_memory("llama-3-8b", "ddp", 2, n_layers=4, seq_len=8192, device="rtx-4090-24gb")
    assert r["fits"] is False
    assert "does not fit on rtx-4090-24gb" in r["verdict"] and "largest category is" in r["verdict"]
    assert r["peak_phase"] in r["verdict"]


def test_pipeline_stages_are_measured_each():
    r = fs.measure_memory("llama-3-8b", "pp", 2, n_layers=4, seq_len=512, n_microbatches=4)
    assert sorted(r["per_stage"]) == [0, 1] and r["traced_ranks"] == [0, 1]
    assert r["measured"]["activations"] <= r["predicted"]["activations"] * 1.05


def test_bad_input_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="strategy"):
        fs.measure_memory("llama-3-8b", "zero4", 4)
    with pytest.raises(ValueError):
        fs.measure_memory("llama-3-8b", "pp", 64, n_layers=4)  # more stages than layers


def test_rank_symmetric_replay_equals_tracing_every_rank():
    """Two traced ranks (one per stage) relabelled for eight must replay exactly as eight traced ranks."""
    from labkit.runtime import emulate as _em
    from labkit.runtime.fake import launch_fake
    from labkit.theory.replay import replay

    kw = dict(model="llama-3-8b", seq_len=256, micro_batch_size=1, n_microbatches=2, n_layers=4)
    r = fs.emulate_mesh("llama-3-8b", "dgx-h100", dp=2, tp=2, pp=2, seq_len=256, n_microbatches=2, n_layers=4)
    assert r["traced_ranks"] == [0, 4] and r["world_size"] == 8
    full = launch_fake(fs.step_rank, 8, 2, 2, 2, record=True, **kw)
    cl = _em.resolve("dgx-h100", 8).cluster
    every = replay([fs.compress_trace(fs.step_events(full.fake_traces[k]), cl) for k in range(8)], cl)
    assert every.makespan_ns / 1e9 == pytest.approx(r["emulated_s"], rel=1e-9)
    # physics: the step is at least the slowest stage's compute, and the last stage (head + loss) is the slowest
    s0, s1 = r["per_stage"]
    assert s1["compute_s"] > s0["compute_s"]
    assert r["emulated_s"] >= max(s0["compute_s"], s1["compute_s"])


def test_moe_runs_with_uniform_routing_stated_and_experts_sharded():
    r = fs.measure_memory("mixtral-8x7b", "ep", 4, n_layers=1, seq_len=256)
    assert any("uniform routing" in a for a in r["assumptions"])
    # 8 experts over 4 ranks: 2 each; the model states measured right after the step match the calculator's split
    for cat in ("parameters", "optimizer"):
        assert r["after_step"][cat] == pytest.approx(r["predicted"][cat], rel=0.03), cat
