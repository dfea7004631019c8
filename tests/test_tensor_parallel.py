"""Tensor and sequence parallelism (labkit.parallel.tensor; formulas in labkit.theory.tensor, rank functions in
labkit.experiments.tensor, chapter glue in labkit.chapters.ch05_tensor_parallel): parity with the unsharded
model, counted collectives against theory, field cases, bad input, the DTensor variant, chapter 05 and the benchmark.

Multi-process tests run on gloo; one launch per tp degree checks everything (tp_check_rank).
Tolerance: fp32, labkit.models.TOLERANCES (rtol 1e-4, atol 1e-5); weights after AdamW steps get
atol + 0.1 * lr * steps (stated in the parity row).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.chapters import ch05_tensor_parallel as ch
from labkit.experiments import tensor as tpx
from labkit.theory import tensor as tpt
from labkit.theory.spec import get_spec

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------
# bad input: ValueError before any launch
# ------------------------------------------------------------------------------------------------------
def test_tp_not_dividing_heads_ffn_vocab():
    llama = get_spec("lab-tiny-llama")
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_heads=4; valid tp: 1, 2, 4"):
        tpt.check_tp(llama, 3)
    with pytest.raises(ValueError, match=r"tp=4 does not divide ffn_hidden_size=174; valid tp: 1, 2, 3, 6"):
        tpt.check_tp(llama.replace(ffn_hidden_size=174), 4)
    with pytest.raises(ValueError, match=r"tp=4 does not divide vocab_size=250; valid tp: 1, 2, 5.*"
                                         r"pad the vocabulary to 252 with pad_vocab=True"):
        tpt.check_tp(llama.replace(vocab_size=250), 4)
    plan = tpt.check_tp(llama.replace(vocab_size=250), 4, pad_vocab=True)
    assert plan["padded_vocab_size"] == 252 and plan["kv"] == "replicate"
    assert tpt.check_tp(llama, 2)["kv"] == "split"


def test_kv_heads_neither_split_nor_replicable():
    spec = get_spec("lab-tiny-llama").replace(n_heads=12, n_kv_heads=3, hidden_size=96, ffn_hidden_size=192)
    with pytest.raises(ValueError, match=r"tp=2 neither divides n_kv_heads=3.*valid tp: 1, 3, 6, 12"):
        tpt.check_tp(spec, 2)
    assert tpt.check_tp(spec, 6, pad_vocab=True)["kv"] == "replicate"


def test_other_refusals():
    llama = get_spec("lab-tiny-llama")
    with pytest.raises(ValueError, match="seq_len=15"):
        tpt.check_tp(llama, 2, sequence_parallel=True, seq_len=15)
    with pytest.raises(ValueError, match="dropout=0.1"):
        tpt.check_tp(llama.replace(dropout=0.1), 2)
    with pytest.raises(ValueError, match="DTensor variant.*n_kv_heads=2"):
        tpt.check_tp(llama, 4, dtensor=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        tpt.check_tp("lab-tiny-gpt", 2, dtensor=True)


def test_check_chapter_validates_and_decides_dtensor_variants():
    """Chapter 05's parameters are checked before any launch, and one function knows every DTensor limit:
    variants the model cannot run are skipped with the reason instead of failing inside the ranks (field
    case: model=lab-tiny-gpt, tied embeddings, raised RankFailed)."""
    with pytest.raises(ValueError, match=r"chapter 05 needs world_size >= 2, got world_size=1"):
        ch.check_chapter(world_size=1)
    with pytest.raises(ValueError, match=r"world_size=3 is the tp degree in chapter 05: tp=3 does not divide n_heads"):
        ch.check_chapter(world_size=3)
    with pytest.raises(ValueError, match=r"tp=2 does not divide seq_len=15"):
        ch.check_chapter(world_size=2, seq_len=15)
    with pytest.raises(ValueError, match=r"mixture-of-experts"):
        ch.check_chapter(world_size=2, model="lab-tiny-moe")
    with pytest.raises(ValueError, match=r"gelu_model='lab-tiny-llama' must be a GELU model with biases"):
        ch.check_chapter(world_size=2, gelu_model="lab-tiny-llama")
    with pytest.raises(ValueError, match=r"time_steps=0"):
        ch.check_chapter(world_size=2, time_steps=0)
    with pytest.raises(ValueError, match=r"time_seq_len=4096 exceeds"):
        ch.check_chapter(world_size=2, time_seq_len=4096)
    ok = ch.check_chapter(world_size=2)
    assert ok["dtensor_parity"] == (False, True) and "dtensor" in ok["time_variants"] and not ok["skipped"]
    gpt = ch.check_chapter(world_size=2, model="lab-tiny-gpt")
    assert gpt["dtensor_parity"] == () and "dtensor" not in gpt["time_variants"]
    assert set(gpt["skipped"]) == {"DTensor parity, TP", "DTensor parity, TP+SP", "DTensor step time"}
    assert all("tied embeddings" in why for why in gpt["skipped"].values())
    four = ch.check_chapter(world_size=4)  # 2 kv heads: DTensor cannot replicate them in the step-time model
    assert four["dtensor_parity"] == (False, True) and "dtensor" not in four["time_variants"]
    assert "n_kv_heads=2" in four["skipped"]["DTensor step time"]
    # the other limit check_chapter relies on: SP with learned positions (an untied GPT)
    with pytest.raises(ValueError, match="RoPE models only"):
        tpt.check_tp(get_spec("lab-tiny-gpt").replace(tied_embeddings=False), 2, sequence_parallel=True, dtensor=True)


def test_pad_vocab_size():
    assert tpt.pad_vocab_size(255, 2) == 256
    assert tpt.pad_vocab_size(256, 4) == 256
    assert tpt.pad_vocab_size(50257, 1, 128) == 50304  # GPT-2 vocab padded by Megatron-LM at tp=1
    assert tpt.pad_vocab_size(50257, 8, 128) == 51200
    with pytest.raises(ValueError):
        tpt.pad_vocab_size(0, 2)


# ------------------------------------------------------------------------------------------------------
# theory (pure)
# ------------------------------------------------------------------------------------------------------
def test_theory_per_layer_and_sp_bytes():
    s = 2 * 16 * 64 * 4
    rows = tpt.comm_theory_per_layer(2, 16, 64, 4)
    assert [(r["phase"], r["op"], r["calls"], r["nbytes"]) for r in rows] == [
        ("fwd", "all_reduce", 2, s), ("bwd", "all_reduce", 2, s)]
    ar = sum(r["bytes_per_rank"] for r in rows)
    sp = tpt.comm_theory_per_layer(2, 16, 64, 4, sequence_parallel=True, regather=False)
    assert sum(r["bytes_per_rank"] for r in sp) == pytest.approx(ar)  # same bytes on a ring
    sp_re = tpt.comm_theory_per_layer(2, 16, 64, 4, sequence_parallel=True, regather=True)
    extra = sum(r["bytes_per_rank"] for r in sp_re) - ar
    assert extra == pytest.approx(2 * s * 3 / 4)  # one all-gather per column region in the backward


def test_serving_counts_and_rules_come_from_the_one_theory():
    """labkit.theory.serving asks labkit.theory.tensor for its TP rule and its collective count (one copy each)."""
    from labkit.theory import serving as sv

    llama = get_spec("lab-tiny-llama")
    want = {"all_reduce": 2 * llama.n_layers + 1, "all_gather": 1}  # g per block + the embedding; logits gathered
    assert tpt.collectives_per_forward(llama, 2) == want == sv.collectives_per_forward(llama, 2)
    assert tpt.collectives_per_forward(llama, 2, gather_logits=False)["all_gather"] == 0
    assert tpt.collectives_per_forward(llama, 1) == {"all_reduce": 0, "all_gather": 0}
    fwd = [r for r in tpt.comm_theory_model(llama, 2, 16, 2) if r["phase"] == "fwd" and r["where"] != "loss"]
    assert sum(r["calls"] for r in fwd) == want["all_reduce"]  # the same rows the training step predicts
    assert tpt.check_tp(llama, 4)["kv"] == "replicate"  # training replicates the 2 kv heads ...
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_kv_heads=2; valid tp: 1, 2; model 'lab-tiny-llama'"):
        tpt.check_tp(llama, 4, kv_cache=True)  # ... a server splits its KV cache by them
    assert sv.check_tp(llama, 2) == tpt.check_tp(llama, 2, kv_cache=True)


def test_theory_mlp_pair():
    cr = tpt.comm_theory_mlp_pair("column-row", 32, 64, 176, 2)
    cc = tpt.comm_theory_mlp_pair("column-column", 32, 64, 176, 2)
    assert [r["op"] for r in cr if r["phase"] == "fwd"] == ["all_reduce"]
    fwd = [r for r in cc if r["phase"] == "fwd"]
    assert [(r["op"], r["calls"]) for r in fwd] == [("all_gather", 2)]  # the [T, F] activation, then the output
    assert fwd[0]["nbytes_list"] == [32 * 64 * 4, 32 * 176 * 4]


# ------------------------------------------------------------------------------------------------------
# one launch per tp degree: parity, counted collectives, field cases, activation bytes
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp2", "tp4"])
def checked(request):
    from labkit import launch

    res = launch(tpx.tp_check_rank, request.param, echo=False)
    return res[0]


def test_parity(checked):
    rows = checked["parity"]
    bad = [f"{r['check']} (tp={r['tp']}, sp={r['sp']}): {r['detail']}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)
    names = " ".join(r["check"] for r in rows)
    for must in ("column-parallel", "row-parallel", "GELU(tanh)", "SwiGLU", "attention GQA", "vocab-parallel loss",
                 "model lab-tiny-llama", "model lab-tiny-gpt", "padded", "DTensor", "AdamW"):
        assert must in names
    assert {r["sp"] for r in rows} == {False, True}
    assert all(r["rtol"] == 1e-4 for r in rows)
    kv = "replicate" if checked["tp"] == 4 else "split"
    assert f"kv {kv}" in names


def test_counted_collectives_equal_theory(checked):
    spec = get_spec(checked["spec"])
    for key, sp, regather in (("tp", False, True), ("sp", True, True), ("sp_no_regather", True, False)):
        theory = tpt.comm_theory_model(spec, checked["batch_size"], checked["seq_len"], checked["tp"],
                                      sequence_parallel=sp, regather=regather)
        table = tpx.comm_vs_theory(checked["comm"][key], theory)
        wrong = [r for r in table if not r["match"]]
        assert not wrong, f"{key}: {wrong}"
    # per layer: 2 all-reduces forward, 2 backward, each of B*T*H*4 bytes
    per_layer = [r for r in tpx.comm_table(checked["comm"]["tp"]) if r["where"].startswith("layer")]
    assert len(per_layer) == 2 * spec.n_layers
    s = checked["batch_size"] * checked["seq_len"] * spec.hidden_size * 4
    assert all(r["op"] == "all_reduce" and r["calls"] == 2 and r["nbytes"] == s for r in per_layer)
    # SP without the re-gather moves the same bytes per rank as TP in the layers
    def layer_bytes(key):
        return sum(r["bytes_per_rank"] for r in tpx.comm_table(checked["comm"][key]) if r["where"].startswith("layer"))
    assert layer_bytes("sp_no_regather") == pytest.approx(layer_bytes("tp"))
    assert layer_bytes("sp") > layer_bytes("tp")


def test_socket_bytes_measured_beside_the_ring_model(checked):
    """One training step per variant: the logged calls' ring model equals the prediction, and what gloo wrote
    to its sockets is measured beside it, in its own column. It is not the ring model: for SP, gloo's
    reduce-scatter runs a whole all-reduce, and every message carries a header (TP's messages are small)."""
    import math

    from labkit.runtime.probes import socket_bytes_written

    rows = {r["variant"]: r for r in ch.step_bytes_table(checked)}
    assert set(rows) == {"TP", "TP+SP", "TP+SP (no re-gather)"}
    for v, r in rows.items():
        assert r["ring bytes (model: S x factor)"] == pytest.approx(r["ring bytes (predicted: comm_theory_model)"]), v
    assert rows["TP+SP"]["gloo model"] > rows["TP+SP"]["ring bytes (model: S x factor)"]
    table = tpx.comm_vs_theory(checked["comm"]["tp"], [])
    assert "bytes_per_rank_model" in table[0] and "bytes_per_rank_measured" not in table[0]
    if socket_bytes_written() is None:
        assert all(math.isnan(r["socket bytes written (measured: gloo)"]) for r in rows.values())
        return
    for v, r in rows.items():
        assert 1.0 <= r["measured / gloo model"] <= 1.3, (v, r)


def test_column_column_needs_extra_all_gather(checked):
    spec = get_spec(checked["spec"])
    recs = checked["comm_pair"]
    assert all(r["parity_ok"] for r in recs)
    tokens = checked["batch_size"] * checked["seq_len"]
    for kind in ("column-row", "column-column"):
        theory = tpt.comm_theory_mlp_pair(kind, tokens, spec.hidden_size, spec.ffn_hidden_size, checked["tp"])
        table = tpx.comm_vs_theory([r for r in recs if r["tag"].startswith(kind)], theory)
        assert all(r["match"] for r in table), table
    fwd_gathers = [r for r in recs if r["tag"] == "column-column/fwd" and r["op"] == "all_gather"]
    assert len(fwd_gathers) == 2
    assert not [r for r in recs if r["tag"] == "column-row/fwd" and r["op"] == "all_gather"]


def test_field_cases_caught(checked):
    by = {r["case"]: r for r in checked["field"]}
    assert all(r["caught"] for r in checked["field"]), checked["field"]
    bias = by["MLP: row bias added on every rank before the all-reduce"]
    assert bias["value"] > 1e-2 and bias["ours"] < 1e-5
    init = by["initialisation per shard (every rank seeds its own shard)"]
    assert init["value"] > 1e-2 and init["ours"] == 0.0
    assert init["ours_by_layer"] == {"column": 0.0, "row": 0.0, "vocab embedding": 0.0}
    head = by["row-parallel output layer -> vocab-parallel loss"]
    # whole logits on every rank: the shape-trusting loss silently adds ln(tp)
    assert head["value"] == pytest.approx(__import__("math").log(checked["tp"]), rel=1e-4)
    assert "row-parallel" in head["ours"] and "row-parallel" in head["ours_untagged"]


def test_init_field_case_fails_when_a_layer_seeds_its_own_shard():
    """The "initialisation per shard" row is computed, not assumed: with ColumnParallelLinear patched (inside the
    ranks) to draw each shard from the seed on its own — the field bug — the row is no longer caught, so chapter
    05's ``assert field.caught.all()`` fails. (Before, ``caught`` was the constant True and "ours" was compared
    with the helper the layer itself initialises from.)"""
    from labkit import launch

    def rank(ctx):
        import torch

        from labkit.experiments import tensor as tpx
        from labkit.parallel.tensor import layers
        from labkit.theory.spec import get_spec

        init = layers.ColumnParallelLinear.__init__

        def per_shard(self, *args, seed=0, std=0.02, **kwargs):
            init(self, *args, seed=seed, std=std, **kwargs)
            g = torch.Generator().manual_seed(seed)  # the bug: every rank draws its own shard, same seed
            with torch.no_grad():
                self.weight.copy_(torch.randn(self.weight.shape, generator=g) * std)

        honest = tpx._field_cases(ctx, get_spec("lab-tiny-gpt"), 2, 16, 0)
        layers.ColumnParallelLinear.__init__ = per_shard
        patched = tpx._field_cases(ctx, get_spec("lab-tiny-gpt"), 2, 16, 0)
        case = "initialisation per shard (every rank seeds its own shard)"
        return [next(r for r in rows if r["case"] == case) for rows in (honest, patched)]

    honest, patched = launch(rank, 2, echo=False)[0]
    assert honest["caught"] and honest["ours"] == 0.0
    assert not patched["caught"] and patched["ours_by_layer"]["column"] > 1e-3, patched
    assert patched["ours_by_layer"]["row"] == 0.0 and patched["ours_by_layer"]["vocab embedding"] == 0.0


def test_sequence_parallel_activation_memory(checked):
    a = {r["variant"]: r["bytes"] for r in checked["activations"]}
    n = checked["tp"]
    full = a["tp=1 (unsharded)"]
    # Korthikanti et al. 2022, Table 2: with TP+SP every activation is stored 1/tp per rank
    assert a["TP+SP"] == pytest.approx(full / n, rel=0.1)
    assert a["TP+SP"] < a["TP+SP, no re-gather"] < a["TP"] < full
    # per layer, labkit.theory.memory's item-by-item prediction (exact at tp=2; at tp=4 one head per rank makes the
    # wo input a view of the attention output, which labkit.theory.memory counts as a copy: 2.5 % here)
    # Every variant has a prediction, "TP+SP, no re-gather" included (it stores the gathered linear inputs).
    rows = ch.activation_vs_theory(checked["activations"], checked["spec"], checked["batch_size"], checked["seq_len"])
    assert {r["variant"] for r in rows} == {"tp=1 (unsharded)", "TP", "TP+SP", "TP+SP, no re-gather"}
    for r in rows:
        assert r["per_layer_predicted"] is not None and r["total_predicted"] is not None, r
        assert r["per_layer_measured"] == pytest.approx(r["per_layer_predicted"], rel=0.05), r
        assert r["total_measured"] == pytest.approx(r["total_predicted"], rel=0.05), r
        if n == 2:
            assert r["per_layer_measured"] == r["per_layer_predicted"], r


# ------------------------------------------------------------------------------------------------------
# layout check without a launch (world of one)
# ------------------------------------------------------------------------------------------------------
def test_layout_check_single_rank():
    from labkit import launch

    def fn(ctx):
        import torch

        from labkit.parallel import tensor as t

        logits = torch.randn(4, 8, requires_grad=True)
        targets = torch.randint(8, (4,))
        ok = t.vocab_parallel_cross_entropy(logits, targets, 8)
        ref = torch.nn.functional.cross_entropy(logits, targets)
        errors = []
        for bad in (t.reduce_from_tp_region(logits), logits[:, :6]):
            try:
                t.vocab_parallel_cross_entropy(bad, targets, 8)
            except ValueError as e:
                errors.append(str(e))
        return float(ok), float(ref), errors

    ok, ref, errors = launch(fn, 1, echo=False)[0]
    assert ok == pytest.approx(ref, rel=1e-6)
    assert "layout 'replicate'" in errors[0] and "6 vocabulary columns" in errors[1]


# ------------------------------------------------------------------------------------------------------
# chapter 05 and the benchmark
# ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chapter_05_runs_with_world_size_4(tmp_path):
    # tests/test_notebooks.py executes every chapter with its defaults (world_size=2); this is the tp=4 run
    from labkit import notebooks

    path = ROOT / "notebooks" / "05_tensor_parallel.ipynb"
    row = notebooks.run_notebook(path, tmp_path / path.name, {"world_size": 4}, cell_timeout_s=300)
    assert row["status"] == "ok", f"{row['error']} (executed copy: {row['output']})"


@pytest.mark.slow
def test_benchmark_prints_ratio_last():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_vs_dtensor.py"), "--model", "lab-tiny-llama",
                          "--seq-len", "32", "--steps", "2", "--warmup", "1"], capture_output=True, text=True,
                         env=env, timeout=300)
    # exit 0 when the goal is met, 1 when it is missed (a timing on a shared machine): either way, ratio last
    assert out.returncode in (0, 1), out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("hand/DTensor step-time ratio") and float(last.split("= ")[1].split()[0]) > 0
    assert (out.returncode == 1) == last.endswith("NOT met") and "spread" in last


