"""Chapter 00's claims flip with the run: the emulated straggler's wait is explained by the free-communication
prediction when the work is long, and not when it is shorter than the collective itself."""

import pandas as pd
import pytest

from labkit.chapters import ch00_getting_started as ch


def test_check_chapter_refuses_bad_emulate_and_prediction():
    good = dict(world_size=2, emulate="dgx-h100", my_prediction=None, work_ms=40.0, steps=3, timeout_s=60.0)
    ch.check_chapter(**good)
    ch.check_chapter(**{**good, "emulate": None, "my_prediction": 41.5})
    with pytest.raises(ValueError, match="cluster=.no-such-cluster. is not valid"):
        ch.check_chapter(**{**good, "emulate": "no-such-cluster"})
    with pytest.raises(ValueError, match="my_prediction"):
        ch.check_chapter(**{**good, "my_prediction": "forty"})
    with pytest.raises(ValueError, match="world_size=9 cannot be placed"):
        ch.check_chapter(**{**good, "world_size": 9})
    # a step count is bounded (a fuzzed steps=10**9 ran until the cell timeout), in every chapter with one
    from labkit.chapters.common import MAX_STEPS

    ch.check_chapter(**{**good, "steps": MAX_STEPS})
    with pytest.raises(ValueError, match=f"steps=1000000000 is too large.*at most {MAX_STEPS}"):
        ch.check_chapter(**{**good, "steps": 10**9})
    import pathlib
    import re

    for path in sorted(pathlib.Path(ch.__file__).parent.glob("ch*.py")):  # every chapter's step counts
        assert not re.search(r'positive_int\("\w*steps"', path.read_text()), path.name


def _frame(arrivals_ms, ends_ms):
    rows = []
    for r, (a, e) in enumerate(zip(arrivals_ms, ends_ms)):
        rows.append({"rank": r, "name": "work", "kind": "compute", "start_ns": 0, "end_ns": int(a * 1e6), "step": 0})
        rows.append({"rank": r, "name": "all_reduce", "kind": "comm", "start_ns": int(a * 1e6),
                     "end_ns": int(e * 1e6), "step": 0})
    return pd.DataFrame(rows)


def test_last_to_arrive_waits_least_flips():
    ok = ch.straggler_findings(ch.wait_table(_frame([40, 80], [81, 81])), 40.0)["measured"]
    assert ok["last_waits_least"] and "In every step the last rank" in ok["sentence"]
    bad = ch.straggler_findings(ch.wait_table(_frame([40, 80], [41, 95])), 40.0)["measured"]
    assert not bad["last_waits_least"] and "was NOT the one" in bad["sentence"]


@pytest.mark.slow
def test_emulated_gap_sentence_flips_with_work_ms():
    long = ch.straggler_run(2, work_ms=40.0, steps=1, emulate="dgx-h100", keep_warm=False)["findings"]["emulated"]
    short = ch.straggler_run(2, work_ms=0.001, steps=1, emulate="dgx-h100", keep_warm=False)["findings"]["emulated"]
    assert long["gap_small"] and "explains almost all of the wait" in long["sentence"]
    assert not short["gap_small"] and "a large part of it" in short["sentence"]
    assert long["last_waits_least"] and abs(long["rank0_wait_ms"] - 40.0) < 0.1


def test_emulate_none_from_the_command_line_turns_emulation_off():
    assert ch.as_emulate("None") is None and ch.as_emulate(None) is None and ch.as_emulate(False) is None
    assert ch.as_emulate("dgx-h100") == "dgx-h100"
    ch.check_chapter(world_size=3, emulate="None", my_prediction=None, work_ms=1.0, steps=1, timeout_s=10.0)


def _run(measured, emulated=None):
    waits = ch.wait_table(_frame(*measured))
    ew = ch.wait_table(_frame(*emulated)) if emulated is not None else None
    return {"waits": waits, "findings": ch.straggler_findings(waits, 40.0, emulated=ew, label="emulated (x)")}


def test_the_straggler_check_fails_on_a_program_without_a_straggler():
    """Issue 27: the old emulated check (the last to arrive waits least, gap >= 0) held for equal work too."""
    straggler = ([40, 80], [81, 81])
    ch.check_straggler(_run(straggler, straggler), 40.0)
    no_straggler = ([40, 40], [41, 41])  # both ranks arrive together: nobody waits for anybody
    old = _run(straggler, no_straggler)["findings"]["emulated"]
    assert old["last_waits_least"] and old["gap_ms"] >= 0  # what the notebook used to check: it passes
    with pytest.raises(AssertionError, match="emulated: rank 0's predicted wait 0 ms"):
        ch.check_straggler(_run(straggler, no_straggler), 40.0)
    with pytest.raises(AssertionError, match="no straggler|computed"):
        ch.check_straggler(_run(([40, 41], [42, 42])), 40.0)
    with pytest.raises(AssertionError):  # the straggler is there but rank 0 left all_reduce early
        ch.check_straggler(_run(([40, 80], [45, 81])), 40.0)
