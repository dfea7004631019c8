"""Chapter 07's own functions: parameters chosen from world_size, the emulated naive-vs-zigzag run and the
sentences written from its numbers (each claim checked both ways), the headline figure's labels."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch07_context_parallel as ch
from labkit.theory import context as cpt

BASE = dict(head_dim=32, batch=1, repeats=1, backend="gloo", emulate="dgx-h100", emulate_world_size=None,
            emulate_model="llama-3-8b", emulate_seq_len=8192, my_prediction=None)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_sizes_adapt_to_world_size(world_size):
    run = ch.check_chapter(world_size=world_size, seq_len=None, n_heads=None, **BASE)
    shape, ecp = run["shape"], run["emulate_world_size"]
    assert ecp == max(8, world_size)
    assert shape["n_heads"] % world_size == 0 and shape["n_heads"] >= 4
    assert shape["seq_len"] % (2 * world_size) == 0 and shape["seq_len"] % (2 * ecp) == 0
    assert shape["seq_len"] >= 1024


def test_emulate_none_skips_the_emulated_run(capsys):
    run = ch.check_chapter(world_size=2, seq_len=None, n_heads=None, **(BASE | {"emulate": None}))
    assert run["emulate_world_size"] is None and run["shape"]["seq_len"] == 1024
    assert ch.run_emulated(None, emulate=None, **run["shape"]) is None
    assert "emulate=None" in capsys.readouterr().out


@pytest.mark.parametrize("bad, match", [({"emulate_world_size": 12}, "world size|world_size"),
                                        ({"emulate": "no-such-cluster"}, "dgx-h100"),
                                        ({"emulate_model": "no-such-model"}, "no-such-model"),
                                        ({"emulate_seq_len": 10 ** 7}, "seq_len"),
                                        ({"my_prediction": "1.5"}, "my_prediction"),
                                        ({"emulate_world_size": 1}, "emulate_world_size")])
def test_bad_emulation_parameters_are_refused_before_any_launch(bad, match):
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(world_size=4, seq_len=None, n_heads=None, **(BASE | bad))


def test_predicted_step_ratio():
    assert ch.predicted_step_ratio(8) == pytest.approx(4 * 8 / 17)
    assert ch.predicted_step_ratio(8, causal=False) == pytest.approx(1.0)


def _table(naive, zigzag, window_naive, window_zigzag, label="emulated (dgx-h100)"):
    rows = [{"config": 0, "method": "ring", "load_balance": False, "cp": len(naive), "rank": r, "compute_ms": c,
             "window_ms": window_naive, "label": label} for r, c in enumerate(naive)]
    rows += [{"config": 1, "method": "ring", "load_balance": True, "cp": len(zigzag), "rank": r, "compute_ms": c,
              "window_ms": window_zigzag, "label": label} for r, c in enumerate(zigzag)]
    return pd.DataFrame(rows)


def test_emulated_findings_both_ways_on_given_numbers():
    yes = ch.emulated_findings(_table([1, 2, 3, 4], [2.5] * 4, 4.2, 2.7))
    assert yes["zigzag_faster"] and "Zigzag removes the imbalance" in yes["conclusion"]
    no = ch.emulated_findings(_table([1, 2, 3, 4], [2.5] * 4, 9.0, 9.1))
    assert not no["zigzag_faster"] and "no imbalance for zigzag to remove" in no["conclusion"]


@pytest.mark.slow
def test_emulated_run_flips_with_the_charged_model():
    """The entry point the notebook calls, at cp = 4: charged as llama-3-8b's attention layer the compute
    dominates and zigzag shortens the step; at the lab's own sizes the ring's per-step latency dominates and
    the sentence says there is nothing to remove. Deterministic (emulated)."""
    shape = dict(batch=1, n_heads=4, seq_len=512, head_dim=32)
    big = ch.run_emulated(4, emulate="dgx-h100", model="llama-3-8b", backend="gloo", **shape)
    small = ch.run_emulated(4, emulate="dgx-h100", model=None, backend="gloo", **shape)
    assert big["zigzag_faster"] and "Zigzag removes the imbalance" in big["conclusion"], big["conclusion"]
    assert not small["zigzag_faster"] and "no imbalance" in small["conclusion"], small["conclusion"]
    assert big["last_over_first"] > 3 and small["last_over_first"] > 3  # the compute imbalance is there either way
    assert big["label"] == "emulated (dgx-h100, as llama-3-8b)" and small["label"] == "emulated (dgx-h100)"


def test_diagonal_finding_both_ways():
    dearer = ch.diagonal_finding({"diagonal_over_full": 1.9, "diagonal_ms": 1.9, "full_ms": 1.0}, 4)
    cheaper = ch.diagonal_finding({"diagonal_over_full": 0.6, "diagonal_ms": 0.6, "full_ms": 1.0}, 4)
    same = ch.diagonal_finding({"diagonal_over_full": 1.01, "diagonal_ms": 1.01, "full_ms": 1.0}, 4)
    assert "pulls the ratio toward 1" in dearer and "pushes the ratio above the count" in cheaper
    assert "the count stands" in same


def test_bytes_finding_ring_rises_ulysses_falls():
    pred = pd.DataFrame(cpt.predicted_table([1, 2, 4, 8], batch=1, n_heads=8, seq_len=1024, head_dim=32))
    text = ch.bytes_finding(pred)
    assert "ring: rises" in text and "ulysses: falls" in text
    flat = pd.DataFrame({"method": ["ring", "ring"], "cp": [2, 4], "sent_bytes": [1e6, 1.01e6]})
    assert "ring: stays flat" in ch.bytes_finding(flat)
    assert "no trend" in ch.bytes_finding(flat.iloc[:1])


def test_imbalance_figure_labels():
    t = pd.DataFrame([{"method": "ring", "load_balance": lb, "cp": 2, "rank": r, "compute_share": s}
                      for lb in (False, True) for r, s in enumerate([0.6, 1.4] if not lb else [1.0, 1.0])])
    emu = ch.emulated_findings(_table([1, 2, 3, 4], [2.5] * 4, 4.2, 2.7))
    names = {tr.name for tr in ch.imbalance_figure(t, emu).data}
    assert names == {"measured", "emulated (dgx-h100)", "predicted (blocks: r+1 naive, (2cp+1)/4 zigzag)"}
    assert {tr.name for tr in ch.imbalance_figure(t, None).data} == names - {"emulated (dgx-h100)"}


def test_zigzag_plan_has_every_rank_and_step():
    plan = ch.zigzag_plan(4)
    assert plan.shape == (4, 4) and all(":" in cell for cell in plan.iloc[0])


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_parity_shape_divides(world_size):
    n_heads = ch.check_chapter(world_size=world_size, seq_len=None, n_heads=None, **BASE)["shape"]["n_heads"]
    s = ch.parity_shape(world_size, n_heads)
    assert s["seq_len"] % (2 * world_size) == 0 and s["seq_len"] >= 32 and s["n_heads"] % world_size == 0