def test_benchmark_exits_nonzero_when_the_goal_is_missed(monkeypatch, capsys):
    import importlib.util

    import labkit

    spec = importlib.util.spec_from_file_location("bench_tp", ROOT / "benchmarks" / "tp_vs_dtensor.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Fake(list):
        backend = "gloo"

    def fake(hand, dtensor):
        return lambda *a, **k: Fake([{"threads": 1, "step_s": {"hand": hand, "dtensor": dtensor},
                                      "losses": {"hand": [1.0, 0.9], "dtensor": [1.0, 0.9]}}])

    monkeypatch.setattr(labkit, "launch", fake([0.12, 0.10, 0.11], [0.10, 0.10, 0.10]))
    assert bench.main(["--steps", "3"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "= 1.100" in last and "1.000 to 1.200" in last and last.endswith("NOT met")
    monkeypatch.setattr(labkit, "launch", fake([0.09, 0.10, 0.095], [0.10, 0.10, 0.10]))
    assert bench.main(["--steps", "3"]) == 0


def test_step_time_findings_follow_the_numbers():
    # the tester's CPU run: hand TP 3x slower than tp=1 -> no "about as much" claim
    slow = ch.step_time_findings({"tp1": [0.010, 0.011, 0.012], "hand": [0.030, 0.031, 0.032]}, 2)
    assert "hand 31.0 ms (0.35x)" in slow and "cost more than the arithmetic it split" in slow
    assert "faster" not in slow and "about as fast" not in slow
    fast = ch.step_time_findings({"tp1": [0.020], "hand": [0.010], "hand_sp": [0.0195]}, 2)
    assert "hand ran faster than one rank" in fast and "hand_sp ran about as fast" in fast
    assert "slower" not in fast
    with pytest.raises(ValueError, match="expected a 'tp1' entry"):
        ch.step_time_findings({"hand": [0.1]}, 2)
    with pytest.raises(ValueError, match=r"no measured steps for \['hand'\]"):
        ch.step_time_findings({"tp1": [0.1], "hand": []}, 2)
