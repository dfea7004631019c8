"""Scaling: the arithmetic of speedup and efficiency checked by hand (strong and weak, baseline named), MFU,
reference files, bad input before any launch, and one real series (1 and 2 ranks, two experiments)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from labkit.chapters import ch11_scaling as ch
from labkit.experiments import scaling
from labkit.models import flops_per_token
from labkit.theory import scaling as theory
from labkit.theory.spec import get_spec


def _frame(mode, times, sizes=(1, 2, 4), work=8, threads=1, cores=2):
    rows = []
    for n, t in zip(sizes, times):
        per = work // n if mode == "strong" else work
        rows.append({"experiment": "x", "mode": mode, "world_size": n, "work_per_rank": per, "total_work": per * n,
                     "time_s": t, "time_min_s": t, "time_max_s": t, "threads_per_rank": threads, "cores": cores})
    return pd.DataFrame(rows)


def test_strong_and_weak_efficiency_by_hand():
    df = scaling.efficiency(pd.concat([_frame("strong", [1.0, 0.625, 0.5]), _frame("weak", [1.0, 1.25, 2.0])]))
    s = df[df["mode"] == "strong"].set_index("world_size")
    assert list(s["speedup"]) == pytest.approx([1.0, 1.6, 2.0])  # T(1)/T(n)
    assert list(s["efficiency"]) == pytest.approx([1.0, 0.8, 0.5])
    assert list(s["ideal_speedup"]) == [1, 2, 4] and list(s["ideal_speedup_on_cores"]) == [1, 2, 2]
    assert s.loc[4, "speedup_formula"] == "T(1)=1.0000s / T(4)=0.5000s"
    assert s.loc[4, "efficiency_formula"] == "2.00 / (4/1)"
    w = df[df["mode"] == "weak"].set_index("world_size")
    assert list(w["speedup"]) == pytest.approx([1.0, 1.6, 2.0])  # (n/1) T(1)/T(n)
    assert list(w["efficiency"]) == pytest.approx([1.0, 0.8, 0.5])  # T(1)/T(n)
    assert w.loc[2, "speedup_formula"] == "(2/1) x T(1)=1.0000s / T(2)=1.2500s"
    assert (df["baseline_world_size"] == 1).all() and (df["baseline_time_s"] == 1.0).all()
    # another baseline
    b = scaling.efficiency(_frame("strong", [1.0, 0.625, 0.5]), baseline_world_size=2).set_index("world_size")
    assert b.loc[4, "speedup"] == pytest.approx(1.25) and b.loc[4, "efficiency"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match=r"baseline_world_size=3 is not in the strong series; valid: 1, 2, 4"):
        scaling.efficiency(_frame("strong", [1.0, 0.625, 0.5]), baseline_world_size=3)
    text = ch.format_table(df)
    assert "T(1)=1.0000s / T(4)=0.5000s" in text and "baseline_world_size" in text


def test_mfu_and_cases():
    df = scaling.with_mfu(_frame("strong", [2.0, 1.0], sizes=(1, 2)).assign(flops=[4e9, 4e9]), 1e10)
    assert list(df["achieved_flops"]) == [2e9, 4e9] and list(df["mfu"]) == pytest.approx([0.2, 0.4])
    assert (df["mfu_denominator_flops"] == 1e10).all()
    with pytest.raises(ValueError, match="no 'flops' column"):
        scaling.with_mfu(_frame("strong", [1.0]), 1e10)
    assert theory.cases_for(4, strong_total=8, weak_per_rank=3) == [
        {"mode": "strong", "work_per_rank": 2, "total_work": 8},
        {"mode": "weak", "work_per_rank": 3, "total_work": 12}]
    with pytest.raises(ValueError, match=r"world_size=3 does not divide strong_total=8; valid world_size: 1, 2, 4, 8"):
        theory.cases_for(3, strong_total=8)
    with pytest.raises(ValueError, match="give strong_total"):
        theory.cases_for(2)


def test_predict_train_sanity_by_hand_and_pure():
    """Sanity checks of the arithmetic (the formula's own numbers recombined, not evidence that it is right: that is
    test_flops_per_token_against_torchs_flop_counter)."""
    spec = get_spec("lab-tiny-llama")
    rows = theory.predict_train("lab-tiny-llama", (1, 4), seq_len=16, strong_total=8, weak_per_rank=2,
                                peak_flops_per_rank=1e9, cores=2)
    by = {(r["mode"], r["world_size"]): r for r in rows}
    fpt = flops_per_token(spec, 16, training=True)
    assert by[("strong", 4)]["tokens"] == 8 * 16 and by[("weak", 4)]["tokens"] == 2 * 4 * 16
    assert by[("strong", 4)]["flops"] == pytest.approx(8 * 16 * fpt)
    assert by[("strong", 4)]["flops_dense"] + by[("strong", 4)]["flops_attention"] == pytest.approx(8 * 16 * fpt)
    # 4 ranks on 2 cores take turns: a rank's 2 sequences at peak, stretched 2x
    assert by[("strong", 4)]["compute_s_at_peak"] == pytest.approx(2 * 16 * fpt / 1e9 * 2)
    assert by[("strong", 1)]["allreduce_bytes_per_rank"] == 0
    assert by[("weak", 4)]["allreduce_bytes_per_rank"] == int(2 * 3 / 4 * spec.n_params() * 4)
    assert {r["source"] for r in rows} == {"predicted"}
    with pytest.raises(ValueError, match="world_size=3 does not divide strong_total=8"):
        theory.predict_train(world_sizes=(3,), strong_total=8, peak_flops_per_rank=1e9, cores=2)


@pytest.mark.parametrize("name", ["lab-tiny-llama", "lab-tiny-gpt", "lab-tiny-moe"])
def test_flops_per_token_against_torchs_flop_counter(name):
    """The formula (PaLM Appendix B: 6N + 12·L·heads·head_dim·T per token, training) against something that does
    not use it: torch's FlopCounterMode counting the ops of one forward + backward of the lab's model (2·M·N·K per
    matmul, from the shapes that ran). With eager attention the counter sees the attention matmuls (bmm): they equal
    the formula's attention term exactly (full T x T, causal masking not subtracted, as PaLM). The weight matmuls
    come within 2 % under 6N·tokens: N also holds the norm weights and the biases (GPT), parameters that are no
    matmul (lab-tiny-llama: 576 of 201,280, 0.3 %; lab-tiny-gpt: 1.6 %). With sdpa (what the runs use) CPU's
    fused kernel is not counted at all: only the weight matmuls are."""
    import torch

    from labkit.models import SyntheticLM, build_model, lm_loss
    from labkit.theory.spec import flops_per_token_terms

    spec, seq, batch = get_spec(name), 24, 2
    tokens, targets = SyntheticLM(spec.vocab_size, seq, 0).batch(0, batch)
    terms = {k: v * batch * seq for k, v in flops_per_token_terms(spec, seq, training=True).items()}
    counts = {}
    for attention in ("eager", "sdpa"):
        torch.manual_seed(0)
        net = build_model(spec, seed=0, attention=attention)
        counts[attention] = scaling.count_flops(lambda net=net: lm_loss(net(tokens), targets).backward())
    eager, sdpa = counts["eager"], counts["sdpa"]
    assert eager["flops_counted_attention"] == pytest.approx(terms["attention"], rel=1e-12)
    assert 0.98 <= eager["flops_counted_matmul"] / terms["dense"] <= 1.0, (eager, terms)
    assert eager["flops_counted"] / (terms["dense"] + terms["attention"]) == pytest.approx(1.0, abs=0.02)
    assert sdpa["flops_counted_attention"] == 0.0 and sdpa["flops_counted_matmul"] == eager["flops_counted_matmul"]
    # a formula off by a term would not pass: without the attention term, or with 4N instead of 6N
    assert abs(eager["flops_counted"] / terms["dense"] - 1) > 0.02
    assert eager["flops_counted_matmul"] / (terms["dense"] * 4 / 6) > 1.4


def test_bad_input_before_any_launch():
    with pytest.raises(ValueError, match=r"experiment='nope' is not valid; choose one of: matmul, train"):
        scaling.run("nope", (1,), strong_total=2)
    with pytest.raises(ValueError, match=r"world_size=3 does not divide strong_total=4"):
        scaling.run("matmul", (1, 3), strong_total=4)
    with pytest.raises(ValueError, match="world_sizes is empty"):
        scaling.run("matmul", (), strong_total=4)
    with pytest.raises(ValueError, match=r"world_size=0 must be an integer >= 1"):
        scaling.run("matmul", (0,), strong_total=4)
    with pytest.raises(ValueError, match="in the experiments dict"):
        scaling.run({"matmul": {}}, (1,), strong_total=4, size=8)


def test_reference_absent_roundtrip_and_bad_format(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "reference_dir", lambda: tmp_path / "none")
    empty = scaling.load_reference()
    assert empty.empty and "no recorded GPU scaling series" in empty.attrs["status"]
    df = scaling.efficiency(_frame("strong", [1.0, 0.6], sizes=(8, 16), work=32).assign(backend="nccl", repeats=3))
    path = scaling.write_reference(df, {"gpus": ["NVIDIA H100 80GB HBM3"] * 8}, tmp_path / "ref.json")
    back = scaling.load_reference(path)
    assert list(back["speedup"]) == pytest.approx([1.0, 1 / 0.6]) and set(back["gpu"]) == {"NVIDIA H100 80GB HBM3"}
    assert "recorded elsewhere" in back.attrs["status"]
    # rows that must not become GPU reference numbers: nothing is written (before, anything was)
    for wrong, match in ((df.assign(backend="gloo"), "backend 'gloo', not nccl"),
                         (df.assign(time_s=[1.0, float("nan")]), "time_s=nan outside")):
        with pytest.raises(ValueError, match=match):
            scaling.write_reference(wrong, {"gpus": []}, tmp_path / "refused.json")
        assert not (tmp_path / "refused.json").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other", "rows": []}))
    with pytest.raises(ValueError, match="expected 'labkit.scaling/v1'"):
        scaling.load_reference(bad)


def test_real_series_one_and_two_ranks():
    """Two launches (1 and 2 ranks), two experiments each: counts add up, strong keeps the total, weak grows
    it, every step is on the timeline of every rank, and the baseline's speedup is 1."""
    seq = 16
    df = scaling.run({"train": {"seq_len": seq}, "matmul": {"size": 32}}, (1, 2), strong_total=4, weak_per_rank=2,
                     repeats=2, threads_per_rank=1, backend="gloo", timeout_s=180)
    assert len(df) == 2 * 2 * 2  # experiments x modes x world sizes
    train = df[df["experiment"] == "train"].set_index(["mode", "world_size"])
    assert train.loc[("strong", 1), "tokens"] == train.loc[("strong", 2), "tokens"] == 4 * seq
    assert train.loc[("weak", 2), "tokens"] == 2 * train.loc[("weak", 1), "tokens"] == 4 * seq
    # sanity (the experiment's formula count recombined, not evidence): flops = tokens x flops_per_token
    per_token = train.loc[("strong", 2), "flops"] / (4 * seq)
    assert per_token == pytest.approx(flops_per_token(get_spec("lab-tiny-llama"), seq, training=True))
    # independent: torch's FlopCounterMode on the real step (sdpa: only the weight matmuls are counted on CPU)
    from labkit.theory.spec import flops_per_token_terms

    dense = flops_per_token_terms(get_spec("lab-tiny-llama"), seq)["dense"]
    for key in train.index:
        row = train.loc[key]
        assert 0.98 <= row["flops_counted_matmul"] / (row["tokens"] * dense) <= 1.0, (key, row["flops_counted_matmul"])
        assert row["flops_counted_attention"] == 0.0
    mm = df[df["experiment"] == "matmul"].set_index(["mode", "world_size"])
    assert mm.loc[("strong", 2), "matmuls"] == 4 and mm.loc[("weak", 2), "matmuls"] == 4
    assert (mm["flops_counted"] == 2 * 32**3 * mm["matmuls"]).all()  # the counter's 2·M·N·K, by hand
    assert (df["time_s"] > 0).all() and (df["time_min_s"] <= df["time_s"]).all()
    # sanity (true by definition): the one-rank baseline's speedup is 1
    assert (df.loc[df["world_size"] == 1, "speedup"] == 1.0).all() and (df["threads_per_rank"] == 1).all()
    tl = df.attrs["timelines"][2]
    assert set(tl["rank"]) == {0, 1}
    assert tl.groupby("rank").size().tolist() == [2 * 2 * 2] * 2  # experiments x modes x repeats per rank


