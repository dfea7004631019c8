"""labkit.runtime.fake: one child process plays every rank of a fake world at full shapes."""

from __future__ import annotations

import pytest

from labkit.runtime.fake import FakeDataError, launch_fake, mesh_roles, relabel, shift_perm
from labkit.theory.mesh import ParallelDims


def _matmul_allreduce(ctx, n=4096):
    import torch
    import torch.distributed as dist

    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = a @ a  # no arithmetic happens: a fake tensor has shape and dtype only
    dist.all_reduce(b)
    return {"rank": ctx.rank, "backend": ctx.backend, "shape": tuple(b.shape), "nbytes": b.numel() * b.element_size()}


def _item(ctx):
    import torch

    return float(torch.randn(3).sum())


def _returns_tensor(ctx):
    import torch

    return {"x": torch.ones(2)}


def test_every_rank_runs_at_full_shape_in_one_child():
    res = launch_fake(_matmul_allreduce, 4)
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    assert all(r["backend"] == "fake" and r["shape"] == (4096, 4096) for r in res)
    assert res.traced == [0, 1, 2, 3] and res.backend == "fake"


def test_data_is_refused_with_the_operation_named():
    with pytest.raises(FakeDataError, match="_local_scalar_dense"):
        launch_fake(_item, 2)
    with pytest.raises(FakeDataError, match=r"returned a tensor \(result\['x'\]"):
        launch_fake(_returns_tensor, 2)


def test_launch_switch_and_bad_roles():
    from labkit import launch

    res = launch(_matmul_allreduce, 2, fake=True)
    assert res.backend == "fake" and res[1]["rank"] == 1
    with pytest.raises(ValueError, match="not a traced rank"):
        launch_fake(_matmul_allreduce, 4, roles={0: 0, 1: 0, 2: 1, 3: 0})  # 1 maps to 0, so 2 -> 1 is invalid


def test_mesh_roles_and_relabel_map_groups_onto_groups():
    dims = ParallelDims(16, dp=2, tp=4, pp=2)
    roles = mesh_roles(dims, symmetric=("dp", "tp"))
    assert sorted(set(roles.values())) == [dims.rank_of(dp=0, tp=0, pp=0), dims.rank_of(dp=0, tp=0, pp=1)]
    src, dst = dims.rank_of(dp=0, tp=0, pp=1), dims.rank_of(dp=1, tp=3, pp=1)
    perm = shift_perm(dims, src, dst)
    assert perm(src) == dst
    groups = {d: {tuple(g) for g in dims.groups(d)} for d in ("dp", "tp", "pp")}
    for gs in groups.values():
        for g in gs:  # every group of every dim lands on a group of the same dim: the relabelled trace is valid
            assert tuple(sorted(perm(x) for x in g)) in gs
    tp_group = next(tuple(g) for g in dims.groups("tp") if src in g)
    ev = [("coll", 0, 1, 1, "all_reduce", tp_group, 64, False, {}), ("p2p", 1, 2, 2, "send", 0, 0, 8, True, {})]
    out = relabel(ev, perm)
    assert dst in out[0][5] and out[0][5] in groups["tp"] and out[1][5] == perm(0) != 0


def test_emulated_fake_run_prices_the_real_shapes():
    """A wrong pricing of fake tensors (the base tracer hands them on unpriced) would give compute 0."""
    dims = ParallelDims(8, dp=8)
    res = launch_fake(_matmul_allreduce, 8, roles=mesh_roles(dims), dims=dims, emulate="dgx-h100")
    assert res.traced == [0]
    r = res.emulation.result
    flops = 2 * 4096 ** 3
    peak = res.emulation.cluster.device.peak_flops("bf16")
    assert r.compute_ns[5] >= flops / peak * 1e9 * 0.99  # at least the matmul at full peak, on a rank not traced
    assert len({c["group"] for c in r.comm}) == 1 and len(r.comm) == 8  # one all_reduce, all eight members
