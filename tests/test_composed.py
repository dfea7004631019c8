"""Composed 2-D runs on gloo: DP x TP = 2 x 2 and PP x DP = 2 x 2 in one 4-rank launch, compared with the
single-process reference (forward: losses; backward: last-step gradients; updates: final weights) at the fp32
tolerance of labkit.models.TOLERANCES; torch's mesh groups == ParallelDims' groups; measured model-state
bytes per rank == labkit.theory.memory's prediction. The comparison itself is checked to fail on a wrong result."""

import copy

import pytest

from labkit.chapters import ch09_composing_meshes as ch
from labkit.experiments import composed
from labkit.theory import composed as ct
from labkit.theory.mesh import MeshError


@pytest.fixture(scope="module")
def result():
    return composed.run_composed(4, steps=2, global_batch_size=8, seq_len=32, n_microbatches=4)


def test_parity_with_the_reference(result):
    p = result.parity
    assert set(p["run"]) == {"dp_tp (dp=2, tp=2)", "dp_tp_hand (dp=2, tp=2)", "pp_dp (dp=2, pp=2)"}
    assert set(p["what"]) == {"losses", "grads", "params"}
    assert p["ok"].all(), p[~p["ok"]].to_dict("records")
    n_params = len(result.runs[0][-1]["grads"])
    assert (p.loc[p["what"] != "losses", "tensors"] == n_params).all()  # every parameter compared
    assert (p["rtol"] == 1e-4).all() and (p.loc[p["what"] != "params", "atol"] == 1e-5).all()
    assert list(p.loc[p["what"] == "params", "atol"]) == pytest.approx([1e-5 + 0.1 * 1e-3 * 2] * 3)
    ref = result.runs[0][-1]["losses"]
    assert ref[1] < ref[0]  # it trains


def test_mesh_groups_are_the_parallel_dims_groups(result):
    g = result.groups
    assert g["same"].all()
    tp = g[(g["run"] == "dp_tp (dp=2, tp=2)") & (g["dim"] == "tp")]
    assert sorted(map(tuple, tp["torch_group"])) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    hand = g[(g["run"] == "dp_tp_hand (dp=2, tp=2)") & (g["dim"] == "dp")]
    assert sorted(map(tuple, hand["torch_group"])) == [(0, 2), (0, 2), (1, 3), (1, 3)]
    pp = g[(g["run"] == "pp_dp (dp=2, pp=2)") & (g["dim"] == "pp")]
    assert sorted(map(tuple, pp["torch_group"])) == [(0, 2), (0, 2), (1, 3), (1, 3)]


def test_measured_model_states_equal_the_calculator(result):
    m = result.memory
    assert len(m) == 3 * 4 * 3 and m["equal"].all(), m[~m["equal"]].to_dict("records")
    # replicated DP (hand-written) holds twice the model states of FSDP2 (ZeRO-3) over dp=2
    per = m[m["rank"] == 0].set_index(["run", "category"])["measured_bytes"]
    assert per[("dp_tp_hand (dp=2, tp=2)", "parameters")] == 2 * per[("dp_tp (dp=2, tp=2)", "parameters")]
    # PP x DP: the two stages hold different tensors (embedding vs final norm + head), so different bytes
    pp = m[(m["run"] == "pp_dp (dp=2, pp=2)") & (m["category"] == "parameters")]
    assert pp.groupby("stage")["measured_bytes"].first().nunique() == 2


def test_timing_is_labelled_measured(result):
    t = result.timing
    assert list(t["run"])[-1] == "reference (1 process)"
    assert (t["step_s"] > 0).all() and t["note"].str.startswith("measured").all()


def test_compare_fails_on_a_wrong_result(result):
    bad = copy.deepcopy(result.runs)
    name = next(iter(bad[0][0]["grads"]))
    bad[0][0]["grads"][name] = bad[0][0]["grads"][name] + 1e-3  # one gradient off by 1e-3 in the DP x TP run
    bad[1][2]["groups"]["pp"][0] = [0, 2]  # torch gives rank 1 a PP group it is not in
    parity, groups, _, memory = composed.compare(bad, "lab-tiny-llama")
    wrong = parity[~parity["ok"]]
    assert list(zip(wrong["run"], wrong["what"], strict=True)) == [("dp_tp (dp=2, tp=2)", "grads")]
    assert name in wrong["error"].iloc[0]
    assert (~groups["same"]).sum() == 1
    del bad[0][-1]
    with pytest.raises(ValueError, match="no reference"):
        composed.compare(bad)


