"""Chapter 05's own functions: the emulated inside-vs-across-nodes run and the sentences it prints (flipped by
parameters or inputs that give the opposite outcome), the socket and activation sentences, and the checks of the
emulated section's parameters."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch05_tensor_parallel as ch


def test_check_chapter_emulated_parameters():
    assert ch.check_chapter(world_size=2, emulate="dgx-h100")["emulate_tp"] == 4
    assert ch.check_chapter(world_size=2, emulate=None)["emulate_tp"] is None
    assert ch.check_chapter(world_size=2, emulate="dgx-h100", emulate_tp=2)["emulate_tp"] == 2
    with pytest.raises(ValueError, match="emulate_tp=3"):
        ch.check_chapter(world_size=2, emulate="dgx-h100", emulate_tp=3)
    with pytest.raises(ValueError, match="emulate='nope'"):
        ch.check_chapter(world_size=2, emulate="nope")
    with pytest.raises(ValueError, match="emulate_seq_len"):
        ch.check_chapter(world_size=2, emulate="dgx-h100", emulate_seq_len=10**7)
    with pytest.raises(ValueError, match="my_prediction"):
        ch.check_chapter(world_size=2, my_prediction="twice")
    assert ch.placements(4) == [4, 2, 1] and ch.placements(2) == [2, 1]


def _row(placement, nodes, step, comm, pred):
    return {"placement": placement, "nodes": nodes, "label": "emulated (dgx-h100, as llama-3-8b)", "step_s": step,
            "comm_s": comm, "compute_s": step - comm, "predicted_step_s": pred, "predicted_comm_s": comm}


def test_node_findings_both_ways():
    costly = ch.node_findings([_row("one node", 1, 0.10, 0.01, 0.1), _row("4 nodes", 4, 0.30, 0.2, 0.28)], 4)
    assert "3.0x as long" in costly and "cost more than the arithmetic" in costly
    cheap = ch.node_findings([_row("one node", 1, 0.10, 0.01, 0.1), _row("2 nodes", 2, 0.12, 0.03, 0.12)], 4)
    assert "cost less than the arithmetic" in cheap and "more than the arithmetic" not in cheap


@pytest.mark.slow
def test_leaving_the_node_costs_more_than_the_arithmetic_for_8b_not_for_405b():
    """The chapter's entry point, emulated (deterministic): a tp=4 step of llama-3-8b spread over 4 nodes spends
    more on its all-reduces than on compute; charged as llama-3.1-405b (4x the hidden size: compute grows as
    h^2, the all-reduces as h) it spends less. The printed sentence flips with the model.

    Under the calibrated model (issue 26: GEMMs priced by shape, collectives below line rate) llama-3-70b (2x
    the hidden size), the opposite case before, sits at a tie over 4 nodes (about 1.05 s of all-reduces against
    1.03 s of compute, emulated), so it cannot show the flip; both cases here keep a margin in the emulated run
    and in the prediction alike."""
    small = ch.tp_across_nodes(4, as_model="llama-3-8b")
    big = ch.tp_across_nodes(4, as_model="llama-3.1-405b")
    assert [r["nodes"] for r in small] == [1, 2, 4]
    assert all(a["step_s"] < b["step_s"] for a, b in zip(small, small[1:]))
    assert all(abs(r["step_s"] / r["predicted_step_s"] - 1) < 0.3 for r in small + big)
    for rows, more in ((small, True), (big, False)):
        far = rows[-1]
        emulated = far["comm_s"] / far["compute_s"]
        predicted = far["predicted_comm_s"] / (far["predicted_step_s"] - far["predicted_comm_s"])
        assert (emulated > 1.3 and predicted > 1.3) if more else (emulated < 0.7 and predicted < 0.7), \
            (far, emulated, predicted)
    assert "cost more than the arithmetic" in ch.node_findings(small, 4)
    assert "cost less than the arithmetic" in ch.node_findings(big, 4)


def test_wire_and_activation_sentences_both_ways():
    wire = pd.DataFrame({"variant": ["TP", "TP+SP"], "measured / gloo model": [1.08, 1.12]})
    assert "1.08-1.12x" in ch.wire_findings(wire) and "headers" in ch.wire_findings(wire)
    assert "below the model" in ch.wire_findings(wire.assign(**{"measured / gloo model": [0.9, 1.1]}))
    assert "no socket bytes" in ch.wire_findings(wire.assign(**{"measured / gloo model": [float("nan")] * 2})).lower()
    act = pd.DataFrame({"variant": ["tp=1 (unsharded)", "TP", "TP+SP"], "ratio_to_tp1_measured": [1.0, 0.64, 0.5]})
    assert "well above 1/tp" in ch.activation_findings(act, 2)
    assert "already near 1/tp" in ch.activation_findings(act.assign(ratio_to_tp1_measured=[1.0, 0.52, 0.5]), 2)


def test_step_time_findings_name_dtensor_overhead_only_when_it_is_slower_than_hand():
    slow = ch.step_time_findings({"tp1": [0.09], "hand": [0.08], "dtensor": [0.27]}, 2)
    assert "same collectives as the hand-written TP" in slow and "3.38x of hand's step" in slow
    even = ch.step_time_findings({"tp1": [0.09], "hand": [0.08], "dtensor": [0.081]}, 2)
    assert "same collectives" not in even


def test_the_word_none_turns_emulation_off_and_a_bad_profile_is_refused():
    assert repr(ch.check_chapter(world_size=2, emulate="None")) == repr(ch.check_chapter(world_size=2, emulate=None))
    with pytest.raises(ValueError, match="dgx-h101"):
        ch.check_chapter(world_size=2, emulate="dgx-h101")


def test_dtensor_slowness_is_not_blamed_on_collectives_when_hand_is_fast():
    text = ch.step_time_findings({"tp1": [0.124], "hand": [0.086], "dtensor": [0.556]}, 2)
    assert "collectives TP adds to every layer cost more" not in text
    assert "dtensor ran slower than one rank although the hand-written TP did not" in text
    both = ch.step_time_findings({"tp1": [0.05], "hand": [0.086], "dtensor": [0.556]}, 2)
    assert "hand, dtensor ran slower than one rank: in this run the collectives" in both
