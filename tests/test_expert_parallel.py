"""Mixture of experts and expert parallelism: routing, capacity, residual, and EP parity on gloo.

Parity tolerance: fp32, ``labkit.models.TOLERANCES[torch.float32]`` (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch

from labkit import launch
from labkit.chapters import ch08_expert_parallel as ch08
from labkit.experiments import expert as epe
from labkit.models import TOLERANCES, build_model
from labkit.parallel import expert as ex
from labkit.theory import expert as ept
from labkit.theory.spec import get_spec

TOL = TOLERANCES[torch.float32]
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------
# single process
# ------------------------------------------------------------------------------------------------------
def test_validation_messages():
    with pytest.raises(ValueError, match=r"ep=3 does not divide n_experts=8; valid ep: 1, 2, 4, 8"):
        ept.check_expert_parallel(8, ep=3)
    with pytest.raises(ValueError, match=r"top_k=9 must be <= n_experts=8"):
        ept.check_expert_parallel(8, top_k=9)
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be a finite number > 0"):
        ept.check_expert_parallel(8, capacity_factor=0)
    with pytest.raises(ValueError, match=r"drop_policy='random' is not valid; choose one of: position, score"):
        ept.check_expert_parallel(8, drop_policy="random")
    with pytest.raises(ValueError, match=r"top_k=3 must be <= n_experts=2"):
        ex.MoE(8, 16, 2, 3)


@pytest.mark.parametrize("args, match", [
    ((100, 0, 2, 1.0), r"n_experts=0 must be an integer >= 1"),
    ((100, 8, 9, 1.0), r"top_k=9 must be <= n_experts=8"),
    ((100, 8, 0, 1.0), r"top_k=0 must be an integer >= 1"),
    ((-1, 8, 2, 1.0), r"n_tokens=-1 must be an integer >= 0"),
    ((100, 8, 2, 0.0), r"capacity_factor=0.0 must be a finite number > 0"),
    ((100, 8, 2, float("inf")), r"capacity_factor=inf must be a finite number > 0"),
    ((100, 8, 9, None), r"top_k=9 must be <= n_experts=8"),  # checked even without a capacity limit
])
def test_expert_capacity_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        ept.expert_capacity(*args)
    with pytest.raises(ValueError, match=match):
        ept.predicted_dropped_fraction(*args)


CHAPTER = dict(world_size=2, tokens_per_rank=256, hidden_size=64, ffn_hidden_size=128, n_experts=8, top_k=2,
               capacity_factor=1.25, capacity_factors=[0.5, 1.0, 2.0], repeats=3, spec="lab-tiny-moe")


@pytest.mark.parametrize("change, match", [
    ({"world_size": 1}, r"chapter 08 needs world_size >= 2, got world_size=1: expert parallelism "),
    ({"world_size": 3}, r"ep=world_size=3 does not divide n_experts=8 .*pass every rule of chapter 08 with "
                        r"n_experts=8: 2, 4, 8;"),
    ({"top_k": 9}, r"top_k=9 must be <= n_experts=8"),
    ({"capacity_factor": 0}, r"capacity_factor=0 must be a finite number > 0"),
    ({"capacity_factors": []}, r"capacity_factors=\[\] is empty"),
    ({"capacity_factors": [1.0, 0.5]}, r"capacity_factors=\[1.0, 0.5\] must be strictly increasing"),
    ({"capacity_factors": [0.5, -1]}, r"capacity_factors\[\]=-1 must be a finite number > 0"),
    ({"capacity_factors": "0.5"}, r"capacity_factors='0.5' must be a list"),
    ({"tokens_per_rank": 0}, r"tokens_per_rank=0 must be an integer >= 1"),
    ({"repeats": 0}, r"repeats=0 must be an integer >= 1"),
    ({"spec": "lab-tiny-llama"}, r"spec='lab-tiny-llama' has n_experts=0 .*choose an MoE preset: .*lab-tiny-moe"),
    ({"spec": "nope"}, r"unknown model preset 'nope'"),
    ({"backend": "mpi"}, r"backend='mpi' is not valid"),
])
def test_check_chapter_rejects_before_launch(change, match):
    ch08.check_chapter(**CHAPTER)  # the chapter's defaults are valid
    with pytest.raises(ValueError, match=match):
        ch08.check_chapter(**{**CHAPTER, **change})


def test_check_chapter_lists_only_ep_values_that_pass():
    """The tester's world_size=3 case listed "valid ep: 1, 2, 4, 8", though 1 is refused (ep >= 2)."""
    for n_experts in (8, 6, 12, 7):
        valid = ch08.chapter_ep_degrees(n_experts)
        assert valid and 1 not in valid
        for e in valid:
            ch08.check_chapter(**{**CHAPTER, "world_size": e, "n_experts": n_experts, "backend": "gloo"})
    with pytest.raises(ValueError, match=r"n_experts=1: choose an n_experts with a divisor >= 2"):
        ch08.check_chapter(**{**CHAPTER, "world_size": 2, "n_experts": 1, "top_k": 1})


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("n_experts", [2, 8, 64])
@pytest.mark.parametrize("top_k", [1, 2])
def test_parity_tokens_make_capacity_half_drop(world_size, n_experts, top_k):
    n = epe.parity_tokens(world_size, n_experts, top_k)
    n_local = n // world_size  # the even placement's smallest share
    assignments = n_local * top_k
    kept_at_most = ept.expert_capacity(n_local, n_experts, top_k, 0.5) * n_experts
    assert kept_at_most < assignments  # pigeonhole: some assignment must be dropped


