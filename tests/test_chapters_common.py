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


def test_number_prediction_refuses_bools_strings_and_infinities_naming_what_is_wanted():
    from labkit.chapters.common import check_number_prediction

    check_number_prediction(None, what="a number")
    check_number_prediction(0.8, what="a number")
    for bad in (True, "abc", float("inf"), [1]):
        with pytest.raises(ValueError, match=r"must be None or a fraction"):
            check_number_prediction(bad, what="a fraction")
