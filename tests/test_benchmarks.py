"""The benchmarks' own honesty: no speed ratio of two variants that trained different models, no reference file
written from bad rows, and launch vs torchrun timed the same way. (Each benchmark's goal and exit status are
tested beside its strategy: tests/test_data_parallel.py, test_pipeline.py, test_tensor_parallel.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _alone(module, ctx, *, lr, **options):
    """A fast but wrong data-parallel variant: no gradient sync, each rank trains on its own shard."""
    from labkit.models import make_optimizer

    return module, make_optimizer(module.parameters(), lr)


TINY = dict(model="lab-tiny-llama", steps=1, repeats=2, global_batch_size=4, seq_len=16)


def test_throughput_rank_checks_that_pairs_trained_the_same_model():
    """bucket vs DDP train the same model (every step's loss and the final weights within fp32 tolerance);
    a variant without gradient sync does not, and throughput_rank raises instead of returning its speed."""
    from labkit import launch

    def rank(ctx, alone):
        from labkit.experiments import common, data

        wrappers = {**data.WRAPPERS, "alone": alone}
        runs = [{"variant": "bucket", "bucket_cap_bytes": 1 << 16},
                {"variant": "ddp", "bucket_cap_bytes": 1 << 16, "log_comm": False}, {"variant": "alone"}]
        honest = common.throughput_rank(ctx, wrappers, runs, same_model=[("bucket", "ddp")], **TINY)
        try:
            common.throughput_rank(ctx, wrappers, runs, same_model=[("alone", "ddp")], **TINY)
            err = None
        except common.ParityError as e:
            err = str(e)
        return honest.parity, dict(honest), err

    parity, tps, err = launch(rank, 2, _alone, echo=False)[0]
    assert set(tps) == {"bucket", "ddp", "alone"} and all(len(v) == 2 for v in tps.values())
    (row,) = parity
    assert row["pair"] == "bucket/ddp" and row["same"] and row["max_loss_diff"] < 1e-5, row
    assert err is not None and "alone/ddp did not train the same model" in err, err


def test_dp_benchmark_prints_no_ratio_for_a_variant_that_trains_another_model(monkeypatch, capsys):
    """benchmarks/dp_vs_torch.py with its "bucket" variant replaced by one that skips the gradient all-reduce
    (faster, and wrong): the launch fails with the parity error, no ratio is printed, exit 1. (Before, the ratio
    was computed from tokens/s alone: a fast wrong variant met its goal.)"""
    import labkit
    from labkit.cli import run_main

    bench = _load("dp_vs_torch")

    def launch(fn, n, wrappers, runs, **kw):
        kw.update(TINY)
        return labkit.launch(fn, n, {**wrappers, "bucket": _alone}, runs, echo=False, **kw)

    monkeypatch.setattr(bench, "launch", launch)
    assert run_main("dp_vs_torch", lambda: bench.main([])) == 1
    out = capsys.readouterr()
    assert "ratio" not in out.out and "bucket/ddp did not train the same model" in out.err, out


@pytest.mark.parametrize("pairs", [[("bucket", "nope")]])
def test_same_model_must_name_runs(pairs):
    from labkit.experiments import common

    class Ctx:
        device = "cpu"

    with pytest.raises(ValueError, match=r"same_model names 'nope', not a run; runs: bucket"):
        common.throughput_rank(Ctx(), {"bucket": _alone}, [{"variant": "bucket"}], same_model=pairs, **TINY)


def test_collectives_overhead_checks_both_paths_values_before_the_ratio(monkeypatch, capsys):
    """benchmarks/collectives_overhead.py: both paths' outputs are value-checked every round (the labkit rows'
    ``wrong`` column was the constant 0 and its sweep ran with verify=False); a wrong value on either path prints
    no ratio and exits 1."""
    import labkit

    bench = _load("collectives_overhead")
    real = labkit.launch

    def broken(fn, n, cases, warmup, repeats, **kw):
        res = real(fn, n, cases, warmup, repeats, **kw)
        for i, (lab, bare) in enumerate(res):  # the bare loop's values came out wrong on every rank, repeat 1
            res[i] = (lab, [r[:5] + (7 if r[3] == 1 else r[5],) for r in bare])
        return res

    monkeypatch.setattr(bench, "launch", real)
    argv = ["--repeats", "2", "--min-size", "4K", "--max-size", "4K", "--ops", "all_reduce,all_to_all"]
    assert bench.main(argv) in (0, 1)  # honest values: a ratio, met or not on a shared machine
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("busbw ratio labkit/bare:")
    monkeypatch.setattr(bench, "launch", broken)
    assert bench.main(argv) == 1
    out = capsys.readouterr()
    assert "ratio labkit/bare" not in out.out and "wrong values" in out.err and "'path': 'bare'" in out.err, out


def test_collectives_overhead_bare_loop_check_catches_a_broken_op():
    """The bare loop's own value check is real: with all_reduce patched (inside the ranks) to do nothing, the
    check counts wrong elements."""
    from labkit import launch

    def rank(ctx, load):
        import torch.distributed as dist

        bench = load("collectives_overhead")
        _, honest = bench.bare_rank(ctx, "all_reduce", 1024, 1, 1, verify=True)
        dist.all_reduce = lambda *a, **k: None
        _, broken = bench.bare_rank(ctx, "all_reduce", 1024, 1, 1, verify=True)
        return honest, broken

    for honest, broken in launch(rank, 2, _load, echo=False):
        assert honest == 0 and broken > 0


def _sweep_table(flag="", wrong=0, timing="synchronised"):
    from labkit.experiments import collectives as col

    raw = col.raw_frame([[("all_reduce", s, s // 4, rep, 1e-4 + s / 100e9, 0) for s in (1024, 4096)
                          for rep in range(3)] for _ in range(2)])
    df = col.summarize(raw, 2, backend="nccl", timing=timing)
    df.loc[1, "flag"] = flag
    df.loc[1, "wrong"] = wrong
    return df


@pytest.mark.parametrize("bad", [dict(flag="flat: time does not grow with size"), dict(wrong=5)])
def test_record_gpu_collectives_refuses_to_record_bad_rows(bad, tmp_path, monkeypatch, capsys):
    """benchmarks/record_gpu_collectives.py: a sweep with a flagged synchronised row or wrong values is printed,
    nothing is recorded, exit 1 (before, it wrote the reference file and exited 0 with a warning)."""
    import torch

    from labkit.runtime import records

    bench = _load("record_gpu_collectives")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(records, "identity", lambda *a, **k: {"gpus": ["NVIDIA H100 80GB HBM3"] * 2})
    out = tmp_path / "ref.json"
    monkeypatch.setattr(bench.col, "sweep", lambda *a, **k: _sweep_table(**bad))
    assert bench.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert not out.exists() and "nothing recorded" in err and "all_reduce" in err, err
    monkeypatch.setattr(bench.col, "sweep", lambda *a, **k: _sweep_table())
    assert bench.main(["--out", str(out)]) == 0 and out.exists()


def test_reference_writers_refuse_bad_rows(tmp_path):
    """The library's writers refuse what the benchmark refuses (a caller that skips the check writes nothing):
    flagged synchronised rows, wrong values, CPU rows; flagged unsynchronised rows are what they are for."""
    from labkit.experiments import collectives as col

    ident = {"gpus": ["NVIDIA H100 80GB HBM3"] * 2}
    for bad, match in ((_sweep_table(flag="too fast"), "flagged: too fast"), (_sweep_table(wrong=2), "2 wrong"),
                       (_sweep_table().assign(backend="gloo"), "backend gloo, not nccl")):
        with pytest.raises(ValueError, match=match):
            col.write_reference(bad, ident, tmp_path / "x.json")
        assert not (tmp_path / "x.json").exists()
    demo = _sweep_table(flag="too fast", timing="unsynchronised")
    assert col.bad_reference_rows(demo).empty
    assert col.write_reference(demo, ident, tmp_path / "ok.json").exists()


def test_launch_overhead_times_torchrun_the_same_way_as_ours(monkeypatch, capsys):
    """benchmarks/launch_overhead.py: the headline ratio compares labkit.launch started from a fresh interpreter
    with torchrun (which starts one too), not the in-process launch (before: an interpreter start was in torchrun's
    time only). Fakes: an interpreter start costs 0.2 s, a launch 0.05 s."""
    import sys
    import time

    bench = _load("launch_overhead")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        time.sleep(0.2 + 0.05 if cmd[0] == sys.executable else 0.2 + 0.1)  # ours vs torchrun's agent + workers

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "launch", lambda *a, **k: time.sleep(0.05))
    assert bench.main(["--world-size", "2", "--repeats", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("ratio launch/torchrun wall time, both from a fresh interpreter")
    headline = float(lines[-1].split("= ")[1].split()[0])
    assert headline == pytest.approx(0.25 / 0.3, abs=0.1), lines[-1]  # not 0.05 / 0.3, the in-process ratio
    assert "ratio in-process launch/torchrun" in lines[-2] and "not like for like" in lines[-2]
    ours = [c for c in calls if c[0] == sys.executable]
    assert len(ours) == 3 and all(Path(c[1]).name.endswith("_ours.py") for c in ours)
    assert sum("--standalone" in c for c in calls) == 3
