"""The layout's rules (docs/architecture.md), checked on the code itself.

* ``labkit/parallel/`` (strategies) imports no runtime, experiments, chapters, views, pandas or plotly;
* ``labkit/theory/`` (predictions) imports none of those either, and no torch and no strategy;
* ``import labkit`` and every theory module load neither torch nor pandas (checked in a fresh interpreter,
  so an import hidden behind another module counts too);
* size budget: no file under ``labkit/parallel/`` over 400 lines, none in ``labkit/`` over 700;
* every chapter has a "Code in this chapter" cell, and every relative link in a chapter resolves.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABKIT = ROOT / "labkit"

VIEWS = ("labkit.plots", "labkit.widgets", "labkit.notebooks", "labkit.cli", "labkit.commands")
#: old top-level paths of moved modules, removed: nothing may import them, and none may come back
ALIASES = ("labkit.launcher", "labkit.worker", "labkit.rank", "labkit.timeline", "labkit.commlog", "labkit.records",
           "labkit.measure", "labkit.memory", "labkit.costmodel", "labkit.simulate", "labkit.mesh", "labkit.planner",
           "labkit.spec")
ROOMS = ("labkit.runtime", "labkit.experiments", "labkit.chapters")
FORBIDDEN = {
    "parallel": ROOMS + VIEWS + ALIASES + ("pandas", "plotly"),
    "theory": ROOMS + VIEWS + ALIASES + ("pandas", "plotly", "torch", "numpy", "labkit.parallel", "labkit.models"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement in ``path`` names (top level and inside functions), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "labkit":  # from labkit import records -> labkit.records
                out += [(node.lineno, f"labkit.{a.name}") for a in node.names]
    return out


def _names(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_import_only_what_they_may(room):
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in sorted((LABKIT / room).rglob("*.py"))
           for line, mod in _imports(p) if _names(mod, FORBIDDEN[room])]
    assert not bad, f"labkit/{room}/ must not import these (docs/architecture.md):\n" + "\n".join(bad)


def test_no_old_module_paths():
    """One home for each name: the old top-level paths (``labkit.costmodel`` ...) are gone, and nothing in the
    package, tests, benchmarks, notebooks, docs or README names them."""
    back = [a for a in ALIASES if (LABKIT / (a.split(".")[1] + ".py")).exists()]
    assert not back, f"old module paths are back: {back}; import from labkit.theory / labkit.runtime"
    pattern = re.compile(r"\b(" + "|".join(re.escape(a) for a in ALIASES) + r")\b")
    files = [*LABKIT.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             *(ROOT / "examples").rglob("*")]
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}: {m.group(1)}" for p in files if p.is_file() and p.resolve() != me
            for m in pattern.finditer(p.read_text(errors="replace"))]
    assert not hits, "old module paths still named:\n" + "\n".join(hits)


def test_the_boundary_check_sees_a_violation(tmp_path):
    """The checker itself can fail: a hidden import inside a function is found."""
    f = tmp_path / "x.py"
    f.write_text("def f():\n    import pandas as pd\n    from labkit import records\n")
    mods = [m for _, m in _imports(f)]
    assert _names(mods[0], FORBIDDEN["parallel"]) and "labkit.records" in mods


def _module_graph() -> dict[str, set[str]]:
    """labkit module -> the labkit modules it imports (anywhere in the file), each resolved to a file's module."""
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in LABKIT.rglob("*.py")}

    def home(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {h for _, name in _imports(p) if (h := home(name)) and h != m} for m, p in mods.items()}


def _reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = set(), [src]
    while todo:
        m = todo.pop()
        if m == dst:
            return True
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return False


#: pairs of modules that once imported each other (issue 31): one direction only now
ONE_WAY = [("labkit.models", "labkit.parallel.expert.moe"), ("labkit.theory.published", "labkit.theory.planner"),
           ("labkit.experiments.collective_patterns", "labkit.experiments.collectives")]


@pytest.mark.parametrize("upper,lower", ONE_WAY)
def test_no_import_circle_between(upper, lower):
    g = _module_graph()
    assert lower in g and upper in g
    assert _reaches(g, upper, lower), f"{upper} no longer uses {lower}: drop the pair"
    assert not _reaches(g, lower, upper), f"{lower} imports its way back to {upper}: an import circle"


def test_the_circle_check_sees_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _reaches(g, "c", "b") and _reaches(g, "b", "c") and not _reaches(g, "a", "d")


def _theory_modules() -> list[str]:
    return sorted("labkit." + ".".join(p.relative_to(LABKIT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (LABKIT / "theory").rglob("*.py"))


def test_import_labkit_and_theory_load_no_torch_or_pandas():
    mods = ["labkit", *_theory_modules()]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(k for k in ('torch', 'pandas', 'plotly') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _lines(p: Path) -> int:
    return len(p.read_text().splitlines())


def test_size_budget():
    over = [f"{p.relative_to(ROOT)}: {_lines(p)} lines (budget {400 if 'parallel' in p.parts else 700})"
            for p in sorted(LABKIT.rglob("*.py"))
            if _lines(p) > (400 if "parallel" in p.relative_to(LABKIT).parts else 700)]
    assert not over, "split these by concern:\n" + "\n".join(over)


CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\(((?:\.\./|\./)[^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_links_its_code_and_every_link_resolves(path):
    cells = json.loads(path.read_text())["cells"]
    md = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    code = [m for m in md if "Code in this chapter" in m]
    assert code, f"{path.name}: no 'Code in this chapter' cell"
    links = LINK.findall(code[0])
    assert any("labkit/" in link for link in links), f"{path.name}: the code cell links no labkit file"
    broken = [link for m in md for link in LINK.findall(m) if not (path.parent / link).resolve().exists()]
    assert not broken, f"{path.name}: links that do not resolve: {broken}"
