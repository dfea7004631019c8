"""The planner: a small case checked by hand, ranking and reasons, bad input, the CLI (table, --json, exit 2)."""

import json
from dataclasses import replace

import pytest

from labkit.cli import main
from labkit.theory import memory as mem
from labkit.theory import planner
from labkit.theory.mesh import ParallelDims
from labkit.theory.spec import ModelSpec, get_spec

# A model small enough to count by hand: 4 layers, h = 1024, 8 heads (no GQA), SwiGLU f = 4096, V = 32000.
HAND = ModelSpec(n_layers=4, hidden_size=1024, n_heads=8, ffn_hidden_size=4096, vocab_size=32000, max_seq_len=1024,
                 name="hand")
# data/hardware.yaml, written out: H100 dense bf16 peak, NVLink 4 and NDR InfiniBand per direction, NCCL latencies
PEAK, NVLINK, IB = 989e12, 450e9, 50e9
BASE, HOP_NV, HOP_IB = 6.6e-6, 0.6e-6, 2.7e-6


def _price(op, nbytes, n, nodes, k):
    """One collective as the cost model prices it (labkit.theory.nccl: NCCL's algorithm/protocol choice on the
    fitted bus bandwidths, checked against published nccl-tests rows in tests/test_nccl_model.py), with its
    per-call latency; the planner's own arithmetic (counts, overlap, bubbles) stays by hand."""
    from labkit.theory import costmodel

    return costmodel.placed_collective_time(op, nbytes, n, nodes, k, intra="nvlink4", inter="ib-ndr",
                                            nics_per_node=k)


@pytest.fixture(scope="module")
def hand_plan():
    # 4 H100s in 2 nodes of 2: every mesh of 4 ranks is valid for this model
    return planner.plan(HAND, gpus=4, gpu="h100-80gb", gpus_per_node=2, seq_len=1024, global_batch_size=8,
                        recompute="none", zero=1, mfu=0.5)


def by_mesh(plan, **dims):
    (c,) = [c for c in plan.candidates if all(getattr(c, k) == v for k, v in dims.items())
            and all(getattr(c, k) == 1 for k in {"dp", "tp", "pp", "cp"} - set(dims))]
    return c


