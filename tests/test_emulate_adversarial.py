"""Issue 27: an emulator that cannot be fooled. Each item is a pair: a correct program and a wrong (or gamed)
one whose emulated times must differ as physics says — every way torch lets a program wait, work never
waited, links shared by concurrent transfers, groups identified by their process group, members disagreeing
on a size, work the emulator cannot price, and a receive consumed before it completes. Pure replay tests first
(hand-written traces on the dgx-h100 profile), then the same programs run for real (labkit.experiments.emulate).
"""

from __future__ import annotations

import pytest

from labkit.runtime.launcher import launch
from labkit.theory.cluster import get_cluster
from labkit.theory.replay import INCOMPLETE_SHARE, ReplayError, replay

GiB, MiB = 2**30, 2**20
H100 = get_cluster("dgx-h100")


def _send(t, uid, peer, s, tag=0):
    return ("p2p", t, t + 1, uid, "send", peer, tag, s, True, {})


def _recv(t, uid, peer, s, tag=0):
    return ("p2p", t, t + 1, uid, "recv", peer, tag, s, True, {})


def _coll(t, uid, op, ranks, s, is_async=True, **info):
    return ("coll", t, t + 1, uid, op, tuple(ranks), s, is_async, {"name": op, **info})


# ------------------------------------------------------------------------------------------------------
# pure replay
# ------------------------------------------------------------------------------------------------------
def test_concurrent_sends_on_one_link_share_it_and_separate_links_do_not():
    one = replay([[_send(0, 1, 1, GiB), ("wait", 2, 3, 1)], [_recv(0, 1, 0, GiB), ("wait", 2, 3, 1)]], H100)
    k = 8
    split = replay([[_send(0, i, 1, GiB // k, i) for i in range(k)] + [("wait", 9, 9, i) for i in range(k)],
                    [_recv(0, i, 0, GiB // k, i) for i in range(k)] + [("wait", 9, 9, i) for i in range(k)]], H100)
    t1 = one.makespan_ns
    # 8 concurrent 128 MiB sends take as long as one 1 GiB send (each latency once more at most)
    assert split.makespan_ns == pytest.approx(t1, rel=0.02)
    alone = H100.p2p_s(0, 1, GiB // k) * 1e9
    assert split.makespan_ns > 6 * alone  # not 8 sends each at the full bandwidth
    # opposite directions are separate resources: 0 -> 1 and 1 -> 0 at once take one transfer's time
    both = replay([[_send(0, 1, 1, GiB), _recv(0, 2, 1, GiB), ("wait", 5, 5, 1), ("wait", 5, 5, 2)],
                   [_recv(0, 1, 0, GiB), _send(0, 2, 0, GiB), ("wait", 5, 5, 1), ("wait", 5, 5, 2)]], H100)
    assert both.makespan_ns == pytest.approx(t1, rel=1e-6)


def test_fan_out_shares_the_senders_port_and_a_collective_shares_the_pair_with_a_send():
    n = 4
    fan = [[_send(0, d, d, GiB) for d in range(1, n)] + [("wait", 5, 5, d) for d in range(1, n)]]
    fan += [[_recv(0, 1, 0, GiB), ("wait", 5, 5, 1)] for _ in range(1, n)]
    t1 = H100.p2p_s(0, 1, GiB) * 1e9
    assert replay(fan, H100).makespan_ns == pytest.approx(3 * t1, rel=0.02)
    beside = replay([[_coll(0, 1, "all_reduce", (0, 1), GiB), _send(0, 2, 1, GiB), ("wait", 5, 5, 1),
                      ("wait", 5, 5, 2)],
                     [_coll(0, 1, "all_reduce", (0, 1), GiB), _recv(0, 2, 0, GiB), ("wait", 5, 5, 1),
                      ("wait", 5, 5, 2)]], H100)
    ar = H100.collective_s("all_reduce", GiB, (0, 1)) * 1e9
    assert beside.makespan_ns > 0.98 * (ar + t1) - 2 * H100.p2p_s(0, 1, 0) * 1e9
    assert beside.makespan_ns == pytest.approx(ar + t1, rel=0.02)


def test_groups_are_their_process_group_not_their_members():
    # two groups of {0, 1}: rank 0 uses group A (1 MiB) then B (32 B), rank 1 the other order (async)
    a, b = {}, {"pg": 1}
    tr = [[_coll(0, 1, "all_reduce", (0, 1), MiB, **a), _coll(1, 2, "all_reduce", (0, 1), 32, **b),
           ("wait", 5, 5, 1), ("wait", 5, 5, 2)],
          [_coll(0, 1, "all_reduce", (0, 1), 32, **b), _coll(1, 2, "all_reduce", (0, 1), MiB, **a),
           ("wait", 5, 5, 1), ("wait", 5, 5, 2)]]
    r = replay(tr, H100)
    assert sorted({c["charged_nbytes"] for c in r.comm}) == [32, MiB]
    assert r.makespan_ns < 1.5 * H100.collective_s("all_reduce", MiB, (0, 1)) * 1e9
    # the same traces without group identity are matched across each other: a size disagreement
    plain = [[ev[:8] + ({"name": ev[4]},) if ev[0] == "coll" else ev for ev in t] for t in tr]
    with pytest.raises(ReplayError, match=r"S = 1048576 B on rank 0 but S = 32 B on rank 1"):
        replay(plain, H100)


def test_members_disagreeing_on_a_size_is_an_error_naming_ranks_op_and_sizes():
    ok = replay([[_coll(0, 1, "all_reduce", (0, 1), MiB, False)], [_coll(0, 1, "all_reduce", (0, 1), MiB, False)]],
                H100)
    assert ok.makespan_ns > 0
    with pytest.raises(ReplayError, match=r"collective #0 on group \[0, 1\]: all_reduce of S = 1048576 B on rank 0 "
                                          r"but S = 1024 B on rank 1.*charge_bytes"):
        replay([[_coll(0, 1, "all_reduce", (0, 1), MiB, False)], [_coll(0, 1, "all_reduce", (0, 1), 1024, False)]],
               H100)
    with pytest.raises(ReplayError, match=r"transfer #0 0 -> 1 \(tag 0\): S = 1048576 B on rank 0 but S = 8 B"):
        replay([[_send(0, 1, 1, MiB), ("wait", 1, 1, 1)], [_recv(0, 1, 0, 8), ("wait", 1, 1, 1)]], H100)
    # all_to_all may be uneven (MoE splits): charged at the largest
    r = replay([[_coll(0, 1, "all_to_all", (0, 1), MiB, False)], [_coll(0, 1, "all_to_all", (0, 1), 8, False)]],
               H100)
    assert r.comm[0]["nbytes"] == MiB


def test_async_work_never_waited_is_charged_at_return_and_listed():
    waited = [[_coll(0, 1, "all_reduce", (0, 1), GiB), ("s", 2, 3, 1e-4), ("wait", 4, 5, 1)]] * 2
    never = [[_coll(0, 1, "all_reduce", (0, 1), GiB), ("s", 2, 3, 1e-4)]] * 2
    a, b = replay(waited, H100), replay(never, H100)
    assert a.never_waited == [] and [x["op"] for x in b.never_waited] == ["all_reduce", "all_reduce"]
    assert b.makespan_ns == a.makespan_ns  # the rank's return waits for it: not free
    assert b.makespan_ns > 1e9 * H100.collective_s("all_reduce", GiB, (0, 1)) * 0.99


def test_a_receive_used_before_it_completes_is_a_violation_in_the_emulated_run():
    s = 256 * MiB
    good = [[("s", 0, 1, 2e-3), _send(2, 1, 1, s), ("wait", 3, 4, 1)],
            [_recv(0, 1, 0, s), ("wait", 1, 2, 1), ("c", 3, 4, 0, 64, "float32"), ("s", 5, 6, 2e-3)]]
    bad = [good[0], [_recv(0, 1, 0, s), ("use", 1, 2, 1), ("c", 1, 2, 0, 64, "float32"), ("s", 5, 6, 2e-3),
                     ("wait", 7, 8, 1)]]
    g, b = replay(good, H100), replay(bad, H100)
    assert g.violations == []
    assert len(b.violations) == 1 and b.violations[0]["rank"] == 1 and b.violations[0]["ready_ns"] > 2_000_000
    assert b.violations[0]["used_ns"] < b.violations[0]["ready_ns"]
    # a use after the transfer ended (in emulated time) is no violation
    late = [good[0], [_recv(0, 1, 0, s), ("s", 1, 2, 0.1), ("use", 3, 4, 1), ("wait", 7, 8, 1)]]
    assert replay(late, H100).violations == []


def test_unpriced_work_is_listed_and_an_emulation_above_the_share_is_incomplete():
    base = [("c", 0, 1000, 2**20, 0, "float32", "gemm", (1, 64, 64, 128)), ("c", 10_000_000, 10_001_000, 0, 8,
                                                                                "float32")]
    r = replay([base], H100)
    assert r.unpriced == [] and not r.incomplete
    hidden = base[:1] + [("u", 1000, 9_000_000, "host", 8_000_000)] + base[1:]
    r2 = replay([hidden], H100)
    assert r2.incomplete and r2.unpriced_share[0] == pytest.approx(0.8, rel=0.01) and INCOMPLETE_SHARE == 0.05
    assert r2.makespan_ns == r.makespan_ns  # still not charged: listed, and labelled
    small = base[:1] + [("u", 1000, 101_000, "linalg_inv_ex")] + base[1:]
    assert not replay([small], H100).incomplete and replay([small], H100).unpriced[0]["name"] == "linalg_inv_ex"


def test_shaped_gemms_are_priced_by_the_kernel_model():
    small = ("c", 0, 1, 2 * 8 * 8 * 4096, 0, "bfloat16", "gemm", (1, 8, 8, 4096))
    flat = small[:6]
    a, b = replay([[small]], H100).makespan_ns, replay([[flat]], H100).makespan_ns
    assert a == pytest.approx(H100.kernel_s("gemm", flops=small[3], nbytes=0, dtype="bfloat16",
                                            shape=small[7]) * 1e9, abs=1)
    assert b == pytest.approx(H100.compute_s(small[3], 0, "bfloat16") * 1e9, abs=1)


# ------------------------------------------------------------------------------------------------------
# the same programs, run for real and emulated
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wait_runs():
    from labkit.experiments.emulate import WAIT_STYLES, wait_style_rank

    return {s: launch(wait_style_rank, 2, s, emulate="dgx-h100", echo=False) for s in WAIT_STYLES}


def test_every_way_to_wait_is_a_wait(wait_runs):
    comm = H100.collective_s("all_reduce", GiB, (0, 1))
    expect = max(0.001, comm) + 0.002
    for style, run in wait_runs.items():
        if style == "never":
            continue
        assert run[0] == run[1] == 8.0, style  # the real result
        assert run.emulation.makespan_s == pytest.approx(expect, rel=0.02), style
        assert run.emulation.result.never_waited == [], style


def test_work_never_waited_is_charged_and_listed(wait_runs):
    run = wait_runs["never"]
    comm = H100.collective_s("all_reduce", GiB, (0, 1))
    # without compute/communication contention: the 3 ms of compute and the all-reduce overlap whole
    free = run.emulation.reprice(H100.replace(comm_compute_share=0.0))
    assert free.makespan_s == pytest.approx(max(0.003, comm), rel=0.02)
    # on the profile, compute beside the all-reduce is stretched by 1 / (1 - share) for the overlapped part
    c = H100.comm_compute_share
    assert max(0.003, comm) < run.emulation.makespan_s <= 0.003 + comm * c / (1 - c) + 1e-6
    assert run.emulation.makespan_s < wait_runs["wait"].emulation.makespan_s
    assert [x["op"] for x in run.emulation.result.never_waited] == ["all_reduce", "all_reduce"]
    assert len(run.emulated.attrs["never_waited"]) == 2


def test_eight_sends_cost_one_and_fan_out_costs_three():
    from labkit.experiments.emulate import link_share_rank

    t = {p: launch(link_share_rank, ws, p, emulate="dgx-h100", echo=False).emulation.makespan_s
         for p, ws in (("one", 2), ("split", 2), ("fanout", 4))}
    assert t["split"] == pytest.approx(t["one"], rel=0.02)
    assert t["fanout"] == pytest.approx(3 * t["one"], rel=0.03)


def test_two_groups_of_the_same_ranks_in_either_order():
    from labkit.experiments.emulate import two_groups_rank

    for ops in (("all_reduce", "all_reduce"), ("all_reduce", "all_gather")):
        run = launch(two_groups_rank, 2, ops, emulate="dgx-h100", echo=False)
        assert run[0] == run[1]
        assert sorted(set(run.emulation.comm_frame()["charged_nbytes"])) == [32, MiB], ops
        assert run.emulation.makespan_s < 1.5 * H100.collective_s(ops[0], MiB, (0, 1)), ops


def test_disagreeing_charge_bytes_fails_and_agreeing_does_not():
    from labkit.experiments.emulate import disagree_rank

    assert launch(disagree_rank, 2, (MiB, MiB), emulate="dgx-h100", echo=False)[0] == 8.0  # 4 x (1 + 1)
    with pytest.raises(ReplayError, match=r"all_reduce of S = 1048576 B on rank 0 but S = 1024 B on rank 1"):
        launch(disagree_rank, 2, (MiB, 1024), emulate="dgx-h100", echo=False)


def test_work_outside_torch_labels_the_emulation_incomplete():
    from labkit.experiments.emulate import hidden_work_rank

    runs = {w: launch(hidden_work_rank, 2, w, emulate="dgx-h100", echo=False) for w in ("torch", "numpy",
                                                                                       "inverse")}
    assert not runs["torch"].emulation.incomplete and "incomplete" not in runs["torch"].emulated.attrs["label"]
    for w in ("numpy", "inverse"):
        e = runs[w].emulation
        assert e.incomplete and "incomplete" in e.label and runs[w].emulated.attrs["incomplete"], w
        assert e.label.startswith("emulated (dgx-h100; incomplete: ")
    assert "linalg_inv_ex" in set(runs["inverse"].emulation.unpriced()["name"])
    assert (runs["numpy"].emulation.unpriced()["what"] == "host").all()


def test_a_pipeline_that_reads_its_receive_early_is_flagged_in_the_emulated_frame():
    from labkit.experiments.emulate import early_recv_rank

    good = launch(early_recv_rank, 2, False, emulate="dgx-h100", echo=False)
    bad = launch(early_recv_rank, 2, True, emulate="dgx-h100", echo=False)
    assert good.emulated.attrs["dependency_violations"] == [] and good[1] == 16.0
    v = bad.emulated.attrs["dependency_violations"]
    assert len(v) == 1 and v[0].startswith("rank 1: recv read at") and "dependency violation" in bad.emulation.label
    assert bad.emulation.makespan_s < good.emulation.makespan_s  # the early read skipped the wait: flagged
