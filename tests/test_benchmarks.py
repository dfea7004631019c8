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
