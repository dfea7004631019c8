"""labkit.chapters.common: the checks and the reader's-prediction comparison every chapter shares."""

from __future__ import annotations

import pytest

from labkit.chapters.common import check_world_size, compare_prediction


def test_compare_prediction_skips_without_a_guess(capsys):
    assert compare_prediction(None, measured=2.0, predicted=3.0, what="speedup") is None
    out = capsys.readouterr().out
    assert "my_prediction is None" in out and "2" not in out.replace("my_prediction", "")  # no number shown


def test_compare_prediction_ratios_and_labels(capsys):
    got = compare_prediction(4.0, measured=2.0, predicted=8.0, what="speedup", measured_label="emulated (dgx-h100)")
    assert got["speedup"]["off_measured"] == 2.0 and got["speedup"]["off_predicted"] == 0.5
    out = capsys.readouterr().out
    assert "2.00x the emulated (dgx-h100) 2" in out and "0.50x the predicted 8" in out


def test_compare_prediction_dicts_and_bad_guesses():
    got = compare_prediction({"a": 1, "b": 6}, measured={"a": 2, "b": 3}, predicted={"a": 1}, what="bytes")
    assert got["a"]["off_predicted"] == 1.0 and got["b"]["off_predicted"] is None and got["b"]["off_measured"] == 2
    with pytest.raises(ValueError, match=r"keys \['z'\] .* valid keys: a"):
        compare_prediction({"z": 1}, measured={"a": 2}, what="q")
    with pytest.raises(ValueError, match="must be a number"):
        compare_prediction("lots", measured=1, what="q")
    with pytest.raises(ValueError, match="finite"):
        compare_prediction(float("nan"), measured=1, what="q")


def test_check_world_size_names_the_chapter():
    assert check_world_size("03", 4) == 4
    with pytest.raises(ValueError, match="chapter 03 needs world_size >= 2, got world_size=1: why; use"):
        check_world_size("03", 1, why="why")


def test_prediction_refuses_bools_strings_and_infinities_naming_what_is_wanted():
    from labkit.chapters.common import check_prediction

    assert check_prediction(None, what="a number") is None
    assert check_prediction(0.8, what="a number") == 0.8 and check_prediction(3, what="a number") == 3.0
    for bad in (True, "abc", "0.5", float("inf"), float("nan"), [1], {"a": 1}):
        with pytest.raises(ValueError, match=r"my_prediction=.* must be None or a fraction"):
            check_prediction(bad, what="a fraction")


def test_prediction_bounds_keys_and_choices():
    from labkit.chapters.common import check_prediction

    frac = dict(what="a fraction in [0, 1]", at_least=0.0, at_most=1.0)
    assert check_prediction(0.0, **frac) == 0.0 and check_prediction(1, **frac) == 1.0
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match=rf"my_prediction={bad} must be None or a fraction in \[0, 1\]"):
            check_prediction(bad, **frac)
    with pytest.raises(ValueError, match="my_prediction=0 must be None or a positive"):
        check_prediction(0, what="a positive number", above=0.0)
    keyed = dict(what="a ratio or a dict of them", keys=("a", "b"), default_key="a")
    assert check_prediction(1.5, **keyed) == {"a": 1.5}
    assert check_prediction({"b": 2}, **keyed) == {"b": 2.0}
    with pytest.raises(ValueError, match="key 'c' is not one this chapter measures; valid keys: a, b"):
        check_prediction({"c": 1}, **keyed)
    with pytest.raises(ValueError, match=r"my_prediction\['b'\]='x' must be None or a ratio"):
        check_prediction({"b": "x"}, **keyed)
    assert check_prediction({"anything": 1}, what="x", keys=()) == {"anything": 1.0}
    assert check_prediction(2, what="x", keys=()) == 2.0  # no default key: a number stays a number
    assert check_prediction("tp", what="'replicas' or 'tp'", choices=("replicas", "tp")) == "tp"
    with pytest.raises(ValueError, match="my_prediction='both' must be None or 'replicas' or 'tp'"):
        check_prediction("both", what="'replicas' or 'tp'", choices=("replicas", "tp"))