def test_a2a_bytes_table_labels_every_number():
    fake = [{"rank": r, "stats": {"send_rows": [3, 5], "dispatch_total_bytes": 8 * 4, "dispatch_bytes": 5 * 4
                                  if r == 0 else 3 * 4, "combine_bytes": 12}} for r in range(2)]
    df = epe.a2a_bytes_table(fake)
    assert all(c == "rank" or c.startswith(("measured_", "predicted_")) for c in df.columns), list(df.columns)
    assert df["predicted_offrank_bytes"].tolist() == [16.0, 16.0]
    assert df["measured_offrank_bytes"].tolist() == [20, 12]


def test_capacity_and_drop_policies():
    # 6 tokens, 3 experts, top-1, every token prefers expert 0; capacity = ceil(1.0 * 6 * 1 / 3) = 2
    logits = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0, 0], [3.0, 0, 0], [4.0, 0, 0], [5.0, 0, 0], [6.0, 0, 0]])
    r = ex.route(logits, 1, 1.0, drop_policy="position")
    assert r.capacity == 2
    assert r.keep[:, 0].tolist() == [True, True, False, False, False, False]  # first come, first served
    r = ex.route(logits, 1, 1.0, drop_policy="score")
    assert r.keep[:, 0].tolist() == [False, False, False, False, True, True]  # most confident first
    st = r.stats()
    assert st["dropped"] == 4 and st["dropped_tokens"] == 4 and st["overflow_per_expert"] == [4, 0, 0]
    # top-2 with position policy: every token's first choice outranks any second choice
    logits2 = torch.tensor([[2.0, 1.0, 0.0]] * 4)
    r = ex.route(logits2, 2, 1.0)  # capacity ceil(4*2/3) = 3
    assert r.capacity == 3 and r.keep[:, 0].tolist() == [True, True, True, False]
    assert r.keep[:, 1].tolist() == [True, True, True, False]
    assert ex.route(logits2, 2, None).keep.all()


def test_predicted_dropped_fraction():
    fr = [ept.predicted_dropped_fraction(256, 8, 2, cf) for cf in (0.5, 1.0, 1.25, 2.0)]
    assert fr[0] >= 0.5 - 1e-9  # at most half of the assignments fit
    assert fr == sorted(fr, reverse=True) and fr[-1] < 1e-6
    assert ept.predicted_dropped_fraction(256, 8, 2, None) == 0.0


def test_moe_matches_a_per_token_loop():
    torch.manual_seed(0)
    moe = ex.MoE(8, 12, 4, 2, capacity_factor=0.75)
    x = torch.randn(10, 8)
    y = moe(x)
    r = moe.last_routing
    assert r.stats()["dropped"] > 0
    ref = torch.zeros_like(x)
    for t in range(10):
        for s in range(2):
            if r.keep[t, s]:
                ref[t] += r.gate[t, s] * moe.experts[int(r.expert[t, s])](x[t:t + 1])[0]
    torch.testing.assert_close(y, ref.detach(), **TOL)


def test_moe_model_preset_and_dropped_tokens_ride_the_residual():
    spec = get_spec("lab-tiny-moe")
    model = build_model(spec, seed=0)
    assert sum(p.numel() for p in model.parameters()) == spec.n_params()
    assert spec.n_active_params() < spec.n_params()
    ex.set_capacity_factor(model, 0.25)
    block = model.layers[0]
    x = torch.randn(1, 32, spec.hidden_size)
    h = x + block.attn(block.attn_norm(x))  # the residual stream entering the MoE sub-layer
    out = block(x)
    dropped = ~block.mlp.last_routing.keep.any(-1)
    assert dropped.sum() > 0
    out_rows, h_rows = out.reshape(-1, spec.hidden_size), h.reshape(-1, spec.hidden_size)
    assert torch.equal(out_rows[dropped], h_rows[dropped])  # passed through unchanged ...
    assert (out_rows[dropped].norm(dim=-1) > 0).all()  # ... never a zero vector
    # the MoE contribution alone is zero for them: without the residual they would vanish
    moe_only = block.mlp(block.mlp_norm(h)).reshape(-1, spec.hidden_size)
    assert torch.equal(moe_only[dropped], torch.zeros_like(moe_only[dropped]))
    # the whole model trains: loss backward reaches the router and the experts
    ex.set_capacity_factor(model, None)
    model(torch.randint(0, spec.vocab_size, (2, 16))).float().logsumexp(-1).mean().backward()
    assert model.layers[0].mlp.router.weight.grad.abs().sum() > 0