def test_small_case_by_hand(hand_plan):
    # parameters: per layer 4h^2 (q, k, v, o) + 3hf (SwiGLU) + 2h (norms) = 16,779,264
    layer = 4 * 1024**2 + 3 * 1024 * 4096 + 2 * 1024
    assert layer == 16_779_264
    n_total = 32000 * 1024 + 4 * layer + 1024 + 32000 * 1024
    assert HAND.n_params() == n_total == 132_654_080
    # PaLM App. B: 6N (N without the input embedding) + 12 L a d T per token; 8 sequences of 1024 tokens.
    # (Compared below with the planner's own compute_s; no value is pasted from the planner's output.)
    n_no_embed = n_total - 32000 * 1024
    flops = (6 * n_no_embed + 12 * 4 * 8 * 128 * 1024) * 8 * 1024
    compute = flops / (4 * PEAK * 0.5)

    # dp=2 x tp=2: TP inside a node (ranks 0,1 | 2,3), DP across the nodes (0,2 | 1,3)
    c = by_mesh(hand_plan, dp=2, tp=2)
    assert c.n_microbatches == 4 and c.links["tp"] == "nvlink4" and c.links["dp"] == "ib-ndr"
    s_act = 1 * 1024 * 1024 * 2  # b * s * h * 2 bytes
    ar_tp = _price("all_reduce", s_act, 2, 1, 2)  # an all-reduce on 2 ranks of one node
    tp_s = 4 * 4 * 4 * ar_tp  # m=4 micro-batches x 4 layers x 4 all-reduces (2 forward, 2 backward)
    # ZeRO-1 over dp=2 (Megatron's distributed optimizer, the planner's default convention): reduce-scatter the
    # fp32 main gradients (4 bytes, theoretical_memory_usage.py's 18 = 2 + 4 + 12) + all-gather the bf16
    # parameters of the rank's TP half of the model; one rank per node, so each crosses the node's NIC
    n_local = 32000 * 1024 // 2 + 4 * (4 * 1024**2 // 2 + 3 * 1024 * 4096 // 2 + 2048) + 1024 + 32000 * 1024 // 2
    assert n_local == 66_331_648

    # 2 ranks on 2 nodes: one inter-node step of (n-1)/n of S each
    dp_total = _price("reduce_scatter", n_local * 4, 2, 2, 1) + _price("all_gather", n_local * 2, 2, 2, 1)
    dp_exposed = dp_total - (2 / 3) * compute / 4  # overlaps the backward of the last micro-batch
    assert c.parts["compute_s"] == pytest.approx(compute, rel=1e-9)
    assert c.parts["tp_s"] == pytest.approx(tp_s, rel=1e-9)
    assert c.parts["dp_total_s"] == pytest.approx(dp_total, rel=1e-9)
    assert c.parts["dp_s"] == pytest.approx(dp_exposed, rel=1e-9)
    assert c.parts["bubble_s"] == c.parts["pp_s"] == c.parts["cp_s"] == 0
    assert c.step_time_s == pytest.approx(compute + tp_s + dp_exposed, rel=1e-9)

    # dp=2 x pp=2: stages of 2 layers; the last stage also runs the output head (6 v h FLOPs per token), so the
    # pipeline runs at its pace: imbalance = max stage / mean stage, by hand
    f_layer = 6 * layer + 12 * 8 * 128 * 1024
    f_head = 6 * 32000 * 1024
    imbalance = (2 * f_layer + f_head) / ((4 * f_layer + f_head) / 2)
    c = by_mesh(hand_plan, dp=2, pp=2)
    assert c.layers_per_stage == (2, 2) and c.parts["compute_s"] == pytest.approx(compute * imbalance, rel=1e-9)
    p2p = _price("send_recv", s_act, 2, 2, 1)  # one activation (or gradient) to the neighbour stage, across nodes
    # of the three schedules ZB-H1 is the fastest here: bubble (p-1)/m x 1/3 (Qi et al. 2023, T_F = T_B = T_W),
    # 2(m + p - 1) sends; interleaved v=2 has (p-1)/(v m) and 2(v m + p - 1) sends; 1F1B (p-1)/m
    assert c.schedule == "zb-h1"
    assert c.parts["bubble_s"] == pytest.approx(compute * imbalance * 1 / 4 / 3, rel=1e-9)
    assert c.parts["pp_s"] == pytest.approx(2 * (4 + 2 - 1) * p2p, rel=1e-9)
    dims = ParallelDims(4, dp=2, pp=2)
    kw = dict(seq_len=1024, global_batch_size=8, recompute="none", zero=1, mfu=0.5, n_params_local=1, grad_bytes=4)
    for sched, v, bubble, sends in (("1f1b", 1, 1 / 4, 2 * (4 + 1)), ("interleaved", 2, 1 / 8, 2 * (2 * 4 + 1))):
        t = planner.step_time(HAND, dims, planner.Topology.of("h100-80gb", 2), schedule=sched, vpp=v, **kw)
        assert t["bubble_s"] == pytest.approx(compute * imbalance * bubble, rel=1e-9)
        assert t["pp_s"] == pytest.approx(sends * p2p, rel=1e-9)

    # pure DP over 4 ranks in 2 nodes, 2 per node: hierarchical (intra-node reduce-scatter of S, then the node's
    # shard S/2 over the network on each of the 2 GPUs' NICs; all-gather the same way):
    # (k-1)/k S/B_nvlink + (N-1)/N S/(k B_nic), latency (k-1) hops on NVLink + (N-1) on the network
    c4 = by_mesh(hand_plan, dp=4)

    dp4_total = _price("reduce_scatter", n_total * 4, 4, 2, 2) + _price("all_gather", n_total * 2, 4, 2, 2)
    assert c4.parts["dp_total_s"] == pytest.approx(dp4_total, rel=1e-9)
    assert c4.parts["dp_s"] == pytest.approx(dp4_total - (2 / 3) * compute / 2, rel=1e-9)
    # so by hand (the step times above) dp=2 x tp=2 beats dp=4 exactly when its TP comm costs less than the DP
    # time it saves; the planner's order follows those sums
    assert (by_mesh(hand_plan, dp=2, tp=2).rank < c4.rank) == (compute + tp_s + dp_exposed < c4.step_time_s)
    assert by_mesh(hand_plan, tp=4).links["tp"] == "ib-ndr"


