"""ParallelDims: validation (hypothesis against an independent oracle), the rank grid, node placement, and
that the predict modules never import torch."""

import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.theory.mesh import (
    DEFAULT_ORDER,
    RULES,
    MeshError,
    ParallelDims,
    dim_placement,
    enumerate_dims,
    grid_text,
)
from labkit.theory.spec import ModelSpec, get_spec

LLAMA70 = get_spec("llama-3-70b")


# ------------------------------------------------------------------------------------------------------
# an oracle written independently of labkit.theory.mesh: the set of rules a configuration breaks
# ------------------------------------------------------------------------------------------------------
def oracle(world, dp, tp, pp, cp, ep, vpp, spec, seq_len, gbs, mbs):
    """Rules broken, in two phases as ParallelDims reports them: construction, then check()."""
    degrees = dict(world_size=world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
    if any(v < 1 for v in degrees.values()):
        return {"degree"}, None
    if dp * tp * pp * cp != world:
        return {"world_size"}, None
    if (dp * cp) % ep:
        return {"ep_in_dp_cp"}, None
    bad = set()
    if spec.n_heads % tp:
        bad.add("tp_heads")
    if spec.n_kv_heads % tp and tp % spec.n_kv_heads:  # kv heads neither split nor replicated
        bad.add("tp_kv_heads")
    if spec.hidden_size % tp:
        bad.add("tp_hidden")
    if spec.ffn_hidden_size % tp:
        bad.add("tp_ffn")
    # uneven stages are allowed (Llama 3 405B: 126 layers on 16 stages); every model chunk needs a layer, and the
    # derived split (embedding and loss counted as a layer when pp does not divide n_layers) keeps >= vpp per stage
    if pp * vpp > spec.n_layers or min(_split(spec.n_layers, pp, vpp)) < vpp:
        bad.add("pp_layers")
    if ep > 1 and (not spec.is_moe or spec.n_experts % ep):
        bad.add("ep_experts")
    if seq_len % cp:
        bad.add("cp_seq")
    if gbs % (dp * mbs):
        bad.add("global_batch")
    else:
        m = gbs // (dp * mbs)
        if pp > 1 and (m < pp or (vpp > 1 and m % pp)):
            bad.add("pp_microbatches")
    return None, bad


def _split(n, p, v=1):
    """The derived stage split, written here from its definition (labkit.theory.memory.split_layers): even when p
    divides n (or p <= 2: the spare layer last); else n + 2 units (embedding and loss as a layer each) spread
    evenly, spare units on the middle stages from the last one back, then the first and last stage, one layer
    fewer on each edge; if a stage would hold fewer than v layers, the even split with spare layers at the end."""
    if n % p == 0 or p <= 2:
        return [n // p] * (p - n % p) + [n // p + 1] * (n % p)
    q, r = divmod(n + 2, p)
    units = [q] * p
    for k in ([*range(p - 2, 0, -1), p - 1, 0])[:r]:
        units[k] += 1
    units[0] -= 1
    units[-1] -= 1
    if min(units) < v:
        return [n // p] * (p - n % p) + [n // p + 1] * (n % p)
    return units


@st.composite
def configs(draw):
    n_kv = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    n_heads = n_kv * group
    head_dim = draw(st.sampled_from([4, 8, 12]))
    n_experts = draw(st.sampled_from([0, 0, 4, 6, 8]))
    spec = ModelSpec(n_layers=draw(st.integers(1, 24)), hidden_size=n_heads * head_dim, n_heads=n_heads,
                     n_kv_heads=n_kv, ffn_hidden_size=draw(st.sampled_from([24, 48, 96, 100])), vocab_size=97,
                     n_experts=n_experts, top_k=min(2, n_experts))
    deg = st.integers(0, 8)
    dp, tp, pp, cp = draw(deg), draw(deg), draw(deg), draw(st.sampled_from([1, 1, 2, 3, 4]))
    ep = draw(st.sampled_from([1, 1, 2, 3, 4]))
    vpp = draw(st.sampled_from([1, 1, 2]))
    product = dp * tp * pp * cp
    world = draw(st.sampled_from([product, product, max(1, product * 2), product + 1]))
    seq_len = draw(st.sampled_from([64, 96, 100, 128]))
    gbs = draw(st.integers(1, 96))
    mbs = draw(st.sampled_from([1, 2, 3]))
    return world, dp, tp, pp, cp, ep, vpp, spec, seq_len, gbs, mbs


@given(configs())
def test_validation_matches_the_oracle(cfg):
    world, dp, tp, pp, cp, ep, vpp, spec, seq_len, gbs, mbs = cfg
    construct_bad, check_bad = oracle(*cfg)
    if construct_bad:
        with pytest.raises(MeshError) as err:
            ParallelDims(world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
        assert set(err.value.rules) == construct_bad
        for rule in construct_bad:  # every rejected config names its failing rule
            assert f"[{rule}]" in str(err.value)
        return
    dims = ParallelDims(world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp)
    assert dims.dp * dims.tp * dims.pp * dims.cp == world
    kwargs = dict(seq_len=seq_len, global_batch_size=gbs, micro_batch_size=mbs)
    if check_bad:
        with pytest.raises(MeshError) as err:
            dims.check(spec, **kwargs)
        assert set(err.value.rules) == check_bad
        assert all(f"[{rule}]" in str(err.value) for rule in check_bad)
        assert isinstance(err.value, ValueError)
    else:  # accepted: the product is the world and every divisibility holds
        dims.check(spec, **kwargs)
        assert world == dp * tp * pp * cp
        assert spec.n_heads % tp == 0 and spec.hidden_size % tp == 0
        assert spec.n_kv_heads % tp == 0 or tp % spec.n_kv_heads == 0
        assert spec.ffn_hidden_size % tp == 0 and pp * vpp <= spec.n_layers and seq_len % cp == 0
        assert (dp * cp) % ep == 0 and (ep == 1 or spec.n_experts % ep == 0)
        m = dims.n_microbatches(gbs, mbs)
        assert dp * mbs * m == gbs and (pp == 1 or m >= pp)


def test_messages_name_the_fix():
    with pytest.raises(MeshError, match=r"world_size=8 != dp\*tp\*pp\*cp = 2\*2\*1\*1 = 4; set dp=4"):
        ParallelDims(8, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"tp=0 must be an integer >= 1"):
        ParallelDims(4, dp=4, tp=0)
    ParallelDims(16, dp=1, tp=16).check(LLAMA70)  # 8 kv heads, each replicated on 2 ranks
    with pytest.raises(MeshError, match=r"tp=3 does not divide n_heads=64; valid tp: 1, 2, 4, 8, 16, 32, 64"):
        ParallelDims(3, dp=1, tp=3).check(LLAMA70)
    # every "valid" list passes every rule: ffn 28672 = 2^12 * 7 rules out 3, 6 and 12, which the kv rule alone allows
    with pytest.raises(MeshError, match=r"tp=4 neither divides n_kv_heads=6 .* valid tp: 1, 2$"):
        ParallelDims(4, dp=1, tp=4).check(LLAMA70.replace(n_heads=48, n_kv_heads=6, hidden_size=6144))
    with pytest.raises(MeshError, match=r"tp=4 neither divides n_kv_heads=6 .* valid tp: 1, 2, 3, 6, 12, 24, 48$"):
        ParallelDims(4, dp=1, tp=4).check(LLAMA70.replace(n_heads=48, n_kv_heads=6, hidden_size=6144,
                                                         ffn_hidden_size=24576))
    with pytest.raises(MeshError, match=r"tp\*pp\*cp=3 does not divide world_size=8; valid tp\*pp\*cp: 1, 2, 4, 8"):
        ParallelDims.infer_dp(8, tp=3)
    # the field case: global batch 8 in 3 micro-batches, and fewer micro-batches than stages
    with pytest.raises(MeshError, match=r"8\*1\*3 = 24 != global_batch_size=8") as err:
        ParallelDims(8, dp=8).check(global_batch_size=8, n_microbatches=3)
    assert err.value.rules == ["global_batch"]
    with pytest.raises(MeshError, match=r"n_microbatches=2 < pp=4.*global_batch_size >= .* = 8"):
        ParallelDims(8, dp=2, pp=4).check(global_batch_size=4)
    with pytest.raises(MeshError, match="dense"):
        ParallelDims(8, dp=8, ep=2).check(LLAMA70)
    with pytest.raises(MeshError, match="permutation"):
        ParallelDims(4, dp=4, order=("tp", "dp", "pp"))
    assert ParallelDims.infer_dp(64, tp=8, pp=2).dp == 4


def test_vocab_is_not_required_to_divide_tp():
    # GPT-3's vocabulary (50257) divides by nothing useful; Megatron pads it, so tp=8 is a valid mesh
    ParallelDims(64, dp=8, tp=8).check(get_spec("gpt-3-175b"), seq_len=2048)


def test_grid_of_dp2_tp2_pp2_by_hand():
    d = ParallelDims(8, dp=2, tp=2, pp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("cp") == [[r] for r in range(8)]
    assert d.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert d.rank_of(tp=1, dp=1, pp=1) == 7
    rows = d.grid(gpus_per_node=4)
    assert [r["node"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rows[6] == {"rank": 6, "node": 1, "pp": 1, "dp": 1, "cp": 0, "tp": 0, "tp_group": 3, "cp_group": 6,
                       "dp_group": 2, "pp_group": 2, "dp_cp_group": 2}
    table = d.group_table(gpus_per_node=4)
    assert {r["dim"] for r in table} == {"tp", "dp", "pp"}
    assert all(r["link"] == "inter-node" for r in table if r["dim"] == "pp")
    assert all(r["link"] == "intra-node" for r in table if r["dim"] != "pp")
    assert grid_text(d).splitlines()[0] == "TP groups: [0, 1] [2, 3] [4, 5] [6, 7]"
    assert d.mesh_shape == (2, 2, 1, 2) and d.mesh_dim_names == ("pp", "dp", "cp", "tp")


def test_expert_groups_are_carved_out_of_dp_cp():
    d = ParallelDims(16, dp=4, cp=2, tp=2, ep=4)
    assert d.groups("dp_cp") == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert d.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert d.groups("edp")[:2] == [[0, 8], [1, 9]]


@given(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]),
       st.sampled_from([1, 2]), st.permutations(list(DEFAULT_ORDER)))
def test_grid_is_a_consistent_partition(dp, tp, pp, cp, order):
    d = ParallelDims(dp * tp * pp * cp, dp=dp, tp=tp, pp=pp, cp=cp, order=tuple(order))
    for dim in ("tp", "cp", "dp", "pp", "dp_cp"):
        groups = d.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(d.world_size))
        assert all(len(g) == d.degree(dim) for g in groups)
    for r in range(d.world_size):  # coords and rank_of are inverse; groups differ in one coordinate only
        assert d.rank_of(**d.coords(r)) == r
    for a in ("tp", "cp", "dp", "pp"):
        for b in ("tp", "cp", "dp", "pp"):
            if a < b:
                for ga in d.groups(a):
                    for gb in d.groups(b):
                        assert len(set(ga) & set(gb)) <= 1
    # the innermost dimension of the order is the consecutive one
    inner = order[0]
    assert d.groups(inner)[0] == list(range(d.degree(inner)))


@given(st.sampled_from([1, 2, 3, 4, 8, 16]), st.sampled_from([1, 2, 3, 4, 6, 8, 16, 32]),
       st.sampled_from([1, 2, 4, 8, 6]))
def test_dim_placement_matches_brute_force(degree, stride, gpn):
    world = 2 * math.lcm(degree * stride, gpn)  # a whole number of nodes and of grid blocks
    groups = []  # every group of this dimension
    for block in range(world // (degree * stride)):
        for off in range(stride):
            groups.append([block * degree * stride + off + k * stride for k in range(degree)])
    counts = set()
    spans = set()
    for g in groups:
        per_node = {}
        for r in g:
            per_node[r // gpn] = per_node.get(r // gpn, 0) + 1
        counts |= set(per_node.values())
        spans.add(len(per_node))
    even = len(counts) == 1 and len(spans) == 1
    got = dim_placement(degree, stride, gpn)
    if got is None:
        assert not even
    else:
        assert even and got["ranks_per_node"] == counts.pop() and got["nodes"] == spans.pop()
        assert got["within_node"] == (got["nodes"] == 1)


def test_placement_and_node_rule():
    d = ParallelDims(1024, dp=16, tp=8, pp=8)
    p = d.placement(8)
    assert p["tp"]["within_node"] and not p["dp"]["within_node"] and p["dp"]["ranks_per_node"] == 1
    assert p["pp"]["nodes"] == 8
    d2 = ParallelDims(64, dp=8, tp=4, pp=2)
    assert d2.placement(8)["dp"] == {"degree": 8, "stride": 4, "ranks_per_node": 2, "nodes": 4,
                                     "within_node": False}
    with pytest.raises(MeshError) as err:
        ParallelDims(48, dp=2, tp=3, pp=8).placement(8)
    assert err.value.rules == ["node_alignment"]  # once, naming every dimension that straddles
    assert all(f"{d} (rank stride" in str(err.value) for d in ("tp=3", "dp=2", "pp=8")), str(err.value)
    assert ParallelDims(16, dp=16).violations(gpus_per_node=8) == []


def test_violations_list_each_rule_once():
    from labkit.theory.spec import get_spec

    bad = ParallelDims(48, dp=2, tp=3, pp=8).violations(get_spec("llama-3-70b"), seq_len=8192,
                                                        global_batch_size=32, gpus_per_node=8)
    rules = [v.rule for v in bad]
    assert len(rules) == len(set(rules)), rules
    assert "node_alignment" in rules and "tp_heads" in rules


def test_enumerate_dims_counts_every_factorisation():
    # ordered factorisations of 2^14 into 4 factors: C(14 + 3, 3) = 680
    assert len(enumerate_dims(16384)) == 680
    assert all(d.dp * d.tp * d.pp * d.cp == 16384 for d in enumerate_dims(16384))
    assert len(enumerate_dims(12)) == 10 * 4  # 12 = 2^2 * 3: C(2+3, 3) * C(1+3, 3)


def test_rules_are_documented():
    assert set(RULES) >= {"degree", "world_size", "tp_heads", "tp_kv_heads", "tp_hidden", "tp_ffn", "pp_layers",
                          "ep_experts", "cp_seq", "global_batch", "node_alignment"}


def test_predict_modules_do_not_import_torch():
    code = ("import sys, labkit.theory.mesh, labkit.theory.planner, labkit.commands.plan; "
            "import labkit.theory.planner as p; p.plan('lab-tiny-llama', gpus=8, gpu='h100-80gb', seq_len=128, "
            "global_batch_size=8); assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_grid_figure_cells_are_ranks():
    from labkit.widgets import grid_figure

    fig = grid_figure(ParallelDims(32, dp=2, tp=4, pp=4), gpus_per_node=8)
    heat = fig.data[0]
    assert [list(map(int, row)) for row in heat.text] == [list(range(8 * s, 8 * s + 8)) for s in range(4)]
    assert [list(row) for row in heat.z] == [[s] * 8 for s in range(4)]  # one node per stage here
    assert "PP group [3, 11, 19, 27]" in heat.hovertext[1][3]
