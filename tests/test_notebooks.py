"""Chapter notebooks: stored clean, in the chapter shape of docs/architecture.md, executed headless (papermill).

The runner's own behaviour (timeouts, failures, parameters, a rank function defined in a notebook cell) is
checked on small notebooks written here.
"""

from __future__ import annotations

import ast
import json

import nbformat
import pytest

from labkit import notebooks
from labkit.paths import notebooks_dir

CHAPTERS = notebooks.discover()


def _write(path, *sources, params=None):
    nb = nbformat.v4.new_notebook()
    if params is not None:
        cell = nbformat.v4.new_code_cell(params)
        cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_there_are_chapters():
    assert CHAPTERS and CHAPTERS[0].name == "00_getting_started.ipynb"


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_stored_clean_and_shaped(path):
    raw = json.loads(path.read_text())
    nb = nbformat.reads(path.read_text(), as_version=4)
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, "strip outputs before commit"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown" and "Objectives" in nb.cells[0].source
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "exactly one cell tagged 'parameters'"
    declared = notebooks.declared_parameters(path)
    assert "world_size" in declared
    # papermill must parse every assignment of the parameters cell (a trailing comment with '=' hides a name)
    assigned = {t.id for node in ast.parse(params[0].source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert assigned <= set(declared), f"papermill cannot see: {sorted(assigned - set(declared))}"
    assert not check_problems(nb), check_problems(nb)


def check_problems(nb) -> list[str]:
    """What is missing from a chapter's checks, read from its code (not from its words): an ``assert`` statement
    whose condition is not a constant and reads a name the chapter's code assigned (a comment or markdown that
    says "assert" does not count), and an Exercise heading followed by a code cell that leaves the reader's
    answer ``= None``."""
    import re

    code = [ast.parse(c.source) for c in nb.cells if c.cell_type == "code"]
    assigned = {n.id for tree in code for n in ast.walk(tree)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    checks = [a for tree in code for a in ast.walk(tree) if isinstance(a, ast.Assert)
              and not isinstance(a.test, ast.Constant)
              and {n.id for n in ast.walk(a.test) if isinstance(n, ast.Name)} & assigned]
    problems = [] if checks else ["no assert statement checks what the chapter computed"]
    heads = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "markdown" and re.search(r"^#+ .*Exercise", c.source, re.M)]
    after = nb.cells[heads[-1] + 1:] if heads else []
    answers = [c for c in after if c.cell_type == "code" and re.search(r"^\w+ = None\b", c.source, re.M)]
    if not answers:
        problems.append("no Exercise heading followed by a code cell with the reader's answer = None")
    return problems


def test_check_problems_reads_code_not_words():
    """The shape check above fails a chapter whose only "assert" is a word (markdown, a comment, a string) or a
    constant; before, the word "assert" anywhere passed."""
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell

    def nb(*cells):
        return nbformat.v4.new_notebook(cells=list(cells))

    exercise = [md("## Exercise\nHow many?"), code("answer = None  # yours")]
    wordy = nb(md("We assert that it works."), code("x = 1  # assert x == 1"), code("print('assert x')"), *exercise)
    assert check_problems(wordy) == ["no assert statement checks what the chapter computed"]
    assert check_problems(nb(code("x = 1"), code("assert True"), *exercise))[0].startswith("no assert")
    assert check_problems(nb(code("assert undefined_name > 0"), *exercise))[0].startswith("no assert")
    ok = nb(code("x = 1"), code("assert x == 1, x"), *exercise)
    assert check_problems(ok) == []
    assert check_problems(nb(code("x = 1"), code("assert x == 1"), md("Exercise: none here"))) == [
        "no Exercise heading followed by a code cell with the reader's answer = None"]


def test_runner_timeout_failure_parameters_and_notebook_defined_rank_fn(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write(src / "00_launch.ipynb",
           "import torch, torch.distributed as dist\nfrom labkit import launch\n"
           "def cell_fn(ctx, k):\n    t = torch.tensor([float(ctx.rank + k)])\n    dist.all_reduce(t)\n"
           "    return t.item()\n",
           "res = launch(cell_fn, world_size, 10)\nassert list(res) == [21.0, 21.0], res\n",
           params="world_size = 2")
    _write(src / "01_hang.ipynb", "import time\ntime.sleep(60)")
    _write(src / "02_fail.ipynb", "raise ZeroDivisionError('chapter broke')")
    _write(src / "03_params.ipynb", "assert world_size == 3 and label == 'x', (world_size, label)",
           params="world_size = 2\nlabel = 'y'")
    out = tmp_path / "out"
    rows = {}
    for path in notebooks.discover(folder=src):
        params = {"world_size": 3, "label": "x", "unused": 1} if path.name.startswith("03") else None
        timeout = 5 if "hang" in path.name else 180  # generous where nothing should hang (slow shared CI)
        row = notebooks.run_notebook(path, out / path.name, params, cell_timeout_s=timeout)
        rows[path.name] = row
    assert rows["00_launch.ipynb"]["status"] == "ok", rows["00_launch.ipynb"]
    assert rows["01_hang.ipynb"]["status"] == "timeout" and rows["01_hang.ipynb"]["seconds"] < 60
    assert rows["02_fail.ipynb"]["status"] == "failed" and "chapter broke" in rows["02_fail.ipynb"]["error"]
    assert rows["03_params.ipynb"]["status"] == "ok", rows["03_params.ipynb"]
    assert rows["03_params.ipynb"]["parameters"] == {"world_size": 3, "label": "x"}  # only declared ones
    assert (out / "00_launch.ipynb").exists()


def test_a_cell_that_lasted_the_timeout_is_not_ok(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("y = 2")]
    nb.cells[0].metadata["papermill"] = {"duration": 0.1}
    nb.cells[1].metadata["papermill"] = {"duration": 29.8}  # what nbclient#312 leaves behind
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, str(path))
    assert notebooks.stalled_cells(path, 30.0) == [1]
    assert notebooks.stalled_cells(path, 60.0) == []


def test_discover_and_parameters_errors(tmp_path):
    assert [p.name[:2] for p in notebooks.discover(["02", "0", "2", "00"])] == ["02", "00"]  # each once
    with pytest.raises(ValueError, match="chapter '7' not found"):
        notebooks.discover(["7"], folder=tmp_path)
    assert notebooks.parse_parameters(["world_size=4", "fast=true", "name=abc"]) == {
        "world_size": 4, "fast": True, "name": "abc"}
    # the Python literals mean what they mean in the notebook (as papermill's -p reads them); quoted, a string
    assert notebooks.parse_parameters(["emulate=None", "a=False", "b=True", "c='None'", "d=null"]) == {
        "emulate": None, "a": False, "b": True, "c": "None", "d": None}
    # unquoted numbers are numbers (YAML 1.1 reads 1e12 as a string, which a check could pass on to the ranks)
    assert notebooks.parse_parameters(["w=1e12", "x=5e-3", "y='1e3'", "z=abc"]) == {
        "w": 1e12, "x": 0.005, "y": "1e3", "z": "abc"}
    with pytest.raises(ValueError, match="name=value"):
        notebooks.parse_parameters(["4"])


@pytest.fixture(scope="module")
def chapter_kernels():
    """One kernel template for this file's chapter runs, as ``labkit run`` has (runtime/kernels.py); fresh
    kernels run chapters in test_measure, test_tensor_parallel, test_kernels and the browser test."""
    from labkit.runtime.kernels import kernel_template

    with kernel_template() as manager:
        yield manager


@pytest.mark.slow
@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_executes_with_defaults(path, tmp_path, chapter_kernels):
    row = notebooks.run_notebook(path, tmp_path / path.name, cell_timeout_s=300,
                                 kernel_manager_class=chapter_kernels)
    assert row["status"] == "ok", f"{path.name}: {row['error']} (executed copy: {row['output']})"
    assert notebooks_dir() == path.parent


# ------------------------------------------------------------------------------------------------------
# the first code cell validates every parameter; exercises give a hint, never the answer
# ------------------------------------------------------------------------------------------------------
def _cells(name):
    cells = nbformat.read(str(notebooks_dir() / f"{name}.ipynb"), 4).cells
    i = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    first = next(c.source for c in cells[i + 1:] if c.cell_type == "code")
    exercise = [c.source for c in cells if c.cell_type == "code" and "= None  #" in c.source
                and "check_exercise(" in c.source]
    return cells[i].source, first, exercise


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_first_code_cell_refuses_a_bad_world_size_before_any_launch(path, monkeypatch):
    import labkit
    import labkit.runtime.launcher

    def no_launch(*a, **k):
        raise AssertionError("launched before validating the parameters")

    monkeypatch.setattr(labkit.runtime.launcher, "launch", no_launch)
    monkeypatch.setattr(labkit, "launch", no_launch)
    params, first, _ = _cells(path.stem)
    ns = {}
    exec(params, ns)
    ns["world_size"] = 0
    with pytest.raises(ValueError, match="world_size"):
        exec(first, ns)


# chapter -> (module the exercise cell uses, its alias, the answer variable, the reference variable)
EXERCISES = {"02_collectives": ("labkit.theory.costmodel", "cm", "answer_bytes", "reference_bytes"),
             "07_context_parallel": ("labkit.theory.context", "cpt", "answer", "reference"),
             "08_expert_parallel": ("labkit.theory.expert", "ept", "answer", "reference"),
             "12_serving_under_load": ("labkit.chapters.ch12_serving_under_load", "ch", "answer_rate",
                                       "reference_rate")}


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_chapter_validates_every_parameter_through_check_chapter(name):
    params, first, _ = _cells(name)
    calls = [n for n in ast.walk(ast.parse(first)) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", "") == "check_chapter"]
    assert len(calls) == 1, "the first code cell validates through one check_chapter call"
    assert {k.arg for k in calls[0].keywords} == set(notebooks.declared_parameters(notebooks_dir() / f"{name}.ipynb"))
    ns = {}
    exec(params, ns)
    ns["world_size"] = 1
    with pytest.raises(ValueError, match=rf"chapter {name[:2]} needs world_size >= 2\b.*got world_size=1"):
        exec(first, ns)  # nothing launched yet


#: every chapter's exercise (00-12), run without the chapter's launches: the parameters cell and the first code
#: cell (imports and check_chapter, nothing launched), then the exercise cells (tagged "exercise"). ``answers``:
#: the variables the reader sets and a wrong attempt for each; ``reference``: a callable giving the right answers
#: (else the reference argument of the cells' check_exercise call, recorded). Chapter 00's launch is stubbed with
#: a distinctive number, so a leak of it shows.
def _ch09_reference():
    from labkit.chapters import ch09_composing_meshes

    return ch09_composing_meshes.exercise_reference()


ALL_EXERCISES = {
    "00_getting_started": dict(answers={"my_prediction": 7}),
    "01_memory_budgets": dict(answers={"my_optimizer_bytes": 1000}),
    "02_collectives": dict(answers={"answer_bytes": 3}),
    "03_data_parallel": dict(answers={"answer": 3}),
    "04_zero_fsdp": dict(answers={"answer": 3.0}),
    "05_tensor_parallel": dict(answers={"answer_bytes": 3}),
    "06_pipeline_parallel": dict(answers={"answer": 0.9}),
    "07_context_parallel": dict(answers={"answer": 3}),
    "08_expert_parallel": dict(answers={"answer": 3}),
    "09_composing_meshes": dict(answers={"answer_pp_group": [1, 2, 3, 4], "answer_dp_link": "inter-node"},
                                reference=_ch09_reference),
    "10_serving": dict(answers={"answer_bytes": 3}),
    "11_scaling": dict(answers={"answer_efficiency": 0.1}),
    "12_serving_under_load": dict(answers={"answer_rate": 3.0}),
}

#: the only calls an exercise cell may make: the chapter's check, whose reference is computed out of sight
EXERCISE_CALLS = {"exercises.check", "ch.check_grid_exercise"}


def test_every_chapter_has_its_exercise_in_the_no_leak_test():
    assert sorted(ALL_EXERCISES) == [p.stem for p in CHAPTERS]


def _exercise_cells(name):
    """The chapter's exercise cells (tagged "exercise", after its Exercise heading), one source."""
    import re

    cells = nbformat.read(str(notebooks_dir() / f"{name}.ipynb"), 4).cells
    head = max(i for i, c in enumerate(cells) if c.cell_type == "markdown"
               and re.search(r"^#+ .*Exercise", c.source, re.M))
    tagged = [c.source for c in cells[head + 1:] if "exercise" in c.metadata.get("tags", [])]
    assert tagged, f"{name}: no cell tagged 'exercise' after the Exercise heading"
    return "\n".join(tagged)


@pytest.mark.parametrize("name", sorted(ALL_EXERCISES))
def test_exercise_cells_compute_no_reference_in_sight(name):
    """The reference is neither printed nor computable from the exercise cells: they set the answer and make one
    call, the chapter's check (labkit.chapters.exercises, or chapter 09's grid check), with no function of the
    exercise's own data (a formula, a launch) written in the notebook."""
    tree = ast.parse(_exercise_cells(name))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert calls and calls <= EXERCISE_CALLS, f"{name}: exercise cells call {sorted(calls - EXERCISE_CALLS)}"
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert assigned == set(ALL_EXERCISES[name]["answers"]), f"{name}: the cells assign {sorted(assigned)}"


def _leak_forms(ref) -> set[str]:
    """How a reference answer could be printed: as written, rounded, with thousands separators."""
    if isinstance(ref, str):
        return {ref}
    if isinstance(ref, (list, tuple)):
        return {str(list(ref)), str(tuple(ref)), ", ".join(map(str, ref))}
    x = float(ref)
    forms = {str(ref), repr(ref), f"{x:g}", f"{x:.2f}", f"{x:.3f}", f"{x:.4g}", f"{x:,}"}
    if x.is_integer():
        forms |= {str(int(x)), f"{int(x):,}"}
    return forms


def _with_answers(src, answers):
    import re

    for var, value in answers.items():
        value = value.item() if hasattr(value, "item") else value  # a numpy scalar, written as a plain number
        src, n = re.subn(rf"^{var}\s*=\s*None\b", f"{var} = {value!r}", src, flags=re.M)
        assert n == 1, f"no line '{var} = None' in the exercise"
    return src


@pytest.mark.parametrize("name", sorted(ALL_EXERCISES))
def test_exercise_never_prints_the_answer_not_attempted_or_wrong(name, capsys, monkeypatch):
    """Every chapter's exercise cells, executed: not attempted prints a hint and not the reference; a wrong
    attempt fails (AssertionError) with a second hint, without printing or raising the answer; the right answer
    is accepted. The reference is what the exercise's own check compares with (check_exercise's argument, or
    the chapter's reference function)."""
    import labkit.runtime.launcher
    from labkit.chapters import common

    case = ALL_EXERCISES[name]
    seen = []
    real = common.check_exercise

    def spy(answer, reference, **kw):
        seen.append(reference)
        return real(answer, reference, **kw)

    monkeypatch.setattr(common, "check_exercise", spy)
    monkeypatch.setattr(labkit.runtime.launcher, "launch", lambda fn, n, **kw: [12345.0] * n)
    params, first, _ = _cells(name)
    ns: dict = {}
    exec(params, ns)
    exec(first, ns)
    capsys.readouterr()
    exercise = _exercise_cells(name)
    setup = dict(ns)

    exec(exercise, ns)  # not attempted: the reference is computed (the cell runs its code), never shown
    out = capsys.readouterr().out
    refs = list(case["reference"]()) if "reference" in case else seen[-1:]
    assert refs, "the exercise checks against no reference"
    leaked = [f for ref in refs for f in _leak_forms(ref) if f in out]
    assert not leaked, f"not attempted, yet the output shows the answer {leaked}: {out}"

    ns = dict(setup)
    with pytest.raises(AssertionError) as wrong:
        exec(_with_answers(exercise, case["answers"]), ns)
    text = capsys.readouterr().out + str(wrong.value)
    leaked = [f for ref in refs for f in _leak_forms(ref) if f in text]
    assert not leaked, f"a wrong attempt shows the answer {leaked}: {text}"
    assert "not attempted" in out.lower() and "hint" in out.lower(), out
    assert "hint" in str(wrong.value).lower() or "is not it" in str(wrong.value), \
        f"no hint after a wrong answer: {wrong.value}"

    right = dict(zip(case["answers"], refs))
    ns = dict(setup)
    exec(_with_answers(exercise, right), ns)
    assert "correct" in capsys.readouterr().out.lower()


def test_every_chapter_check_runs_before_a_kernel(monkeypatch, tmp_path):
    """``labkit run -p ...`` runs each chapter's own check_chapter first (refused_chapters): every chapter's
    check cell has the shape it reads, a refused chapter is listed ``refused`` and not run, the others run."""
    import importlib

    called = {}
    for path in CHAPTERS:
        mod = importlib.import_module(f"labkit.chapters.ch{path.stem}")
        monkeypatch.setattr(mod, "check_chapter", lambda _n=path.name[:2], **kw: called.setdefault(_n, kw))
    assert notebooks.refused_chapters(CHAPTERS, {}) == {}
    assert sorted(called) == [p.name[:2] for p in CHAPTERS]  # none left to its first cell
    monkeypatch.undo()
    refused = notebooks.refused_chapters(notebooks.discover(["00", "09"]), {"world_size": 3})
    assert list(refused.values()) == [
        "chapter 09 needs an even world_size (tp or pp = 2, dp = world_size / 2), got world_size=3; use 2 or 4"]
    df = notebooks.run_chapters(["09"], out=tmp_path, parameters={"world_size": 3}, refused=refused, progress=False)
    assert df[["status", "error"]].values.tolist() == [["refused", list(refused.values())[0]]]
