"""Chapter 11: the sentences follow the numbers (each claim flips), the emulated series shows the knee at the
node boundary, parameters adapt to world_size or are refused before any launch."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch11_scaling as ch

OK = dict(world_size=4, model="lab-tiny-llama", seq_len=32, strong_total=None, weak_per_rank=4, matmul_size=64,
          repeats=1, threads_per_rank=1, backend="auto")


def test_the_knee_sentence_flips_with_the_node_boundary():
    """Emulated (deterministic), through the chapter's entry point: 4 GPUs in nodes of 2 fall most where the
    group first spans two nodes; in one node of 4 there is no node-boundary knee."""
    two = ch.check_chapter(**OK, emulate_world_size=4, emulate_gpus_per_node=2)["emulated"]
    one = ch.check_chapter(**OK, emulate_world_size=4, emulate_gpus_per_node=4)["emulated"]
    em2, pr2 = ch.run_emulated(two, weak_per_rank=2)
    em1, pr1 = ch.run_emulated(one, weak_per_rank=2)
    t2, t1 = ch.knee_findings(em2), ch.knee_findings(em1)
    assert "from n=2 to n=4" in t2 and "knee at the node boundary" in t2
    assert "inside one node of 4 GPUs" in t1 and "knee at the node boundary" not in t1
    ch.check_emulated(em2, pr2)
    ch.check_emulated(em1, pr1)
    assert em2.attrs["label"] == "emulated (dgx-h100/2, as llama-3-8b)"
    kw = ch.prediction_kwargs(em2, pr2)
    assert kw["measured_label"] == em2.attrs["label"] and kw["predicted_label"].startswith("predicted (")
    names = [t.name for t in ch.efficiency_figure(_series(0.5, 0.9), em2, pr2).data]
    assert any(n.startswith("measured") for n in names) and any(n.startswith("emulated (") for n in names)
    assert any(n.startswith("predicted (cores ceiling") for n in names)


def _series(strong_eff, weak_eff, n=4):
    rows = []
    for mode, eff in (("strong", strong_eff), ("weak", weak_eff)):
        for w, e in ((1, 1.0), (n, eff)):
            rows.append({"experiment": "train", "mode": mode, "world_size": w, "efficiency": e,
                         "baseline_world_size": 1, "ideal_speedup_on_cores": min(w, 2), "cores": 2,
                         "efficiency_formula": "x"})
    return pd.DataFrame(rows)


def test_the_strong_vs_weak_sentence_flips():
    assert "0.40 is below weak scaling's 0.80" in ch.scaling_findings(_series(0.4, 0.8))
    assert "0.80 is above weak scaling's 0.40" in ch.scaling_findings(_series(0.8, 0.4))
    assert "equally efficient" in ch.scaling_findings(_series(0.5, 0.5))
    assert "cores cap that efficiency at 0.50" in ch.scaling_findings(_series(0.4, 0.8))


def test_the_peak_sentence_explains_all_cores_below_one_thread():
    slow = ch.peak_findings({"cores": 2, "flops_1_thread": 95.6e9, "flops_all_cores": 38.2e9, "flops_machine": 191e9,
                             "machine_basis": "2 cores x one core alone"})
    good = ch.peak_findings({"cores": 2, "flops_1_thread": 95.6e9, "flops_all_cores": 185e9, "flops_machine": 191e9,
                             "machine_basis": "2 cores x one core alone"})
    assert "slower* than one thread" in slow and "busy with other work" in slow
    assert "The cores scale" in good and "slower" not in good
    steady = ch.peak_findings({"cores": 2, "flops_1_thread": 100e9, "flops_all_cores": 190e9, "flops_machine": 200e9,
                               "machine_basis": "x", "tries_1_thread": [100e9, 97e9], "spread_1_thread": 100 / 97})
    moved = ch.peak_findings({"cores": 2, "flops_1_thread": 140e9, "flops_all_cores": 190e9, "flops_machine": 280e9,
                              "machine_basis": "x", "tries_1_thread": [140e9, 100e9], "spread_1_thread": 1.4})
    assert "spread 1.03x" in steady and "a steady core" in steady and "noise" not in steady
    assert "spread 1.40x" in moved and "about 40% of timing noise" in moved


def test_the_mfu_limit_is_ten_percent_or_the_peaks_own_spread():
    assert ch.mfu_limit({"spread_1_thread": 1.02}) == 1.10 and ch.mfu_limit({}) == 1.10
    assert ch.mfu_limit({"spread_1_thread": 1.35}) == 1.35


def test_parameters_adapt_to_world_size_or_are_refused():
    three = ch.check_chapter(**{**OK, "world_size": 3})
    assert three["sizes"] == [1, 2, 3] and three["strong_total"] == 6
    assert ch.check_chapter(**OK)["strong_total"] == 8
    assert ch.check_chapter(**OK, emulate=None)["emulated"] is None
    with pytest.raises(ValueError, match=r"strong_total=6 .* \[4\] do not divide it"):
        ch.check_chapter(**{**OK, "strong_total": 6})
    with pytest.raises(ValueError, match="no-such"):
        ch.check_chapter(**OK, emulate="no-such")
    with pytest.raises(ValueError, match="6"):
        ch.check_chapter(**OK, emulate_world_size=6, emulate_gpus_per_node=4)
    with pytest.raises(ValueError, match="my_prediction"):
        ch.check_chapter(**OK, my_prediction="a lot")


def test_the_serial_part_named_is_what_the_experiment_runs():
    """matmul is compute only: its sentence never blames the all-reduce or the optimizer (it did: "matmul 0.35
    is below weak scaling's 0.36: the all-reduce, the optimizer ... do not"); a gap inside the timing spread is
    called unmeasured (68504f2: neither ordered nor called equal — the run cannot tell), and the same gap with
    tight timings is ordered again."""
    mm = _series(0.4, 0.8).assign(experiment="matmul")
    text = ch.scaling_findings(mm)
    assert "below weak scaling's 0.80" in text and "no communication" in text and "all-reduce" not in text
    assert "the all-reduce, the optimizer" in ch.scaling_findings(_series(0.4, 0.8))
    noisy = _series(0.35, 0.36).assign(experiment="matmul", time_s=1.0, time_min_s=0.9, time_max_s=1.1)
    text = ch.scaling_findings(noisy)
    assert "differ by less than this run's timing spread (0.07)" in text and "order is not measured" in text, text
    assert "below" not in text and "above" not in text and "equally efficient" not in text, text
    gap = _series(0.30, 0.36).assign(experiment="matmul", time_s=1.0, time_min_s=0.99, time_max_s=1.01)
    text = ch.scaling_findings(gap)  # spread 0.01 x 0.36: a 0.06 gap is outside it
    assert "0.30 is below weak scaling's 0.36" in text and "timing spread" not in text, text
    wide = gap.assign(time_min_s=0.8, time_max_s=1.2)  # spread 0.4 x 0.36 = 0.14: the same gap is inside it
    assert "order is not measured" in ch.scaling_findings(wide)


def test_the_mfu_bound_is_the_cores_the_ranks_can_use():
    """A rank uses at most one core at the one-thread peak: one rank's MFU against 2 cores is bounded by half
    the limit, not by 1.1 (a 2x FLOP overcount at n=1 passed the old check, fails this one)."""
    peak = {"cores": 2, "flops_1_thread": 100e9, "flops_machine": 200e9, "spread_1_thread": 1.0}
    assert ch.mfu_bound(peak, 1) == pytest.approx(0.55) and ch.mfu_bound(peak, 4) == pytest.approx(1.10)
    assert ch.mfu_bound(peak, 1, threads_per_rank=2) == pytest.approx(1.10)
    with pytest.raises(ValueError, match="world_size"):
        ch.mfu_bound(peak, 0)