@pytest.mark.parametrize("runs, err, match", [
    ([{"kind": "dp_tp", "dp": 2, "tp": 4}], MeshError, r"world_size=4 != dp\*tp\*pp\*cp = 2\*4\*1\*1 = 8"),
    ([{"kind": "dp_tp", "dp": 1, "tp": 4}], MeshError, r"kind=.dp_tp.: tp=4 does not divide n_kv_heads=2"),
    ([{"kind": "pp_dp", "pp": 2, "dp": 2, "tp": 2}], ValueError, "composes pp and dp only"),
    ([{"kind": "nope"}], ValueError, "kind='nope' is not valid"),
])
def test_bad_runs_fail_before_launch(runs, err, match):
    with pytest.raises(err, match=match):
        composed.run_composed(4, runs)


def test_batch_split_field_case():
    # global batch 8 in 3 micro-batches: a ValueError before any process starts, naming the fix
    with pytest.raises(MeshError, match=r"global_batch_size=8"):
        composed.run_composed(4, [{"kind": "pp_dp", "pp": 2, "dp": 2}], global_batch_size=8, n_microbatches=3)
    with pytest.raises(ValueError, match="untied output head"):
        composed.run_composed(4, [{"kind": "pp_dp", "pp": 2, "dp": 2}], model="lab-tiny-gpt")


@pytest.mark.parametrize("bad, match", [
    ({"world_size": 1}, r"chapter 09 needs world_size >= 2"),
    ({"world_size": 3}, r"even world_size .* got world_size=3; use 2 or 4"),
    ({"steps": 0}, r"steps=0"),
    ({"seq_len": 0}, r"seq_len=0"),
    ({"model": "lab-tiny-gpt"}, r"untied output head"),
    ({"model": "llama-3-8b"}, r"choose a CPU-sized preset"),
    ({"plan_gpu": "x"}, r"gpu='x' is not valid"),
    ({"plan_gpus": 12}, r"plan_gpus=12 is not a whole number of nodes"),
    ({"timeout_s": 0}, r"timeout_s"),
])
def test_chapter_09_refuses_bad_parameters_before_any_launch(bad, match):
    ok = dict(world_size=4, model="lab-tiny-llama", steps=2, seq_len=32, n_microbatches=4, plan_model="llama-3-70b",
              plan_gpus=1024, plan_gpu="h100-80gb", gpus_per_node=8, plan_seq_len=8192, plan_global_batch=1024,
              timeout_s=300.0)
    got = ch.check_chapter(**ok)
    assert got["dp"] == 2 and got["global_batch_size"] == 8 and [r["kind"] for r in got["runs"]] == list(ct.KINDS)
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(**{**ok, **bad})


def test_rooms_of_the_composition():
    """The strategy imports no runtime, experiment, chapter or view (nor pandas / plotly); its predictions no
    torch; the experiment uses the strategy's functions rather than its own copies of them."""
    import ast
    import inspect

    from labkit.parallel import composed as strategy

    def imported(module):
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
        return names

    banned = ("labkit.runtime", "labkit.experiments", "labkit.chapters", "labkit.plots", "labkit.widgets",
              "labkit.notebooks", "labkit.cli", "pandas", "plotly")
    assert not [m for m in imported(strategy) if m.startswith(banned)]
    assert not [m for m in imported(ct) if m.split(".")[0] == "torch"]
    src = inspect.getsource(composed)
    assert "fully_shard(" not in src and "parallelize_module" not in src and "Schedule1F1B" not in src


def test_chapter_09_notebook_validates_first_and_links_its_code():
    """The first code cell after the parameters passes every parameter to ch.check_chapter; the "Code in this
    chapter" cell's links all resolve to files of the repository."""
    import ast
    import re
    from pathlib import Path

    import nbformat

    from labkit import notebooks

    root = Path(__file__).resolve().parent.parent
    path = root / "notebooks" / "09_composing_meshes.ipynb"
    nb = nbformat.read(path, 4)
    i = next(k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    first = next(c for c in nb.cells[i + 1:] if c.cell_type == "code")
    call = next(n for n in ast.walk(ast.parse(first.source)) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "ch.check_chapter")
    passed = {k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg}
    assert set(notebooks.declared_parameters(path)) <= passed
    code = next(c.source for c in nb.cells[:i] if c.cell_type == "markdown" and "**Code in this chapter**" in c.source)
    links = re.findall(r"\]\((\.\./[^)]+)\)", code)
    assert "../labkit/parallel/composed.py" in links and len(links) >= 10
    assert [x for x in links if not (path.parent / x).resolve().is_file()] == []
