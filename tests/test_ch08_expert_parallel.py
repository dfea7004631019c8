"""Chapter 08's own functions: the parameter check, the emulated all-to-all vs ep and router skew and the
sentences written from it (each claim checked both ways), the recount table, the figures' labels."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit.chapters import ch08_expert_parallel as ch
from labkit.experiments.expert_emulated import moe_charge

BASE = dict(tokens_per_rank=64, hidden_size=16, ffn_hidden_size=32, n_experts=8, top_k=2, capacity_factor=1.25,
            capacity_factors=[0.5, 1.0], repeats=1, backend="gloo", emulate="dgx-h100", emulate_world_size=None,
            router_skews=[0.0, 3.0], my_prediction=None)


@pytest.mark.parametrize("world_size, eps", [(2, [2, 4, 8]), (4, [2, 4, 8]), (8, [2, 4, 8])])
def test_check_chapter_chooses_the_emulated_eps(world_size, eps):
    assert ch.check_chapter(world_size=world_size, **BASE) == {"emulate_world_size": 8, "eps": eps}
    assert ch.check_chapter(world_size=world_size, **(BASE | {"emulate": None}))["eps"] is None


@pytest.mark.parametrize("bad, match", [({"emulate_world_size": 12}, "world size|world_size"),
                                        ({"emulate_model": "llama-3-8b"}, "MoE|moe|experts"),
                                        ({"router_skews": [1.0, 2.0]}, "router_skews"),
                                        ({"router_skews": [0.0, 0.0]}, "router_skews"),
                                        ({"my_prediction": 2.0}, "my_prediction"),
                                        ({"my_prediction": "x"}, "my_prediction")])
def test_bad_parameters_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(world_size=4, **(BASE | bad))


def test_world_size_that_does_not_divide_the_experts_names_the_valid_ones():
    with pytest.raises(ValueError, match="2, 4, 8"):
        ch.check_chapter(world_size=3, **BASE)


def test_moe_charge_scales_rows_and_matmuls():
    c = moe_charge(model="mixtral-8x7b", tokens_per_rank=4096, lab_tokens_per_rank=256, lab_hidden_size=64,
                   lab_ffn_hidden_size=128)
    assert c.flops_factor == pytest.approx(16 * 4096 * 14336 / (64 * 128))
    assert c.comm["ep"] == (pytest.approx(16 * 64 * 0.5), 1.0) and c.default_dim == "ep"


def _table(a2a, steps=None, recv=None, label="emulated (dgx-h100)"):
    keys = [(2, 0.0), (2, 3.0), (8, 0.0), (8, 3.0)]
    steps = steps or [1.0] * 4
    recv = recv or [1.0, 1.5, 1.1, 3.9]
    return pd.DataFrame([{"ep": e, "skew": s, "a2a_ms": a, "step_ms": st, "busiest_recv_over_mean": r,
                          "predicted_a2a_ms": 0.1 * e, "label": label}
                         for (e, s), a, st, r in zip(keys, a2a, steps, recv)])


def test_a2a_findings_both_ways_on_given_numbers():
    slow = ch.a2a_findings(_table([0.3, 0.4, 0.6, 1.3], steps=[20, 28, 23, 75]))
    assert slow["skew_slower"] and "as long as with no skew" in slow["conclusion"]
    assert "rises from" in slow["conclusion"] and "every rank waits" in slow["conclusion"]
    same = ch.a2a_findings(_table([0.6, 0.6, 0.6, 0.61]))
    assert not same["skew_slower"] and "within 10 % of the time with no skew" in same["conclusion"]
    assert "stays within 10 %" in same["conclusion"] and "every rank waits" not in same["conclusion"]


@pytest.mark.slow
def test_emulated_run_flips_with_the_router_skew(assert_emulated_label):
    """The entry point the notebook calls, on 4 emulated ranks: a strongly skewed router makes the all-to-all
    slower than the untrained one; a tiny skew leaves it within 10 %. Deterministic (emulated)."""
    kw = dict(emulate="dgx-h100", eps=[2, 4], tokens_per_rank=64, hidden_size=16, ffn_hidden_size=32, n_experts=8,
              top_k=2, backend="gloo")
    strong = ch.run_emulated(4, router_skews=[0.0, 4.0], **kw)
    weak = ch.run_emulated(4, router_skews=[0.0, 0.01], **kw)
    assert strong["skew_slower"] and "as long as with no skew" in strong["conclusion"], strong["conclusion"]
    assert not weak["skew_slower"] and "within 10 % of the time with no skew" in weak["conclusion"], weak["conclusion"]
    assert_emulated_label(strong["label"], "emulated (dgx-h100, as mixtral-8x7b")
    fig = ch.a2a_figure(strong)
    names = {tr.name for tr in fig.data}
    assert "predicted (cost model, uniform router)" in names and len(names) == 2
    assert_emulated_label(next(n for n in names if n.startswith("emulated")), "emulated (dgx-h100, as mixtral-8x7b")
    assert {tr.legendgroup for tr in fig.data if tr.name.startswith("emulated")} == {"skew 0", "skew 4"}


def test_recount_table_and_dense_finding():
    rows = [{"placement": "even", "capacity_factor": 0.5, "n_local": 8, "expert": [[0, 1]] * 8,
             "global": {"dropped": 12}}, {"placement": "even", "capacity_factor": None, "n_local": 8,
                                          "expert": [[0, 1]] * 8, "global": {"dropped": 0}}]
    t = ch.recount_table(rows, n_experts=8, top_k=2)
    assert len(t) == 1 and t["dropped (recounted)"].iloc[0] == 14 and t["tokens per rank"].iloc[0] == [8]
    slow = pd.DataFrame({"model": ["dense-active", "moe"], "forward_ms_measured": [1.0, 2.0]})
    fast = pd.DataFrame({"model": ["dense-active", "moe"], "forward_ms_measured": [2.0, 1.0]})
    assert "slower" in ch.dense_vs_moe_finding(slow) and "faster" in ch.dense_vs_moe_finding(fast)


def test_the_label_check_refuses_another_profile_and_a_large_unpriced_share(assert_emulated_label):
    p = "emulated (dgx-h100, as mixtral-8x7b"
    assert_emulated_label(p + "; incomplete: 8% of rank 0's time unpriced)", p)
    for bad in ("emulated (dgx-a100, as mixtral-8x7b)", p + "; incomplete: 30% of rank 2's time unpriced)"):
        with pytest.raises(AssertionError):
            assert_emulated_label(bad, p)
