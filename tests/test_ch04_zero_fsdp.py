"""Chapter 04's emulated trade-off and the sentences it prints: each claim flips with the parameters that
should flip it (issue 19: prose that follows the numbers)."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch04_zero_fsdp as ch


def test_check_chapter_adapts_the_batch_and_checks_the_emulated_parameters():
    assert ch.check_chapter(world_size=3)["global_batch_size"] == 12
    plan = ch.check_chapter(world_size=2, emulate="dgx-h100")["emulate"]
    assert plan["model"] == "llama-3-8b" and plan["lab_seq_len"] == ch.LAB_SEQ_LEN
    with pytest.raises(ValueError, match=r"emulated_ranks=32"):
        ch.check_chapter(world_size=2, emulate="dgx-h100", emulated_ranks=32)
    with pytest.raises(ValueError, match="valid keys: zero3_step_ratio, zero3_memory_gb"):
        ch.check_chapter(world_size=2, my_prediction={"memory": 3})
    with pytest.raises(ValueError, match=r"my_prediction=nan must be None or a finite number"):
        ch.check_chapter(world_size=2, my_prediction=float("nan"))
    ch.check_chapter(world_size=2, my_prediction={"zero3_memory_gb": 20})


def test_measured_step_findings_follow_the_measured_direction():
    t = pd.DataFrame({"label": ["ddp", "zero3"], "step_s": [0.050, 0.060]})
    assert "ZeRO-3 was 1.20x DDP's step" in ch.measured_step_findings(t)
    t["step_s"] = [0.050, 0.030]
    assert "ZeRO-3 was faster than DDP here (0.60x)" in ch.measured_step_findings(t)
    t["step_s"] = [0.050, 0.051]
    assert "the same time within 5 %" in ch.measured_step_findings(t)


@pytest.fixture(scope="module")
def tradeoff():
    """The chapter's entry point on 2 emulated ranks (one launch; the other cases re-priced from its traces)."""
    return ch.emulated_tradeoff(ch.emulation_plan("dgx-h100", 2, "llama-3-8b", 2048), 2)


def test_fit_sentence_flips_with_the_model_and_the_link(tradeoff):
    ch.check_emulated(tradeoff)
    text = ch.tradeoff_findings(tradeoff)  # 8B on 2 H100s (85.9 GB): DDP 128.5 GB does not fit, ZeRO-1 80.3 GB does
    assert "DDP does not fit; zero1 is the first stage that does" in text
    assert "No stage fits at d=2" in ch.tradeoff_findings(tradeoff.reprice(model="llama-3-70b"))
    assert "Every stage fits" in ch.tradeoff_findings(tradeoff.reprice(model="lab-small-llama", charged_seq_len=256))


def test_step_cost_sentence_flips_with_the_compute_per_step(tradeoff):
    long = tradeoff.reprice(charged_seq_len=8192)   # 4x the compute per step: the extra all-gathers hide in it
    short = tradeoff.reprice(cluster="pcie-4090", charged_seq_len=256)  # little compute, a slow link
    assert long.step_ratio() <= 1.1 < short.step_ratio(), (long.step_ratio(), short.step_ratio())
    assert "cost little here" in ch.tradeoff_findings(long)
    assert "more time per step" in ch.tradeoff_findings(short)
    assert "cost little here" not in ch.tradeoff_findings(short)


def test_measured_step_sentence_reads_the_overlap_the_run_recorded():
    t = pd.DataFrame({"label": ["ddp", "zero3"], "step_s": [0.050, 0.060]})
    exp = pd.DataFrame({"label": ["ddp", "zero3"], "comm_ms": [13.5, 86.6], "hidden_ms": [0.0, 21.9],
                        "exposed_ms": [13.5, 64.7], "hidden_fraction": [0.0, 0.253]})
    text = ch.measured_step_findings(t, exp)
    assert "25% of it ran under compute (64.7 ms exposed)" in text and "86.6 ms" in text, text
    assert "nothing overlaps" not in text


def test_tradeoff_sentence_states_the_replays_numbers(tradeoff):
    import re

    b = tradeoff.breakdown()
    assert set(b.columns) >= {"step_ms", "compute_ms", "comm_ms", "hidden_ms", "exposed_ms"}
    assert (b["hidden_ms"] <= b["comm_ms"] + 1e-9).all() and (b["comm_ms"] > 0).all()
    text = ch.tradeoff_findings(tradeoff)
    m = re.search(r"its communication took (\d+) ms a step against DDP's (\d+) ms, (\d+) ms of it under compute", text)
    assert m, text
    assert [int(x) for x in m.groups()] == [round(b.loc["zero3", "comm_ms"]), round(b.loc["ddp", "comm_ms"]),
                                            round(b.loc["zero3", "hidden_ms"])]
    for v in ("zero1", "zero2"):  # a sharded stage shorter than DDP is explained from the replay, or not claimed
        shorter = tradeoff.value(v, "emulated_step_s") < 0.97 * tradeoff.value("ddp", "emulated_step_s")
        assert (f"{v}'s step is shorter than DDP's" in text) == shorter


def test_emulated_checks_hold_at_values_check_chapter_accepts(tradeoff):
    """The old emulated/predicted band (0.5, 1.5) raised at charged_seq_len=256, which check_chapter accepts;
    the extra-communication bound holds there, and fails for a trace that sends no extra all-gather."""
    for t in (tradeoff, tradeoff.reprice(charged_seq_len=256), tradeoff.reprice(charged_seq_len=8192),
              tradeoff.reprice(cluster="pcie-4090"), tradeoff.reprice(model="lab-small-llama", charged_seq_len=256)):
        ch.check_emulated(t)
    b = tradeoff.breakdown()
    b.loc["zero3", "comm_ms"] = b.loc["ddp", "comm_ms"]
    flat = ch.EmulatedTradeoff(tradeoff.result, tradeoff.plan, tradeoff.n)
    flat.breakdown = lambda: b
    with pytest.raises(AssertionError, match="less than the predicted extra all-gather"):
        ch.check_emulated(flat)


def test_memory_check_reads_the_measured_bytes():
    both = pd.DataFrame({"degree": [2] * 4, "variant": ["ddp", "zero1", "zero2", "zero3"],
                         "model_states_measured": [40, 30, 25, 20]})
    ch.check_emulated(None, both)
    both.loc[3, "model_states_measured"] = 26  # a run whose ZeRO-3 holds more than ZeRO-2
    with pytest.raises(AssertionError, match="do not fall with the stage"):
        ch.check_emulated(None, both)
