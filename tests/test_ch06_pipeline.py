"""Chapter 06's own functions: the fixed-compute launch (measured and emulated), the sentences it prints (each
flipped by inputs or parameters that give the opposite outcome), the idle-shaded Gantt and the simulator panel."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch06_pipeline_parallel as ch


def test_check_chapter_defaults_and_refusals():
    plan = ch.check_chapter(world_size=4, emulate="dgx-h100")
    # m = 2p by default: 1F1B's memory advantage (p in flight against GPipe's m) shows; the sweep keeps m = p
    assert plan["n_microbatches"] == 8 and plan["sweep_microbatches"] == [4, 8] and plan["emulate"] == "dgx-h100"
    assert ch.check_chapter(world_size=3)["n_microbatches"] == 6
    with pytest.raises(ValueError, match="emulate='dgx-h100' with world_size=12"):
        ch.check_chapter(world_size=12, emulate="dgx-h100")
    with pytest.raises(ValueError, match="emulate='no-such'"):
        ch.check_chapter(world_size=2, emulate="no-such")
    with pytest.raises(ValueError, match="my_prediction"):
        ch.check_chapter(world_size=2, my_prediction="a lot")


def _texts(p, m, emulate):
    plan = ch.check_chapter(world_size=p, n_microbatches=m, op_ms=4.0, sweep=[1], emulate=emulate)
    fixed = ch.run_fixed(plan, steps=1, emulate=emulate, timeout_s=120)
    runs = ch.at_m(fixed, m)
    mem = ch.memory_findings(p, m, runs["gpipe"][0].peak_inflight[0], runs["1f1b"][0].peak_inflight[0])
    return fixed, mem, ch.fixed_findings(fixed["table"], m, fixed["label"])


def test_memory_and_emulation_sentences_flip_with_the_parameters():
    """m = p: 1F1B holds as many micro-batches as GPipe (the sentence says it saves nothing yet); m = 2p: it holds
    p of them. With emulate the fixed-runs sentence sets the emulated cluster beside the simulator; without, not."""
    fixed, mem, text = _texts(2, 2, "dgx-h100")
    assert "saves memory only once m > p" in mem and "less activation memory" not in mem
    assert "emulated (dgx-h100) lands within" in text and "(emulated)" in text
    t = fixed["table"]
    assert t["emulated"].notna().all() and (t["emulated"] - t["predicted (simulator)"]).abs().max() < 0.01
    frame = fixed["emulated"][0]
    assert frame.attrs["label"] == "emulated (dgx-h100)"
    _, mem, text = _texts(2, 4, None)
    assert "less activation memory" in mem and "only once" not in mem
    assert "emulated" not in text and "(measured)" in text


def _rows(un_measured):
    return pd.DataFrame([
        {"run": "a", "schedule": "1f1b", "m": 4, "measured": 0.30, "emulated": 0.2, "predicted (simulator)": 0.2},
        {"run": "b", "schedule": "gpipe", "m": 4, "measured": 0.31, "emulated": 0.2, "predicted (simulator)": 0.2},
        {"run": "1f1b unequal stages", "schedule": "1f1b", "m": 4, "measured": un_measured, "emulated": 0.4,
         "predicted (simulator)": 0.4}])


def test_fixed_findings_direction_follows_the_numbers():
    assert "raised 1F1B's measured bubble from 0.300 to 0.450" in ch.fixed_findings(_rows(0.45), 4, None)
    assert "lowered" in ch.fixed_findings(_rows(0.25), 4, None)


def test_balance_findings_both_ways():
    layers = [1e-3, 1e-3, 1e-3, 5e-3]
    eq, bal = (2, 2), (3, 1)
    paid = ch.balance_findings(layers, eq, bal, [2.0, 6.0], [3.0, 5.0], 0.10, 0.08)
    assert "Balancing paid" in paid and "20% shorter" in paid
    not_lighter = ch.balance_findings(layers, eq, bal, [2.0, 6.0], [3.0, 6.1], 0.10, 0.12)
    assert "ran slower" in not_lighter and "did not lighten the busiest rank" in not_lighter
    lighter = ch.balance_findings(layers, eq, bal, [2.0, 6.0], [3.0, 4.0], 0.10, 0.12)
    assert "did get lighter, yet the step did not follow" in lighter
    assert "kept the equal split" in ch.balance_findings(layers, eq, eq, [1, 1], [1, 1], 0.1, 0.1)


def test_with_idle_fills_the_fill_and_the_drain_and_drops_recv():
    rows = [dict(rank=0, name="F", kind="compute", start_ns=0, end_ns=10, step=0, microbatch=0, stage=0, nbytes=0),
            dict(rank=1, name="recv", kind="comm", start_ns=0, end_ns=10, step=0, microbatch=0, stage=1, nbytes=4),
            dict(rank=1, name="F", kind="compute", start_ns=10, end_ns=20, step=0, microbatch=0, stage=1, nbytes=0),
            dict(rank=0, name="B", kind="compute", start_ns=30, end_ns=40, step=0, microbatch=0, stage=0, nbytes=0)]
    out = ch.with_idle(pd.DataFrame(rows))
    assert "recv" not in set(out["name"])
    idle = out[out["name"] == "idle"]
    assert sorted(zip(idle["rank"], idle["start_ns"], idle["end_ns"])) == [(0, 10, 30), (1, 0, 10), (1, 20, 40)]


def test_schedule_panel_redraws():
    box = ch.schedule_panel(2, 4, 10.0)
    controls = box.children[0].children
    out = box.children[1]
    before = str(out.outputs)
    controls[0].value = "zb-h1"
    assert str(out.outputs) != before and "zb-h1" in str(out.outputs)


def test_the_word_none_turns_emulation_off_and_a_bad_profile_is_refused():
    assert repr(ch.check_chapter(world_size=2, emulate="None")) == repr(ch.check_chapter(world_size=2, emulate=None))
    with pytest.raises(ValueError, match="dgx-h101"):
        ch.check_chapter(world_size=2, emulate="dgx-h101")


def test_balance_findings_says_how_much_longer_the_pipeline_computed():
    text = ch.balance_findings([1e-3, 1e-3, 1e-3, 5e-3], (2, 2), (3, 1), [2.0, 60.0], [3.0, 40.0], 0.10, 0.12, m=2)
    assert "computed 5.0x longer per step than m = 2 micro-batches" in text


def test_balance_inside_the_timing_spread_is_not_called_a_win():
    """"Balancing paid: the step is 14 % shorter" for a change inside the runs' own spread: with the spread
    given, the same numbers say "about as fast" and name the spread."""
    layers, eq, bal = [1e-3, 1e-3, 1e-3, 5e-3], (2, 2), (3, 1)
    assert "Balancing paid: the step is 14% shorter" in ch.balance_findings(layers, eq, bal, [2.0, 6.0], [3.0, 5.0],
                                                                            0.100, 0.086)
    text = ch.balance_findings(layers, eq, bal, [2.0, 6.0], [3.0, 5.0], 0.100, 0.086, spread=0.25)
    assert "Balancing paid" not in text and "about as fast" in text and "timing spread of 25%" in text


def test_gantt_title_says_which_step_and_the_tables_median():
    class Run:  # two timed steps with different bubbles: the figure says which one it draws
        schedule = type("S", (), {"p": 2})()
        job = {"label": "labkit 1f1b pp=2 m=2 (fixed)"}

        def title(self):
            return "labkit 1f1b pp=2 m=2 (fixed) — measured (fixed compute)"

    rows = []
    for step, gap in ((0, 10), (1, 30)):
        base = step * 1000
        rows += [{"rank": 0, "name": "F", "kind": "compute", "start_ns": base, "end_ns": base + 100, "step": step},
                 {"rank": 1, "name": "F", "kind": "compute", "start_ns": base + 100 + gap,
                  "end_ns": base + 200 + gap, "step": step}]
    run = Run()
    run.timeline = pd.DataFrame(rows).assign(microbatch=0, stage=0, nbytes=0)
    fig = ch.run_gantt(run)
    text = fig.layout.title.text + str(fig.layout.title.subtitle.text or "")
    assert "bubble of step 0" in text and "the table's median over 2 steps" in text
    assert text.count("labkit 1f1b pp=2 m=2 (fixed)") == 1, text
