"""The symmetric heap and the fine-grained overlap patterns (labkit.parallel.onesided): parity with the plain
versions and a one-process reference, bounded waits, nothing left in /dev/shm, and the closed form of
labkit.theory.overlap against an event-by-event simulation it did not compute."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from labkit import launch
from labkit.runtime.launcher import RankFailed
from labkit.theory import overlap

FP32 = {"rtol": 1e-6, "atol": 1e-6}


def _segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("labkit-heap-")} if os.path.isdir("/dev/shm") else set()


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------
# rank functions
# ------------------------------------------------------------------------------------------------------
def heap_basics(ctx):
    from labkit.parallel.onesided import SymmetricHeap

    r, n = ctx.rank, ctx.world_size
    with SymmetricHeap(1024, n_flags=4) as heap:
        right = (r + 1) % n
        heap.put(right, torch.full((8,), float(r)), offset=64)
        heap.signal(right, 1, 7)
        heap.wait_until(1, 7)
        mine = heap.view(r, (8,), torch.float32, offset=64).clone()
        peer = heap.get(right, (8,), torch.float32, offset=64)
        errors = []
        for bad in (lambda: heap.put(right, torch.zeros(300), offset=0), lambda: heap.signal(n, 0),
                    lambda: heap.wait_until(9, 1)):
            try:
                bad()
            except ValueError as e:
                errors.append(str(e))
        try:
            heap.wait_until(2, 1, timeout_s=0.2)
        except TimeoutError as e:
            errors.append(str(e))
        heap.barrier()
        return {"mine": mine.tolist(), "peer": peer.tolist(), "errors": errors, "name": heap.name}


def heap_then_die(ctx):
    from labkit.parallel.onesided import SymmetricHeap

    heap = SymmetricHeap(4096)
    heap.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    heap.wait_until(0, 1, timeout_s=30)


def heap_under_emulation(ctx):
    from labkit.parallel.onesided import SymmetricHeap

    SymmetricHeap(64)


def patterns(ctx, chunks=(1, 2, 4)):
    import torch.distributed as dist

    from labkit.parallel import onesided as os_

    r, n = ctx.rank, ctx.world_size
    N, H, F = 16, 12, 8 * n
    x_full, w_full = _data(0, N, H), _data(1, H, F)
    m = N // n
    out = {}
    # column-parallel: this rank's sequence shard and weight column block
    xs, wc = x_full[r * m:(r + 1) * m], w_full[:, r * (F // n):(r + 1) * (F // n)]
    out["ag_plain"] = os_.allgather_matmul(xs, wc, ctx=ctx)
    out["ag"] = {c: os_.allgather_matmul_chunked(xs, wc, c, ctx=ctx) for c in chunks}
    # row-parallel: full-sequence activations' column block, weight row block
    hb = H // n
    xr, wr = x_full[:, r * hb:(r + 1) * hb], _data(2, H, F)[r * hb:(r + 1) * hb]
    out["rs_plain"] = os_.matmul_reducescatter(xr, wr)
    out["rs"] = {c: os_.matmul_reducescatter_chunked(xr, wr, c, ctx=ctx) for c in chunks}
    # producer / consumer by tiles; re-partition
    w2 = _data(3, F // n, 5)
    out["tiles_two"], _ = os_.tiles_two_sided(xs, wc, w2, 2)
    S, B = 3, 2 * n
    act = _data(4, S, B, H)[:, :, r * hb:(r + 1) * hb]  # [S, B, H/n]: this rank's heads
    with os_.SymmetricHeap(4 * max(m * (F // n), S * (B // n) * H), n_flags=n + 1) as heap:
        out["tiles_one"], out["tiles_stats"] = os_.tiles_one_sided(heap, xs, wc, w2, 2, flag=n)
        out["tiles_one_again"], _ = os_.tiles_one_sided(heap, xs, wc, w2, 2, flag=n, epoch=2)
        out["rep_one"], out["rep_one_stats"] = os_.repartition_onesided(heap, act.contiguous())
    out["rep_a2a"], out["rep_a2a_stats"] = os_.repartition_alltoall(act.contiguous())
    try:
        os_.allgather_matmul_chunked(xs, wc, 3 if m % 3 else 5)
    except ValueError as e:
        out["chunk_error"] = str(e)
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_heap_put_get_signal_and_bounded_waits(n):
    before = _segments()
    res = launch(heap_basics, n, timeout_s=120)
    for r, row in enumerate(res):
        left = (r - 1) % n
        assert row["mine"] == [float(left)] * 8, "the left neighbour's put landed in this rank's slot"
        assert row["peer"] == [float(r)] * 8, "a get reads the peer's slot: what this rank put there"
        assert "does not fit" in row["errors"][0] and "dst=" in row["errors"][1] and "flag=9" in row["errors"][2]
        assert f"rank {r}: flag 2 still 0" in row["errors"][3]
    assert _segments() == before, "the segment's name was unlinked once every rank had mapped it"


def test_a_killed_rank_leaves_no_segment():
    before = _segments()
    with pytest.raises(RankFailed) as e:
        launch(heap_then_die, 2, timeout_s=60)
    assert e.value.rank == 1
    assert _segments() == before


def test_sweep_removes_only_dead_creators_segments(tmp_path):
    from labkit.parallel.onesided import heap

    dead = tmp_path / f"{heap.PREFIX}999999999-abc"
    live = tmp_path / f"{heap.PREFIX}{os.getpid()}-abc"
    other = tmp_path / "something-else"
    for p in (dead, live, other):
        p.write_bytes(b"x")
    assert heap.sweep_stale(str(tmp_path)) == [dead.name]
    assert live.exists() and other.exists() and not dead.exists()


def test_the_heap_refuses_to_be_emulated():
    with pytest.raises(RankFailed, match="cannot be emulated"):
        launch(heap_under_emulation, 2, emulate="dgx-h100", timeout_s=120)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def run(request):
    n = request.param
    return n, launch(patterns, n, timeout_s=300)


def test_chunked_allgather_matmul_equals_plain_and_reference(run):
    n, res = run
    N, H, F = 16, 12, 8 * n
    want = _data(0, N, H) @ _data(1, H, F)
    for r, row in enumerate(res):
        block = want[:, r * (F // n):(r + 1) * (F // n)]
        torch.testing.assert_close(row["ag_plain"], block, **FP32)
        for c, y in row["ag"].items():
            torch.testing.assert_close(y, row["ag_plain"], **FP32, msg=f"{c} chunks, rank {r}")
        assert "must divide" in row["chunk_error"]


def test_chunked_matmul_reducescatter_equals_plain_and_reference(run):
    n, res = run
    N, H, F = 16, 12, 8 * n
    want = _data(0, N, H) @ _data(2, H, F)
    m = N // n
    for r, row in enumerate(res):
        torch.testing.assert_close(row["rs_plain"], want[r * m:(r + 1) * m], **FP32)
        for c, y in row["rs"].items():
            torch.testing.assert_close(y, row["rs_plain"], **FP32, msg=f"{c} chunks, rank {r}")


def test_tiles_one_sided_equal_two_sided(run):
    n, res = run
    for row in res:
        torch.testing.assert_close(row["tiles_one"], row["tiles_two"], **FP32)
        torch.testing.assert_close(row["tiles_one_again"], row["tiles_two"], **FP32)
        assert row["tiles_stats"]["messages"] == 2


def test_repartition_one_sided_equals_all_to_all_with_no_passes(run):
    n, res = run
    S, B, H = 3, 2 * n, 12
    full = _data(4, S, B, H)
    for r, row in enumerate(res):
        want = full[:, r * (B // n):(r + 1) * (B // n)]  # [S, B/n, H]
        torch.testing.assert_close(row["rep_a2a"], want, rtol=0, atol=0)
        torch.testing.assert_close(row["rep_one"], want, rtol=0, atol=0)
        a, o = row["rep_a2a_stats"], row["rep_one_stats"]
        assert a["moved_bytes"] == o["moved_bytes"] > 0
        assert (a["passes"], o["passes"]) == (2, 0) and o["extra_bytes"] == 0 < a["extra_bytes"]


def test_the_runs_recorded_one_event_per_chunk(run):
    n, res = run
    # the launch result's timeline: ag[i] / mm[i] events of the chunked calls (4 chunks: ag[3] exists)
    # (read through the rank results: the chunked calls ran with ctx)
    assert res.timeline is not None
    names = set(res.timeline["name"])
    assert {"ag[3]", "mm[3]", "rs[3]"} <= names


# ------------------------------------------------------------------------------------------------------
# the closed form, against an event-by-event simulation of the two-stage pipeline
# ------------------------------------------------------------------------------------------------------
def _simulate(nbytes, compute_s, alpha, beta, c):
    """One comm stream, one compute stream: chunk i's transfer after chunk i-1's; its compute after its own
    transfer and chunk i-1's compute."""
    comm_end = comp_end = 0.0
    for _ in range(c):
        comm_end = comm_end + alpha + beta * nbytes / c
        comp_end = max(comp_end, comm_end) + compute_s / c
    return comp_end