def test_measured_peak_gives_an_mfu_denominator_no_rank_can_beat():
    peak = scaling.measure_peak(n=128, repeats=2, tries=1)
    assert peak["flops_1_thread"] > 0 and peak["flops_all_cores"] > 0
    # the denominator is the larger of the two bases, and says which it is
    assert peak["flops_machine"] == max(peak["flops_all_cores"], peak["cores"] * peak["flops_1_thread"])
    assert ("together" in peak["machine_basis"]) == (peak["flops_machine"] == peak["flops_all_cores"])
    assert peak["tries_1_thread"] == [peak["flops_1_thread"]] and peak["spread_1_thread"] == 1.0
    # measured again after a series: the best of both, every try kept, the spread over all of them
    again = scaling.measure_peak(n=128, repeats=2, tries=2, previous=peak)
    assert len(again["tries_1_thread"]) == 3 and again["tries_1_thread"][0] == peak["flops_1_thread"]
    assert again["flops_1_thread"] == max(again["tries_1_thread"]) >= peak["flops_1_thread"]
    assert again["flops_all_cores"] >= peak["flops_all_cores"]
    assert again["spread_1_thread"] == max(again["tries_1_thread"]) / min(again["tries_1_thread"]) >= 1.0
    with pytest.raises(ValueError, match="tries=0"):
        scaling.measure_peak(tries=0)


@pytest.mark.parametrize("bad, match", [
    ({"world_size": 1}, r"chapter 11 needs world_size >= 2"),
    ({"world_size": 3}, r"strong_total=8 must split evenly over every world size of the series \[1, 2, 3\].*use 6"),
    ({"strong_total": 6}, r"strong_total=6 must split evenly over every world size of the series \[1, 2, 4\]"),
    ({"repeats": 0}, r"repeats=0"),
    ({"matmul_size": 0}, r"matmul_size=0"),
    ({"seq_len": 10_000}, r"max_seq_len"),
    ({"model": "nope"}, r"unknown model"),
])
def test_chapter_11_refuses_bad_parameters_before_any_launch(bad, match):
    ok = dict(world_size=4, model="lab-tiny-llama", seq_len=32, strong_total=8, weak_per_rank=4, matmul_size=512,
              repeats=5, threads_per_rank=1, backend="auto")
    assert ch.check_chapter(**ok)["sizes"] == [1, 2, 4]
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(**{**ok, **bad})
