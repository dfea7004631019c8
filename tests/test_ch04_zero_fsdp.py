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