@pytest.mark.parametrize("c", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("shape", [(2**27, 2e-4, 5e-6, 1 / 370e9), (2**20, 1e-3, 20e-6, 1 / 20e9),
                                   (2**30, 1e-5, 1e-6, 1 / 100e9)])
def test_closed_form_matches_an_event_simulation(shape, c):
    s, comp, a, b = shape
    row = overlap.chunked_overlap(nbytes=s, compute_s=comp, alpha_s=a, beta_s_per_byte=b, n_chunks=c)
    assert row["makespan_s"] == pytest.approx(_simulate(s, comp, a, b, c), rel=1e-12)
    if c == 1:
        assert row["makespan_s"] == pytest.approx(row["serial_s"]) and row["hidden_fraction"] == 0


def test_the_best_chunk_count_moves_with_message_size_and_latency():
    kw = {"compute_s": 2e-4, "alpha_s": 10e-6, "beta_s_per_byte": 1 / 370e9}
    small = overlap.best_chunks(nbytes=2**22, **kw)  # compute-bound: chunks until a transfer outlasts C/c
    big = overlap.best_chunks(nbytes=2**28, **kw)  # comm-bound: c* ~ sqrt(C / alpha) = sqrt(20)
    assert small["bound"] == "compute" or small["n_chunks"] > big["n_chunks"]
    assert 1 < big["n_chunks"] < small["n_chunks"] < 256, (small["n_chunks"], big["n_chunks"])
    assert abs(big["n_chunks"] - (2e-4 / 10e-6) ** 0.5) <= 1
    # without a per-chunk latency more chunks never lose: the optimum runs to the search's end
    assert overlap.best_chunks(nbytes=2**28, compute_s=2e-4, alpha_s=0, beta_s_per_byte=1 / 370e9,
                               max_chunks=64)["n_chunks"] == 64


def test_repartition_cost_counts_passes_and_refuses_bad_shapes():
    row = overlap.repartition_cost(batch=8, seq_len=4096, hidden_size=8192, tp=8)
    assert row["moved_bytes"] == row["local_bytes"] * 7 // 8
    assert row["alltoall_memory_traffic_bytes"] == 3 * row["onesided_memory_traffic_bytes"]
    with pytest.raises(ValueError, match="tp=3 must divide"):
        overlap.repartition_cost(batch=8, seq_len=1, hidden_size=8, tp=3)
    with pytest.raises(ValueError, match="n_chunks"):
        overlap.chunked_overlap(nbytes=1, compute_s=1, alpha_s=0, beta_s_per_byte=0, n_chunks=0)