def test_dense_vs_moe_table():
    df = epe.dense_vs_moe(batch=1, seq_len=8, repeats=1)
    moe, dense = df.set_index("model").loc["moe"], df.set_index("model").loc["dense-active"]
    assert moe["params_measured"] == moe["params_predicted"] > 2 * dense["params_measured"]
    # sanity (the formula on both specs, not evidence): the dense twin has the MoE's active FLOPs
    assert abs(moe["flops_per_token_predicted"] / dense["flops_per_token_predicted"] - 1) < 0.02
    # independent: torch's FlopCounterMode on each model's forward (the router and the top_k experts that ran):
    # within 1 % under the formula (N holds the norm weights, which are no matmul: 0.25 % here), and equal FLOPs
    for row in (moe, dense):
        assert 0.99 <= row["flops_per_token_counted"] / row["flops_per_token_predicted"] <= 1.0, row
    assert abs(moe["flops_per_token_counted"] / dense["flops_per_token_counted"] - 1) < 0.02


# ------------------------------------------------------------------------------------------------------
# multi-process (gloo)
# ------------------------------------------------------------------------------------------------------
def _recount(rows, n_experts, top_k, cf):
    """Dropped assignments, counted independently: per rank, per expert, max(0, routed - capacity)."""
    dropped = 0
    for row in rows:
        n = row["n_local"]
        cap = math.ceil(cf * n * top_k / n_experts)
        counts = collections.Counter(e for choices in row["expert"] for e in choices)
        dropped += sum(max(0, c - cap) for c in counts.values())
    return dropped


def _ep_everything(ctx):
    parity = epe.ep_parity_rank(ctx, capacity_factors=(None, 0.5, 1.0))
    profile = epe.ep_profile_rank(ctx, tokens_per_rank=64, hidden_size=16, ffn_hidden_size=16,
                                 n_experts=2 * ctx.world_size, repeats=1)
    return {"parity": parity, "profile": profile}


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel(world_size):
    # a hang (e.g. mismatched all-to-all shapes) becomes a LaunchTimeout, not a stuck test run
    res = launch(_ep_everything, world_size, timeout_s=150, echo=False)
    rows = [row for r in res for row in r["parity"]]
    bad = [{k: v for k, v in row.items() if k != "expert"} for row in rows if not row["ok"]]
    assert not bad, f"EP parity failed: {bad}"
    assert all(row["residual_ok"] for row in rows)
    # uneven and zero counts happened: a rank with no tokens, and a rank sending nothing to some expert
    assert any(row["n_local"] == 0 for row in rows)
    assert any(0 in row["stats"]["send_counts"] for row in rows if row["n_local"] > 0)
    assert len({row["n_local"] for row in rows if row["placement"] == "skewed"}) > 1
    n_experts = 2 * world_size
    for (kind, cf), group in _group(rows).items():
        glob = group[0]["global"]
        assert all(row["global"] == glob for row in group)  # every rank agrees on the global counts
        if cf is None:
            assert glob["dropped"] == 0
        else:
            assert glob["dropped"] == _recount(group, n_experts, 2, cf), (kind, cf)
            if cf == 0.5:
                assert glob["dropped"] > 0 and sum(row["fully_dropped"] for row in group) > 0
    # profile: the dispatch all-to-all moved exactly the rows routed, counts first
    for r in res:
        prof = r["profile"]
        nbytes = [c["nbytes"] for c in prof["comm"]]
        assert nbytes[0] == n_experts * 8  # the int64 counts
        assert nbytes[1] == prof["stats"]["dispatch_total_bytes"]
        sweep = [s["dropped_fraction"] for s in prof["sweep"]]
        assert sweep == sorted(sweep, reverse=True)
    names = set(res.timeline["name"])
    assert {"route", "a2a counts", "dispatch", "experts", "combine", "dispatch bwd", "combine bwd"} <= names


def _group(rows):
    out = collections.defaultdict(list)
    for row in rows:
        out[(row["placement"], row["capacity_factor"])].append(row)
    return out
