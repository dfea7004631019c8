"""Serving: the KV-cache decode loop against the full forward pass, the engine's bookkeeping (KV bytes measured
vs the calculator, cancel storm), the analytic deployment model by hand, and one launch on 2 ranks that checks
replicas vs TP parity and the failure tests (lost rank with replicas and with TP)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from labkit.chapters import ch10_serving as ch
from labkit.experiments import serving as sx
from labkit.models import TOLERANCES, build_model
from labkit.parallel import serving as ps
from labkit.theory import memory as mem
from labkit.theory import serving as st
from labkit.theory.spec import get_spec

TOL = TOLERANCES[torch.float32]


@pytest.mark.parametrize("name", ["lab-tiny-llama", "lab-tiny-gpt"])
def test_cached_prefill_and_batched_decode_equal_full_forward(name):
    torch.set_num_threads(1)
    model = build_model(name).eval()
    v = model.spec.vocab_size
    a, b = ps.prompt_tokens(1, 24, v), ps.prompt_tokens(2, 24, v)
    with torch.inference_mode():
        ref_a, ref_b = model(a[None])[0], model(b[None])[0]
    eng = ps.Engine(model)
    ca, cb = eng.alloc(24), eng.alloc(24)
    torch.testing.assert_close(ps.prefill(model, a[:10], ca), ref_a[9], **TOL)
    torch.testing.assert_close(ps.prefill(model, b[:15], cb), ref_b[14], **TOL)
    # two sequences at different positions in one decode step, then a few more steps
    for k in range(4):
        pa, pb = 10 + k, 15 + k
        out = ps.decode(model, torch.stack([a[pa], b[pb]]), torch.tensor([pa, pb]), [ca, cb])
        torch.testing.assert_close(out[0], ref_a[pa], **TOL)
        torch.testing.assert_close(out[1], ref_b[pb], **TOL)
    assert eng.live_kv_bytes() == 2 * mem.kv_cache_bytes(model.spec, 24, "fp32")
    del ca, cb
    assert eng.live_kv_bytes() == 0


def _greedy_reference(model, rid, prompt_len, n_new):
    toks = ps.prompt_tokens(rid, prompt_len, model.spec.vocab_size)
    out = []
    with torch.inference_mode():
        for _ in range(n_new):
            nxt = int(model(toks[None])[0, -1].argmax())
            out.append(nxt)
            toks = torch.cat([toks, torch.tensor([nxt])])
    return out


def test_engine_serves_greedy_tokens_and_kv_bytes_match_calculator():
    torch.set_num_threads(1)
    model = build_model("lab-tiny-llama")
    eng = ps.Engine(model)
    reqs = sx.make_workload(6, short_prompt=8, long_prompt=40, long_every=3, output_len=5)
    assert [r["kind"] for r in reqs] == ["long", "short", "short", "long", "short", "short"]
    out = eng.serve(reqs, concurrency=3)
    recs = {r["rid"]: r for r in out["records"]}
    assert sorted(recs) == list(range(6)) and all(r["status"] == "ok" for r in recs.values())
    assert all(r["new_tokens"] == 5 and r["ttft_s"] > 0 and r["tps"] > 0 for r in recs.values())
    for rid in (0, 4):  # a long and a short prompt, decoded in a batch with others
        assert recs[rid]["tokens"] == _greedy_reference(model, rid, reqs[rid]["prompt_len"], 5)
    trace = pd.DataFrame(eng.kv_trace)
    assert trace["in_flight"].max() == 3  # the concurrency cap
    assert (trace["kv_bytes_measured"] == trace["kv_bytes_predicted"]).all()
    assert eng.live_kv_bytes() == 0
    assert out["prefill_s"] > 0 and out["decode_s"] > 0 and out["comm_s"] == 0 and out["comm_calls"] == {}


def test_cancel_storm_frees_half_and_a_leak_would_show():
    torch.set_num_threads(1)
    model = build_model("lab-tiny-llama")
    eng = ps.Engine(model)
    reqs = sx.make_workload(7, short_prompt=8, long_prompt=24, output_len=6)
    out = eng.serve(reqs, concurrency=5, cancel_step=2)
    c = out["cancel"]
    assert c["in_flight_before"] == 5 and c["cancelled"] == 3  # every other one, rounded up
    assert c["kv_bytes_freed_measured"] == c["kv_bytes_freed_predicted"] > 0
    assert c["kv_bytes_before_measured"] == c["kv_bytes_before_predicted"]
    status = pd.Series([r["status"] for r in out["records"]]).value_counts()
    assert status["cancelled"] == 3 and status["ok"] == 4
    assert eng.live_kv_bytes() == 0
    leaked = eng.alloc(10)  # a reference somebody forgot to drop stays measured
    assert eng.live_kv_bytes() == mem.kv_cache_bytes(model.spec, 10, "fp32")
    del leaked
    assert eng.live_kv_bytes() == 0


def test_error_table_counts_by_hand():
    rows = [  # rid, attempt, status
        (0, 1, "ok"), (1, 1, "rank_lost"), (1, 2, "ok"), (2, 1, "comm_timeout"), (2, 2, "comm_timeout"),
        (3, 1, "cancelled")]
    storm = [(0, 1, "ok"), (1, 1, "cancelled"), (2, 1, "ok"), (3, 1, "cancelled")]  # the client's choice
    df = pd.DataFrame([{"experiment": "x", "rid": r, "attempt": a, "status": s} for r, a, s in rows]
                      + [{"experiment": "cancel storm", "rid": r, "attempt": a, "status": s} for r, a, s in storm])
    t, c = (row for _, row in sx.error_table(df).iterrows())
    assert (t["requests"], t["attempts"], t["ok"]) == (4, 6, 2)
    assert (t["rank_lost"], t["comm_timeout"], t["cancelled"]) == (1, 2, 1)
    assert t["error_rate"] == pytest.approx(3 / 5)  # server errors / attempts the client did not cancel
    assert t["retried_ok"] == 1 and t["failed_final"] == 1  # rid 2; the cancelled rid 3 is not a failure
    assert (c["cancelled"], c["ok"], c["error_rate"], c["failed_final"]) == (2, 2, 0.0, 0)
    assert list(sx.error_table(df).columns[3:7]) == ["ok", "cancelled", "rank_lost", "comm_timeout"]


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_heads=8; valid tp: 1, 2, 4, 8"):
        sx.make_plan(3)
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_kv_heads=2; valid tp: 1, 2; model 'lab-tiny"):
        sx.make_plan(4, model="lab-tiny-llama")  # labkit.parallel.tensor would replicate; the KV cache splits
    with pytest.raises(ValueError, match=r"concurrency=3 is not a multiple of world_size=2 .* each concurrency "
                                         r"must be a multiple of world_size=2, e\.g\. 2, 4, 6"):
        sx.make_plan(2, ramp=[3])
    with pytest.raises(ValueError, match=r"request 0: prompt_len \+ max_new_tokens=136 exceeds model "
                                         r"'lab-tiny-llama''s max_seq_len=128; use prompt_len "
                                         r"\+ max_new_tokens <= 128"):
        sx.make_plan(2, long_prompt=120, output_len=16)
    with pytest.raises(ValueError, match=r"mode='pipeline' is not valid; choose one of: replicas, tp"):
        sx.make_plan(2, modes=["pipeline"])
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'"):
        sx.make_plan(2, model="nope")
    assert sx.make_plan(4)["model"] == "lab-small-llama"  # 4 kv heads: TP=4 splits them


def test_predict_deployments_by_hand():
    spec = get_spec("llama-2-13b")
    df = ch.predict_deployments("llama-2-13b", gpus=8, gpu="h100-80gb", concurrency=8, prompt_len=1024,
                                output_len=256, mfu=0.5, hbm_efficiency=0.8)
    assert list(df["tp"]) == [1, 2, 4, 8] and list(df["replicas"]) == [8, 4, 2, 1]
    assert (df["source"] == "predicted").all()
    r1 = df.iloc[0]
    assert r1["weights_bytes_per_gpu"] == 2 * spec.n_params()  # bf16, whole model
    hbm = 3350e9 * 0.8
    kv = 2 * 40 * 40 * 128 * 2 * 1 * (1024 + 128)  # 2 layers-worth K,V x heads x head_dim x bf16 x ctx
    assert mem.kv_cache_bytes(spec, 1152, "bf16") == kv
    assert r1["tpot_s"] == pytest.approx((2 * spec.n_params() + kv) / hbm)  # memory-bound, no all-reduce
    assert r1["decode_bound"] == "memory" and r1["decode_allreduce_s"] == 0
    assert r1["throughput_tok_s"] == pytest.approx(8 * 1 / r1["tpot_s"])
    assert (df["ttft_s"].diff().dropna() < 0).all()  # prefill splits over tp
    assert (df.loc[df["tp"] > 1, "decode_allreduce_s"] > 0).all()
    with pytest.raises(ValueError, match=r"gpu='b200-180gb' has no peak_bf16_tflops"):
        ch.predict_deployments(gpu="b200-180gb")
    with pytest.raises(ValueError, match=r"tp=3 does not divide gpus=8"):
        ch.predict_deployments(tps=[3])
    with pytest.raises(ValueError, match=r"replicas=8 does not divide concurrency=4"):
        ch.predict_deployments(tps=[1], concurrency=4)


GPU_SIZES = {"gpus": 8, "gpu": "h100-80gb", "concurrency": 64, "prompt_len": 1024, "output_len": 256}
CHAPTER = {"world_size": 2, "model": None, "n_requests": 16, "short_prompt": 16, "long_prompt": 96, "output_len": 16,
           "ramp": None, "cancel_step": 4, "lose_at_step": 3, "detect_timeout_s": 1.0, "backend": "auto",
           "big_model": "llama-2-13b", "gpus": 8, "gpu": "h100-80gb", "concurrency_gpu": 64, "prompt_len_gpu": 1024,
           "output_len_gpu": 256}


def test_deployments_that_do_not_fit_carry_no_timing():
    df = ch.predict_deployments("llama-3-70b", **GPU_SIZES)
    bad, ok = df[~df["fits"]], df[df["fits"]]
    assert list(bad["tp"]) == [1, 2] and list(ok["tp"]) == [4, 8]
    timing = ["ttft_s", "tpot_s", "tps_per_seq", "throughput_tok_s", "decode_allreduce_s", "prefill_allreduce_s"]
    assert bad[timing].isna().all().all() and bad["decode_bound"].isna().all()
    assert bad["note"].str.startswith("does not fit: peak").all() and (ok["note"] == "").all()
    assert ok[timing].notna().all().all()
    text = " ".join(ch.deployment_findings(df, "llama-3-70b"))
    assert "fits at TP4, TP8; not at TP1" in text and "lowest TTFT TP8 x 1" in text, text
    with pytest.raises(ValueError, match="no deployment of llama-3.1-405b fits"):
        ch.deployment_findings(ch.predict_deployments("llama-3.1-405b", **GPU_SIZES), "llama-3.1-405b")


def test_check_chapter_refuses_before_launch(monkeypatch):
    import labkit.runtime.launcher

    monkeypatch.setattr(labkit.runtime.launcher, "launch", lambda *a, **k: pytest.fail("launched"))
    assert ch.check_chapter(**CHAPTER)["model"] == "lab-tiny-llama"
    with pytest.raises(ValueError, match=r"big_model='llama-3.1-405b' fits on no deployment of 8 x h100-80gb .* "
                                         r"closest is tp=8 x 1 replica\(s\) at [\d.]+ GiB per GPU > 80.0 GiB, short "
                                         r"by [\d.]+ GiB; what would fit: .*h200-141gb.*smaller model.*more GPUs "
                                         r"alone would not"):
        ch.check_chapter(**{**CHAPTER, "big_model": "llama-3.1-405b"})
    for name in ("cancel_step", "lose_at_step"):
        with pytest.raises(ValueError, match=rf"{name}=16 must be below output_len=16.*use 1 to 15"):
            ch.check_chapter(**{**CHAPTER, name: 16})
        with pytest.raises(ValueError, match=rf"{name}=16 must be below output_len=16"):
            sx.make_plan(2, output_len=16, **{name: 16})  # serving.run goes through make_plan too
    # one rank: no rank loss to time, so its step is not checked
    assert "rank_loss" not in sx.make_plan(1, output_len=4, cancel_step=None, lose_at_step=9)


def test_ramp_findings_follow_the_data():
    # the tester's run: TTFT p50 fell with concurrency, replicas' throughput fell from 4 to 8
    rows = [("replicas", 2, 0.093, 900, 700, 1500, 0.0), ("replicas", 4, 0.05, 700, 500, 2131, 0.0),
            ("replicas", 8, 0.034, 400, 200, 2026, 0.0),
            ("tp", 2, 0.10, 500, 400, 800, 1.0), ("tp", 4, 0.12, 450, 300, 1000, 1.0),
            ("tp", 8, 0.20, 300, 150, 2100, 1.0)]
    summary = pd.DataFrame([{"mode": m, "concurrency": c, "ttft_p50_s": t, "tps_p50": p50, "tps_p95": p95,
                             "throughput_tok_s": th, "comm_s": cs, "prefill_s": 1.0, "decode_s": 3.0}
                            for m, c, t, p50, p95, th, cs in rows])
    rep, tp, both = ch.ramp_findings(summary)
    assert "TTFT p50 fell from 0.093 s at concurrency 2 to 0.034 s at 8" in rep, rep
    assert "total throughput rose from 1500 tok/s at concurrency 2 to 2131 tok/s at 4, then fell to 2026 tok/s " \
           "at 8" in rep, rep
    assert "TPS p95 was 50% of p50" in rep
    assert "TTFT p50 rose from 0.100 s at concurrency 2 to 0.200 s at 8" in tp, tp
    assert "below replicas' at concurrency 2, 4 only" in both and "(25%)" in both, both
    with pytest.raises(ValueError, match="summary lacks columns"):
        ch.ramp_findings(summary.drop(columns="comm_s"))


def test_replicas_vs_tp_and_failures_on_two_ranks():
    """One launch: parity of TP with the whole model, the same greedy tokens from replicas and TP, the
    cancel storm on both replicas, and a lost rank (replicas keep serving; TP fails on a timeout, retries)."""
    out = sx.run(2, n_requests=6, short_prompt=8, long_prompt=24, long_every=3, output_len=4, ramp=[2, 4],
                 cancel_step=2, lose_at_step=2, detect_timeout_s=1.0, backend="gloo", timeout_s=240)
    p = out["parity"]
    assert p["tp"] == 2 and p["tp_vs_whole_max_abs"] < 1e-4 and p["cached_vs_full_max_abs"] < 1e-4
    assert p["tp_kv_bytes_per_rank"] * 2 == p["whole_kv_bytes"]  # each TP rank holds half the kv heads
    rec = out["records"]
    assert (rec["status"] == "ok").all() and len(rec) == 2 * 2 * 6  # 2 modes x 2 concurrencies x 6 requests
    tokens = rec.groupby(["rid"])["tokens"].apply(lambda s: {tuple(t) for t in s})
    assert (tokens.apply(len) == 1).all(), tokens  # replicas and TP generate the same greedy tokens
    s = out["summary"]
    assert set(zip(s["mode"], s["concurrency"])) == {("replicas", 2), ("replicas", 4), ("tp", 2), ("tp", 4)}
    assert (s.loc[s["mode"] == "tp", "comm_s"] > 0).all() and (s.loc[s["mode"] == "replicas", "comm_s"] == 0).all()
    want = st.collectives_per_forward(get_spec("lab-tiny-llama"), 2)  # 2 per layer + embedding; logits gather
    tp = s[s["mode"] == "tp"]
    assert (tp["decode_all_reduce_per_step"] == want["all_reduce"]).all(), tp  # counted by CommLog
    assert (tp["decode_all_gather_per_step"] == want["all_gather"]).all()
    assert (tp["prefill_all_reduce_per_prompt"] == want["all_reduce"]).all()
    assert ((s["prefill_fraction"] > 0) & (s["prefill_fraction"] < 1)).all()
    assert (s["ttft_p95_s"] >= s["ttft_p50_s"]).all() and (s["tps_p95"] <= s["tps_p50"]).all()  # p95 = slow tail

    c = out["cancel"]
    assert (c["kv_bytes_freed_measured"] == c["kv_bytes_freed_predicted"]).all() and (c["cancelled"] >= 1).all()
    assert (c["kv_bytes_at_end_measured"] == 0).all()

    f = out["failures"]
    lost = out["rank_loss"]["lost_rank"]
    reps = f[f["experiment"] == "rank loss: replicas"]
    first = reps[reps["attempt"] == 1]
    survivors_own = first[first["rid"] % 2 != lost]
    assert (survivors_own["status"] == "ok").all()  # the other replica kept serving its own requests
    assert (first.loc[first["status"] != "ok", "status"] == "rank_lost").all()
    assert (first["status"] == "rank_lost").any()
    tp = f[f["experiment"] == "rank loss: tp"]
    assert set(tp.loc[tp["attempt"] == 1, "status"]) <= {"ok", "comm_timeout"}
    assert (tp["status"] == "comm_timeout").any()
    e = out["errors"].set_index("experiment")
    for exp in ("rank loss: replicas", "rank loss: tp"):
        assert e.loc[exp, "failed_final"] == 0 and e.loc[exp, "requests"] == 6, e
    assert e.loc["rank loss: tp", "comm_timeout"] >= 1 and e.loc["rank loss: replicas", "rank_lost"] >= 1
    assert e.loc["cancel storm", "cancelled"] >= 2
    assert e.loc["cancel storm", "failed_final"] == 0 and e.loc["cancel storm", "error_rate"] == 0  # not failures
    retried = tp[tp["attempt"] == 2]
    assert (retried["status"] == "ok").all() and (retried["ttft_s"] >= out["rank_loss"]["detect_timeout_s"]).all()
    assert not math.isnan(out["wall_s"])
