"""Chapter 09's "estimate, then measure" loop: the sentences follow the emulated runs (each claim flips with
the parameters), the exercise never shows its answer, bad parameters are refused before any launch."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch09_composing_meshes as ch

OK = dict(world_size=4, model="lab-tiny-llama", steps=2, seq_len=32, n_microbatches=4, plan_model="llama-3-70b",
          plan_gpus=1024, plan_gpu="h100-80gb", gpus_per_node=8, plan_seq_len=8192, plan_global_batch=1024)


def test_the_planner_agreement_sentence_flips_with_the_mesh(assert_emulated_label):
    """Emulated (deterministic): the shallow pipeline's step is more than 5 % longer than the planner's
    estimate, the deep pipeline's within 5 % — where the sentence names the two errors that cancel."""
    shallow = ch.check_chapter(**OK, loop_meshes=[(2, 1, 2)])["loop"]
    deep = ch.check_chapter(**OK, loop_meshes=[(1, 1, 4)])["loop"]
    a = ch.estimate_then_measure(shallow, 4)
    b = ch.estimate_then_measure(deep, 4)
    ta, tb = ch.loop_findings(a, 0.05), ch.loop_findings(b, 0.05)
    assert "beyond 5%" in ta and "within 5%" not in ta
    assert "within 5%" in tb and "two errors cancel" in tb
    ch.check_loop(a, 0.05)
    ch.check_loop(b, 0.05)
    assert_emulated_label(a.attrs["label"], "emulated (dgx-h100, as llama-3-8b")
    fig = ch.loop_figure(a)
    # the figure's traces carry the run's own label (with any 'incomplete' note) and the planner's formula
    assert [t.name for t in fig.data][:2] == [a.attrs["label"],
                                              "predicted (planner: FLOPs / (peak x MFU) + 1F1B bubble + alpha-beta)"]
    kw = ch.prediction_kwargs(b)
    assert kw["measured"] == pytest.approx(float(b["emulated_s"].iloc[0]))
    # re-priced on another cluster without running: another label, other numbers
    from labkit.experiments.mesh_loop import reprice

    c = reprice(b, "dgx-a100")
    assert_emulated_label(c.attrs["label"], "emulated (dgx-a100, as llama-3-8b")
    assert c["emulated_s"].iloc[0] > b["emulated_s"].iloc[0]


def _loop(emulated, planner):
    df = pd.DataFrame({"mesh": ["A", "B"], "m": [4, 4], "emulated_s": emulated, "planner_s": planner,
                       "ratio": [e / p for e, p in zip(emulated, planner)], "imbalance": [1.0, 1.0],
                       "simulated_s": emulated, "balanced_s": emulated})
    df.attrs["label"] = "emulated (toy)"
    return df


def test_the_ranking_sentence_flips():
    assert "ranks the meshes as the emulated runs do" in ch.ranking_sentence(_loop([1.0, 2.0], [1.1, 2.1]))
    text = ch.ranking_sentence(_loop([1.0, 2.0], [2.1, 1.1]))
    assert "would pick B, the run says A" in text


def _timing(steps):
    return pd.DataFrame({"run": ["dp_tp", "pp_dp", "reference (1 process)"], "step_s": steps})


def test_the_measured_time_sentence_follows_the_timing():
    parity = pd.DataFrame({"what": ["losses", "grads", "params"], "max_abs_diff": [1e-7, 2e-7, 3e-6],
                           "ok": [True] * 3})
    slow = ch.run_findings(parity, _timing([0.02, 0.03, 0.01]))
    fast = ch.run_findings(parity, _timing([0.005, 0.006, 0.01]))
    mixed = ch.run_findings(parity, _timing([0.005, 0.03, 0.01]))
    assert "every composed step is slower" in slow and "faster" not in slow
    assert "every composed step is faster" in fast
    assert "dp_tp beat the single process" in mixed and "pp_dp do not" in mixed
    assert "params 3.0e-06" in slow and "match" in slow


def test_the_exercise_never_shows_its_answer(capsys):
    ref_pp, ref_link = ch.exercise_reference()
    forms = {", ".join(map(str, ref_pp)), str(ref_pp), ref_link}
    ch.check_grid_exercise(None, None)
    out = capsys.readouterr().out
    assert "not attempted" in out.lower() and not any(f in out for f in forms)
    with pytest.raises(AssertionError) as e:
        ch.check_grid_exercise([1, 2, 3, 4], ref_link)
    assert not any(f in str(e.value) for f in forms - {ref_link})
    ch.check_grid_exercise(ref_pp, ref_link)
    assert "correct" in capsys.readouterr().out
    # the mesh section 1 draws is not the exercise's
    assert (ch.EXERCISE["gpus"], ch.EXERCISE["pp"]) != (32, 4)


@pytest.mark.parametrize("bad, match", [
    ({"emulate": "no-such-cluster"}, r"no-such-cluster"),
    ({"loop_meshes": [(4, 1, 1)]}, r"valid: \["),
    ({"my_prediction": "soon"}, r"my_prediction='soon' must be None or a number"),
    ({"tolerance": 1.5}, r"tolerance"),
])
def test_check_chapter_refuses_bad_loop_parameters(bad, match):
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(**{**OK, **bad})


def test_check_chapter_adapts_the_loop_to_world_size_and_turns_it_off():
    assert ch.check_chapter(**OK, emulate=None)["loop"] is None
    eight = ch.check_chapter(**{**OK, "world_size": 8})["loop"]
    assert eight["global_batch_size"] == 8 and all(dp * tp * pp == 8 for dp, tp, pp in eight["meshes"])
    assert "dp=1 tp=1 pp=4" in ch.loop_question(ch.check_chapter(**OK)["loop"])
