"""labkit.theory.costmodel: busbw factors, alpha-beta fit, ring/tree predictions, data/hardware.yaml. No launches."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.theory import costmodel as cm

ROOT = Path(__file__).resolve().parent.parent


def test_costmodel_imports_no_torch_numpy_or_pandas():
    code = ("import sys, labkit.theory.costmodel as cm; cm.ring_vs_tree([1024]); "
            "cm.fit_alpha_beta([1, 2], [1.0, 2.0]); "
            "print(sorted(m for m in ('torch', 'numpy', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_bus_factors_follow_nccl_tests(n):
    assert cm.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert cm.bus_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "send_recv"):
        assert cm.bus_factor(op, n) == 1.0


def test_algbw_and_busbw_values():
    # 1e9 bytes in 0.5 s: algbw 2 GB/s; all_reduce on 4 ranks: busbw = 2 * 1.5 = 3 GB/s (> algbw for n > 2)
    assert cm.algbw_gbps(10**9, 0.5) == pytest.approx(2.0)
    assert cm.busbw_gbps("all_reduce", 4, 10**9, 0.5) == pytest.approx(3.0)
    assert cm.busbw_gbps("all_reduce", 2, 10**9, 0.5) == pytest.approx(2.0)  # factor 1 at n = 2
    assert cm.busbw_gbps("all_gather", 4, 10**9, 0.5) == pytest.approx(1.5)  # < algbw
    assert cm.busbw_gbps("broadcast", 8, 10**9, 0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("call, match", [
    (lambda: cm.bus_factor("allreduce", 4), r"op='allreduce' is not valid; choose one of: all_reduce"),
    (lambda: cm.bus_factor("all_reduce", 0), r"world_size=0 must be an integer >= 1"),
    (lambda: cm.algbw_gbps(0, 1.0), r"nbytes=0 must be an integer >= 1"),
    (lambda: cm.algbw_gbps(10, 0.0), r"time_s=0.0 must be a finite number > 0"),
    (lambda: cm.check_world_size("send_recv", 1), r"world_size=1 is too small for op='send_recv'.*peer"),
    (lambda: cm.check_world_size("all_reduce", 1), r"world_size=1 is too small for op='all_reduce'"),
])
def test_bad_input_names_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------------
# alpha-beta fit
# ------------------------------------------------------------------------------------------------------
SIZES = [2**k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB


@pytest.mark.parametrize("alpha, gbps", [(25e-6, 12.0), (5e-6, 400.0), (4e-4, 1.2)])
@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_known_alpha_beta_exactly(alpha, gbps, relative):
    beta = 1 / (gbps * 1e9)
    fit = cm.fit_alpha_beta(SIZES, [alpha + beta * s for s in SIZES], relative=relative)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth_gbps == pytest.approx(gbps, rel=1e-9)
    assert fit.rms_rel_residual < 1e-9
    assert fit.n_points == len(SIZES)
    assert fit.predict(1 << 20) == pytest.approx(alpha + beta * (1 << 20))


def test_fit_with_noise_stays_close():
    rng = random.Random(7)
    alpha, beta = 30e-6, 1 / 20e9
    times = [(alpha + beta * s) * (1 + rng.uniform(-0.05, 0.05)) for s in SIZES for _ in range(3)]
    sizes = [s for s in SIZES for _ in range(3)]
    fit = cm.fit_alpha_beta(sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.1)
    assert 0.01 < fit.rms_rel_residual < 0.05


def test_relative_fit_keeps_latency_that_ols_loses():
    # a 10% error on the largest point swamps alpha in ordinary least squares, not in the relative fit
    alpha, beta = 20e-6, 1 / 10e9
    times = [alpha + beta * s for s in SIZES]
    times[-1] *= 1.1
    rel = cm.fit_alpha_beta(SIZES, times)
    ols = cm.fit_alpha_beta(SIZES, times, relative=False)
    assert abs(rel.alpha_s - alpha) / alpha < 0.05
    assert abs(ols.alpha_s - alpha) / alpha > 1.0


@pytest.mark.parametrize("sizes, times, match", [
    ([1, 2, 3], [1.0, 2.0], "nbytes has 3 values but times_s has 2"),
    ([8, 8, 8], [1.0, 1.0, 1.0], "at least 2 distinct sizes"),
    ([8, 16], [1.0, 0.0], r"time_s=0.0 must be a finite number > 0"),
    ([0, 16], [1.0, 2.0], r"nbytes=0 must be a finite number >= 1"),
    ([float("inf"), 16], [1.0, 2.0], r"nbytes=inf must be a finite number >= 1"),
    ([float("nan"), 16], [1.0, 2.0], r"nbytes=nan must be a finite number >= 1"),
    ([-8, 16], [1.0, 2.0], r"nbytes=-8 must be a finite number >= 1"),
    (["8K", 16], [1.0, 2.0], r"nbytes='8K' must be a finite number >= 1"),
    ([8, 16], [1.0, float("inf")], r"time_s=inf must be a finite number > 0"),
    ([8, 16], [float("nan"), 1.0], r"time_s=nan must be a finite number > 0"),
])
def test_fit_bad_input(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        cm.fit_alpha_beta(sizes, times)


def test_fit_survives_sizes_and_times_far_from_one():
    # sizes near the float range's end and times of attoseconds: scaled before summing, so no overflow
    for scale_x, scale_t in ((1e150, 1.0), (1.0, 1e-150), (1e200, 1e-100)):
        sizes = [s * scale_x for s in (1, 2, 4, 8)]
        times = [(1e-3 + 1e-6 * s) * scale_t for s in (1, 2, 4, 8)]
        fit = cm.fit_alpha_beta(sizes, times)
        assert fit.alpha_s == pytest.approx(1e-3 * scale_t, rel=1e-6)
        assert fit.beta_s_per_byte == pytest.approx(1e-6 * scale_t / scale_x, rel=1e-6)


def test_busbw_raises_what_its_docstring_says():
    doc = cm.busbw_gbps.__doc__
    assert "Raises" in doc and "ValueError" in doc
    for call, match in ((lambda: cm.busbw_gbps("allreduce", 2, 8, 1.0), "op='allreduce' is not valid"),
                        (lambda: cm.busbw_gbps("all_reduce", 0, 8, 1.0), "world_size=0"),
                        (lambda: cm.busbw_gbps("all_reduce", 2, 0, 1.0), "nbytes=0"),
                        (lambda: cm.busbw_gbps("all_reduce", 2, 8, float("nan")), "time_s=nan")):
        with pytest.raises(ValueError, match=match):
            call()


# ------------------------------------------------------------------------------------------------------
# hardware.yaml and predictions
# ------------------------------------------------------------------------------------------------------
def test_hardware_yaml_every_value_has_a_public_source():
    hw = cm.hardware()
    assert {"h100-80gb", "h200-141gb", "a100-80gb"} <= set(hw["devices"])
    assert {"nvlink4", "nvlink5", "pcie5-x16", "ib-ndr"} <= set(hw["links"])
    for name, d in hw["devices"].items():
        assert d["source"].startswith("https://"), name
        assert d["memory_bytes"] > 0, name
        if "hbm_gbps" in d:  # devices the cost model uses carry the whole set
            assert d["hbm_gbps"] > 0 and d["peak_bf16_tflops"] > 0, name
            assert d["nvlink"] in hw["links"], name
    assert hw["devices"]["h100-80gb"]["memory_type"] == "HBM3"
    assert hw["devices"]["h200-141gb"]["memory_type"] == "HBM3e"
    for link in cm.links().values():
        assert link.source.startswith("https://"), link.name
        assert link.latency_source.startswith("https://github.com/NVIDIA/nccl/"), link.name
        assert link.bandwidth_gbps * 2 == link.bidirectional_gbps, link.name
        assert 0 < link.hop_latency_s < 1e-4
    assert cm.get_link("nvlink5").bandwidth_gbps == 2 * cm.get_link("nvlink4").bandwidth_gbps
    assert cm.get_link("ib-ndr").bandwidth_gbps == 50  # 400 Gb/s
    ladder = cm.bandwidth_ladder()
    bws = [r["bandwidth_gbps"] for r in ladder]
    assert bws == sorted(bws, reverse=True)
    assert ladder[0]["kind"] == "memory"


def test_unknown_link_and_device_list_the_choices():
    with pytest.raises(ValueError, match=r"link='nvlink9' is not valid; choose one of: .*nvlink4"):
        cm.get_link("nvlink9")
    with pytest.raises(ValueError, match=r"device='h300' is not valid; choose one of: .*h100-80gb"):
        cm.get_device("h300")


def test_ring_allreduce_inside_one_node_is_nccls_simple_ring_below_line_rate():
    """Wiring: at 1 GiB the forced ring is NCCL's Simple protocol on the fitted bus bandwidth (0.82 x 450, not the
    line rate); its companion (tests/test_nccl_model.py) checks the model against published rows."""
    from labkit.theory import nccl

    s, link, prm = 1 << 30, cm.get_link("nvlink4"), nccl.params()
    bus = 450e9 * prm.efficiency("nvlink4")
    assert 0.75 < bus / 450e9 < 0.9  # below line rate (NCCL's ~20 % protocol overhead, nccl-tests#212)
    t = cm.collective_time("all_reduce", s, 8, "nvlink4", include_base=False, algorithm="ring")
    steps = 14 * link.hop_latency_s * prm.step_scale
    assert t == pytest.approx(steps + 2 * 7 / 8 * s / bus)
    t_ag = cm.collective_time("all_gather", s, 8, "nvlink4", include_base=False)
    assert t_ag == pytest.approx(7 * link.hop_latency_s * prm.step_scale + 7 / 8 * s / bus)
    with_base = cm.collective_time("all_reduce", s, 8, algorithm="ring")
    assert with_base - t == pytest.approx(prm.call_latency_s[2])  # the Simple protocol's per-call latency
    # NCCL's default on NVLink 4 is NVLink SHARP for a large all_reduce: faster than the ring
    assert cm.collective_time("all_reduce", s, 8, "nvlink4") < 0.85 * with_base
    assert cm.collective_time("all_reduce", s, 8, "nvlink4", nvls=False) == pytest.approx(with_base)


def test_ring_latency_grows_linearly_tree_logarithmically():
    small = 1024
    ring = {n: cm.collective_time("all_reduce", small, n, include_base=False, algorithm="ring")
            for n in (64, 128, 1024)}
    tree = {n: cm.collective_time("all_reduce", small, n, algorithm="tree", include_base=False)
            for n in (64, 128, 1024)}
    assert ring[1024] / ring[64] > 10 and tree[1024] / tree[64] < 7 / 3 + 0.1  # log2(128) / log2(8)
    rows = cm.ring_vs_tree([small, 1 << 30], (8, 64, 1024))
    best = {(r["world_size"], r["bytes"]): r["faster"] for r in rows}
    assert best[(1024, small)] == "tree" and best[(64, small)] == "tree" and best[(8, 1 << 30)] == "ring"
    assert {r["source"] for r in rows} == {"predicted"}  # a table of them says where its numbers come from
    # NCCL's own pick is never slower than either forced algorithm
    for n in (64, 1024):
        assert cm.collective_time("all_reduce", small, n, include_base=False) <= min(ring[n], tree[n]) + 1e-15


def test_tp_forward_across_nodes_vs_nvlink():
    kw = dict(n_layers=60, hidden_size=6656, seq_len=4096, micro_batch_size=1, tp=8)
    nv4 = cm.tp_forward_comm(link="nvlink4", **kw)
    ib = cm.tp_forward_comm(link="ib-ndr", **kw)
    nv5 = cm.tp_forward_comm(link="nvlink5", **kw)
    assert nv4["n_allreduce"] == 120
    assert nv4["allreduce_bytes"] == 4096 * 6656 * 2
    assert nv4["forward_comm_s"] == pytest.approx(120 * nv4["allreduce_s"])
    assert nv4["source"] == ib["source"] == "predicted"
    # bandwidth-bound: the ratio approaches the ratio of the bus bandwidths NCCL reaches on each link
    # (450 x 0.82 over 50 x 0.88 = 8.4; NVLink 5 at the default 0.8: 16.4), a little less for the latencies
    assert 7.5 < ib["forward_comm_s"] / nv4["forward_comm_s"] < 8.5
    assert 12.5 < ib["forward_comm_s"] / nv5["forward_comm_s"] < 16.5


@pytest.mark.parametrize("call, match", [
    (lambda: cm.collective_time("all_reduce", 1024, 12), r"world_size=12 is not a whole number of nodes"),
    (lambda: cm.collective_time("all_reduce", 1024, 16, inter=None), r"spans 2 nodes.*inter="),
    (lambda: cm.collective_time("all_gather", 1024, 8, algorithm="tree"), r"tree.*all_reduce.* only"),
    (lambda: cm.collective_time("all_reduce", 1024, 8, algorithm="rings"), r"algorithm='rings' is not valid"),
    (lambda: cm.collective_time("all_reduce", 0, 8), r"nbytes=0"),
    (lambda: cm.tp_forward_comm(60, 4096, 2048, 1, 1, "nvlink4"), r"tp=1 must be an integer >= 2"),
])
def test_prediction_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_send_recv_and_broadcast_have_factor_one_in_the_model():
    from labkit.theory import nccl

    s, prm = 1 << 30, nccl.params()
    pcie = cm.get_link("pcie5-x16")
    t = cm.collective_time("send_recv", s, 2, "pcie5-x16", include_base=False)
    assert t == pytest.approx(pcie.hop_latency_s * prm.step_scale + s / (64e9 * prm.efficiency("pcie5-x16")))
    nv = cm.get_link("nvlink4")
    assert math.isclose(cm.collective_time("broadcast", s, 8, include_base=False),
                        7 * nv.hop_latency_s * prm.step_scale + s / (450e9 * prm.efficiency("nvlink4")))