def test_memory_comes_from_the_calculator(hand_plan):
    for dims in ({"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}):
        c = by_mesh(hand_plan, **dims)
        par = ParallelDims(4, **dims).parallel_config(zero=1, sequence_parallel=c.tp > 1,
                                                       layers_per_stage=c.layers_per_stage)
        if c.pp > 1:
            par = replace(par, schedule=c.schedule, vpp=c.vpp)
        est = mem.train_memory(HAND, par, mem.TrainConfig(micro_batch_size=1, seq_len=1024, n_microbatches=4,
                                                          attention="flash", convention="megatron",
                                                          activation_model="megatron"), device="h100-80gb")
        assert c.peak_bytes_per_gpu == est.total_bytes and c.fits == est.fits is True
        assert c.peak_stage == est.stage


def test_ranking_and_reasons(hand_plan):
    ranked = hand_plan.candidates
    assert [c.rank for c in ranked] == list(range(1, len(ranked) + 1)) and len(ranked) == 10
    assert all(a.step_time_s <= b.step_time_s for a, b in zip(ranked, ranked[1:], strict=False))
    assert ranked[0].reason.startswith("fastest predicted step; largest overhead:")
    for c in ranked[1:]:
        assert "vs #1, mostly" in c.reason and c.reason.startswith("+")
    tp4 = by_mesh(hand_plan, tp=4)
    assert "TP comm" in tp4.reason and "ib-ndr" in tp4.reason
    text = hand_plan.table()
    assert "PREDICTED plan" in text and text.count("\n") >= 12


def test_rejections_name_their_rule():
    p = planner.plan("llama-3-70b", gpus=64, gpu="h100-80gb", seq_len=4096, global_batch_size=64)
    rules = p.rejection_summary()
    assert "memory" in rules
    # n_kv_heads=8: tp=16 replicates each kv head on 2 ranks (allowed); n_heads=64 rules out tp=3, 6, ...
    assert not any("tp_kv_heads" in c.rules for c in p.rejected if c.tp == 16)
    q = planner.plan(get_spec("llama-3-70b").replace(n_kv_heads=6, n_heads=48), gpus=64, gpu="h100-80gb",
                     seq_len=4096, global_batch_size=64)
    tp16 = [c for c in q.rejected if c.tp == 16]
    assert tp16 and all("tp_kv_heads" in c.rules and "n_kv_heads=6" in c.reason for c in tp16)
    memory = [c for c in p.rejected if c.rules == ["memory"]]
    usable = mem.usable_bytes(mem.get_device("h100-80gb"))  # CUDA's ~79.2 GiB, not the datasheet's 80
    assert usable < 80 * mem.GiB
    assert all("does not fit even with recompute=full" in c.reason and c.peak_bytes_per_gpu > usable
               for c in memory)
    assert all(c.fits and c.peak_bytes_per_gpu <= usable for c in p.candidates)
    assert p.n_enumerated == len(p.candidates) + len(p.rejected)


def test_recompute_auto_takes_the_least_that_fits():
    p = planner.plan("llama-3-70b", gpus=64, gpu="h100-80gb", seq_len=8192, global_batch_size=64)
    order = {"none": 0, "selective": 1, "full": 2}
    for c in p.candidates:
        if c.recompute != "none":  # the lighter recompute fitted with none of the mesh's schedules
            lighter = [r for r in order if order[r] < order[c.recompute]][-1]
            par = ParallelDims(64, dp=c.dp, tp=c.tp, pp=c.pp, cp=c.cp).parallel_config(
                zero=1, sequence_parallel=c.tp > 1, layers_per_stage=c.layers_per_stage)
            train = mem.TrainConfig(seq_len=8192, n_microbatches=c.n_microbatches, recompute=lighter,
                                    convention=planner.DEFAULT_CONVENTION,
                                    activation_model=planner.DEFAULT_ACTIVATIONS)
            for sched, v in planner.schedule_options(c.pp, c.n_microbatches, c.layers_per_stage):
                par_s = replace(par, schedule=sched, vpp=v) if c.pp > 1 else par
                assert not mem.train_memory("llama-3-70b", par_s, train, device="h100-80gb").fits, (c.mesh(), sched)
            break
    else:
        pytest.fail("expected a mesh that needs recompute")


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match=r"gpu='h999' is not valid; choose one of: .*h100-80gb"):
        planner.plan("llama-3-70b", gpus=64, gpu="h999", global_batch_size=64)
    with pytest.raises(ValueError, match="no peak_bf16_tflops or nvlink"):
        planner.plan("llama-3-70b", gpus=64, gpu="l40s-48gb", global_batch_size=64)
    with pytest.raises(ValueError, match=r"gpus=0 must be an integer >= 1"):
        planner.plan("llama-3-70b", gpus=0, global_batch_size=64)
    with pytest.raises(ValueError, match=r"gpus=12 is not a whole number of nodes of gpus_per_node=8"):
        planner.plan("llama-3-70b", gpus=12, global_batch_size=64)
    with pytest.raises(ValueError, match=r"max_tp=0 must be an integer >= 1"):  # 0 was taken as "no cap"
        planner.plan("llama-3-70b", gpus=64, global_batch_size=64, max_tp=0)
    with pytest.raises(ValueError, match=r"fits on no mesh of 8 x h100-80gb .*smallest shortfall is [\d.]+ GiB "
                                         r"per GPU, at dp=\d+ tp=\d+ pp=\d+ .*ZeRO-3"):
        planner.plan("llama-3-70b", gpus=8, seq_len=8192, global_batch_size=64)
    with pytest.raises(ValueError, match=r"no valid mesh .* every mesh breaks a rule: .*cp_seq"):
        planner.plan("lab-tiny-llama", gpus=1024, seq_len=128, global_batch_size=1)


def test_vocabulary_is_padded_for_tp():
    sp = planner.padded_spec(planner.get_spec("gpt-3-175b"), 8)
    assert sp.vocab_size == 51200 and sp.vocab_size % (128 * 8) == 0
    assert planner.padded_spec(HAND, 8) is HAND


def test_cli_table_and_json(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--gpus", "64", "--gpu", "h100-80gb", "--gpus-per-node", "8",
            "--seq", "4096", "--global-batch", "64"]
    assert main([*argv, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED plan: llama-3-70b on 64 x h100-80gb" in out and "rejected (" in out
    assert main([*argv, "--top", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and len(rows) == 4 and [r["rank"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"dp", "tp", "pp", "cp", "ep", "fits", "peak_bytes_per_gpu", "step_time_s", "reason"} <= set(r)
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 64 and r["fits"] is True
        assert isinstance(r["peak_bytes_per_gpu"], int) and r["step_time_s"] > 0
    assert main([*argv, "--top", "1", "--json", "--all"]) == 0
    rows = json.loads(capsys.readouterr().out)
    ranked = [r for r in rows if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1)) and len(ranked) > 1  # --all beats --top
    assert all(r["rank"] is None and r["reason"] for r in rows[len(ranked):]) and len(rows) > len(ranked) + 10
    # --all without --json: the table shows every ranked and every rejected mesh (no "more" lines)
    assert main([*argv, "--top", "1", "--rejected", "0", "--all"]) == 0
    out = capsys.readouterr().out
    assert "more fitting meshes" not in out and "more (--rejected" not in out
    n_rejected = int(out.split("rejected (")[1].split(";")[0])
    assert sum(line.startswith("  dp=") for line in out.splitlines()) == n_rejected


@pytest.mark.parametrize("extra, needle", [
    (["--gpus", "0"], "gpus=0"),
    (["--gpus", "12"], "whole number of nodes"),
    (["--gpu", "nope"], "gpu='nope' is not valid"),
    (["--gpus", "8", "--seq", "8192"], "fits on no mesh"),
    (["--model", "nope"], "unknown model preset"),
    (["--max-tp", "0"], "--max-tp=0"),
    (["--top", "-1"], "--top=-1"),
    (["--rejected", "-1"], "--rejected=-1"),
])
def test_cli_bad_input_exits_2(capsys, extra, needle):
    argv = ["plan", "--model", "llama-3-70b", "--gpus", "64", "--seq", "4096", "--global-batch", "64"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_plan_bars_and_panel():
    from labkit.widgets import plan_bars

    p = planner.plan(HAND, gpus=4, gpu="h100-80gb", gpus_per_node=2, seq_len=1024, global_batch_size=8)
    fig = plan_bars(p, top=3)
    assert len(fig.data[0].x) == 3 and fig.data[0].name == "compute"
    total = sum(tr.y[0] for tr in fig.data)
    assert total == pytest.approx(p.best.step_time_s)
    assert "predicted" in fig.layout.yaxis.title.text
    pytest.importorskip("ipywidgets")
    from labkit.widgets import planner_panel

    panel = planner_panel("llama-3-70b", gpus=1024)
    controls = {c.description: c for box in panel.children[0].children for c in box.children}
    assert panel.plan().best.dp * panel.plan().best.tp * panel.plan().best.pp * panel.plan().best.cp == 1024
    controls["GPUs"].value = 8  # 70B with an 8192-token sequence fits on no mesh of 8 H100s
    assert panel.plan() is None and "smallest shortfall" in panel.children[1].value
    controls["model"].value = "llama-3-8b"
    assert panel.plan() is not None and panel.figure() is not None


def test_reason_names_the_dims_of_the_gradient_sync():
    # dp_s is the gradient sync over the dp*cp group: with dp=1 it is cp's, never "DP comm"
    def cand(dp, cp, dp_s):
        parts = dict.fromkeys(planner.TIME_PARTS, 0.0) | {"compute_s": 1.0, "dp_s": dp_s}
        return planner.Candidate(dp=dp, tp=1, pp=1, cp=cp, ep=1, micro_batch_size=1, n_microbatches=4,
                                 recompute="none", fits=True, step_time_s=sum(parts.values()), parts=parts,
                                 links={"dp": "ib-ndr"})

    ranked = [cand(8, 1, 0.1), cand(1, 8, 0.5), cand(2, 4, 0.6), cand(8, 1, 0.7)]
    planner._explain(ranked)
    assert ranked[0].reason.startswith("fastest predicted step; largest overhead: DP comm (exposed)")
    assert "mostly CP gradient sync (exposed; dp=1, the dp*cp group is cp=8)" in ranked[1].reason, ranked[1].reason
    assert "DP comm" not in ranked[1].reason
    assert "mostly DP x CP gradient sync (exposed; dp*cp = 2*4)" in ranked[2].reason, ranked[2].reason
    assert "mostly DP comm (exposed)" in ranked[3].reason, ranked[3].reason
