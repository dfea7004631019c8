"""The planner and the calculator against published training runs (data/reference/published/training.csv),
the schedules against the simulator's closed forms, and inter-node groups priced hierarchically over the
node's NICs (issue 14)."""

from __future__ import annotations

import json

import pytest

from labkit.cli import main as cli_main
from labkit.theory import costmodel, nccl, planner
from labkit.theory import published as pub
from labkit.theory import simulate as sim
from labkit.theory.mesh import ParallelDims

GiB = 2**30


@pytest.fixture(scope="module")
def rows():
    return [r for r in pub.validate_published() if not r.get("skipped")]


# ------------------------------------------------------------------------------------------------------
# the validation table
# ------------------------------------------------------------------------------------------------------
def test_published_meshes_are_accepted_and_predicted_mfu_is_within_the_band(rows):
    """Every published mesh is accepted by the mesh rules and the memory calculator, and the planner's predicted
    MFU is within MFU_BAND = (0.85, 1.15) x the published one, for at least 8 published configurations.

    Why that band: compute is priced kernel by kernel (labkit.theory.kernels: MAMF GEMM efficiencies,
    FlashAttention-2) with one fitted parameter per GPU (the sustained fraction), fitted on the two calibration
    rows only; the validation rows are not fitted, and the goal (+-10 %, benchmarks/validate_training.py) is
    the issue's. The band is the test's floor: outside it the model is wrong, not noisy (the constant-50 %
    model of before lands at 0.79-0.95; tests/test_training_validation.py shows it fails the goal)."""
    assert len(rows) >= 8
    lo, hi = pub.MFU_BAND
    assert (lo, hi) == (0.85, 1.15)
    for r in rows:
        assert r["accepted"], (r["model"], r["gpus"], r["error"])
        assert r["published_mfu"] and r["predicted_mfu"], r
        assert lo <= r["ratio"] <= hi, (r["model"], r["gpus"], r["predicted_mfu"], r["published_mfu"])
        assert r["ratio"] == pytest.approx(r["predicted_mfu"] / r["published_mfu"])


def test_the_rows_are_the_published_ones(rows):
    by = {(r["model"], r["gpus"], r["seq_len"]): r for r in rows}
    # Megatron-LM Table 1 (TFLOP/s include recomputation: compared with the predicted hardware FLOP rate)
    r = by[("GPT 1T (1008B)", 3072, 2048)]
    assert (r["tp"], r["pp"], r["dp"]) == (8, 64, 6) and r["published_mfu"] == 0.52 and r["flops"] == "with_recompute"
    # Llama 3 405B, Table 4: the uneven 126-layer split on 16 stages the old rule refused
    r = by[("Llama 3 405B", 16384, 8192)]
    assert (r["tp"], r["pp"], r["dp"], r["cp"]) == (8, 16, 128, 1) and r["layers_per_stage"] == "7,8x14,7"
    assert r["published_mfu"] == 0.41 and r["flops"] == "model"
    # BLOOM: 149 TFLOP/s on A100s (312 dense) with its 5 + 10 x 6 + 5 split and full recompute
    r = by[("BLOOM 176B", 384, 2048)]
    assert r["published_mfu"] == pytest.approx(149 / 312) and r["layers_per_stage"] == "5,6x10,5"
    assert r["recompute"] == "full" and r["fits"]
    assert {r["gpu"] for r in rows} == {"a100-80gb", "h100-80gb"}


def test_every_published_mesh_fits_and_is_ranked(rows):
    for r in rows:
        # a source's own schedule the calculator finds over memory (Llama 3's modified interleaving) is priced
        # anyway and says so (validation.yaml memory_override); every other published mesh fits
        assert r["fits"] or r.get("memory_note"), (r["model"], r["gpus"], r.get("fit_reason"))
        assert (not r["fits"]) or r["peak_gib"] <= r["capacity_gib"] < 80
        assert r["planner_rank"] is not None and 1 <= r["planner_rank"] <= r["n_ranked"], (r["model"], r["gpus"],
                                                                                         r["planner_reason"])


def test_the_csv_is_the_ecosystem_file_read_without_pandas():
    runs = pub.load_training_runs()
    assert list(runs[0]) == ["source", "url", "read_on", "what", "model", "params_b", "gpu", "gpus", "gpus_per_node",
                             "interconnect", "nics_per_node", "tp", "pp", "dp", "cp", "ep", "vpp", "schedule",
                             "sharding", "recompute", "seq_len", "global_batch_size", "micro_batch_size", "precision",
                             "tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "note", "role"]
    assert {r["role"] for r in runs} == {"calibration", "validation"}
    assert all(r["url"].startswith("https://") for r in runs)
    table = pub.validation_table()
    assert "not validated:" in table and "MegaScale" in table


def test_cli_validate_table_and_json(capsys, rows):
    assert cli_main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PREDICTED vs PUBLISHED") and out.count("\n") >= len(rows) + 2
    for r in rows:
        assert r["model"] in out
    assert cli_main(["plan", "--validate", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len([g for g in got if not g.get("skipped")]) == len(rows)


def test_chapter_09_shows_it_in_one_call(rows):
    from labkit.chapters import ch09_composing_meshes as ch

    ch.check_validation(rows)
    text = ch.validation_findings(rows)
    assert f"accepts {len(rows)} of {len(rows)} published meshes" in text
    df = ch.validation_frame(rows)
    assert len(df) == len(rows) and "MFU predicted" in df.columns


def test_the_issue_case_no_tp_across_nodes_for_405b_on_16k():
    # issue 14: the old top pick put TP 16 across two nodes over InfiniBand (~16 % MFU for a ~40 % run)
    p = planner.plan("llama-3.1-405b", gpus=16384, seq_len=8192, global_batch_size=2048)
    assert p.best.links["tp"] in ("nvlink4", "-") and p.best.tp <= 8  # "-": tp = 1, no TP group at all
    published = p.find(dp=128, tp=8, pp=16, cp=1)
    assert published is not None and published.rank is not None and published.layers_per_stage[0] == 7


# ------------------------------------------------------------------------------------------------------
# schedules: the planner's bubbles are the simulator's closed forms
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (8, 16, 4), (16, 32, 7), (2, 4, 2)])
def test_bubble_factors_match_the_simulators_closed_forms(p, m, v):
    for sched, vv in (("1f1b", 1), ("interleaved", v), ("zb-h1", 1)):
        ratio = sim.bubble_formula(sched, p, m, vv, convention="ratio")  # bubble / ideal compute
        assert planner.bubble_factor(sched, vv) * (p - 1) / m == pytest.approx(ratio, rel=1e-12), sched


def test_schedule_options():
    assert planner.schedule_options(1, 8, (32,)) == [("1f1b", 1)]
    opts = planner.schedule_options(16, 32, (7,) + (8,) * 14 + (7,))
    assert ("zb-h1", 1) in opts and ("interleaved", 7) in opts and ("interleaved", 8) not in opts
    assert not [o for o in planner.schedule_options(4, 6, (5, 5, 5, 5)) if o[0] == "interleaved"]  # 6 % 4 != 0


# ------------------------------------------------------------------------------------------------------
# inter-node groups: hierarchical over the node's NICs (issue 14 item 3)
# ------------------------------------------------------------------------------------------------------
NVLINK, IB, BASE, HOP_NV, HOP_IB = 450e9, 50e9, 6.6e-6, 0.6e-6, 2.7e-6


def test_a_group_spanning_nodes_is_priced_hierarchically():
    topo = planner.Topology.of("h100-80gb", 8)  # 8 NICs per node: one per GPU (DGX H100)
    s = 2**30
    # 16 ranks, 8 on each of 2 nodes: intra-node reduce-scatter, the node's 1/8 shard all-reduced across the 2
    # nodes on each GPU's own NIC (8 rails), intra-node all-gather (Thakur et al. 2005, Sec. 4, two levels)
    # priced as NCCL runs it (labkit.theory.nccl): NVLSTree, NVLink SHARP inside each node at B_nvls k/(k+1),
    # each GPU's shard over its own NIC (8 rails, 2 nodes: the network term is min(k, NICs) x B_nic)
    prm = nccl.params()
    b_nvls = NVLINK * prm.nvls_efficiency * 8 / 9
    b_net = 8 * IB * prm.net_efficiency
    hand = prm.nvls_latency_s + 2 * 1 * 14e-6 + s / min(b_nvls, b_net)  # NVLS has no baseLat (tuning.cc)
    assert topo.collective_s("all_reduce", s, 16, 1) == pytest.approx(hand, rel=1e-12)
    flat_one_nic = BASE + 2 * 15 / 16 * s / IB  # the old price: the whole ring at one NIC's bandwidth
    assert flat_one_nic / hand > 5
    # the same function the emulator prices explicit rank groups with
    ranks = list(range(16))
    assert topo.collective_s("all_reduce", s, 16, 1) == pytest.approx(costmodel.group_collective_time(
        "all_reduce", s, ranks, gpus_per_node=8, intra=topo.intra, inter=topo.inter, nics_per_node=8), rel=1e-12)
    # one rank per node (DP with tp = 8): a ring on the NICs, each GPU on its own
    # (Simple protocol: every step a network step, NCCL's 1.4x multi-node ring plateau on its latency)
    assert topo.collective_s("all_reduce", s, 4, 8) == pytest.approx(
        1.4 * (prm.call_latency_s[2] + 2 * 3 * HOP_IB * prm.step_scale) + 2 * 3 / 4 * s / (IB * prm.net_efficiency),
        rel=1e-12)


def test_fewer_nics_than_gpus_share_the_network():
    s = 2**30
    one = planner.Topology.of("h100-80gb", 8, nics_per_node=1)
    eight = planner.Topology.of("h100-80gb", 8)
    # all 8 GPUs of a node cross the network at once: with one NIC each gets 1/8 of it
    t1, t8 = one.collective_s("reduce_scatter", s, 4, 8), eight.collective_s("reduce_scatter", s, 4, 8)
    lat = nccl.params().call_latency_s[2] + 3 * HOP_IB * nccl.params().step_scale  # Simple: 3 network steps
    assert t1 - lat == pytest.approx(8 * (t8 - lat), rel=1e-9)
    p1 = planner.plan("llama-3-8b", gpus=64, seq_len=4096, global_batch_size=64, nics_per_node=1)
    p8 = planner.plan("llama-3-8b", gpus=64, seq_len=4096, global_batch_size=64)
    assert p1.best.step_time_s > p8.best.step_time_s and "x 1 NICs per node" in p1.table(top=1)
    dims = ParallelDims(64, dp=8, tp=8)
    assert p1.find(dp=8, tp=8, pp=1).links["dp"] == "ib-ndr" and dims.stride("dp") == 8


def test_reasons_say_which_term_dominates():
    p = planner.plan("llama-3-70b", gpus=256, seq_len=4096, global_batch_size=256)
    for c in p.candidates[1:20]:
        assert "dominant overhead:" in c.reason and "% of the step" in c.reason
    assert p.best.dominant.endswith("of the step")


def test_convention_and_activations_pass_through(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--gpus", "64", "--seq", "4096", "--global-batch", "64", "--top", "1"]
    assert cli_main([*argv, "--convention", "zero", "--activations", "lab"]) == 0
    out = capsys.readouterr().out
    assert "convention zero, activations lab" in out
    assert cli_main(argv) == 0
    assert f"convention {planner.DEFAULT_CONVENTION}, activations {planner.DEFAULT_ACTIVATIONS}" in \
        capsys.readouterr().out
    lab = planner.plan("llama-3-70b", gpus=64, seq_len=4096, global_batch_size=64, activations="lab")
    meg = planner.plan("llama-3-70b", gpus=64, seq_len=4096, global_batch_size=64)
    a, b = lab.find(dp=8, tp=8, pp=1), meg.find(dp=8, tp=8, pp=1)
    assert a.peak_bytes_per_gpu != b.peak_bytes_per_gpu
