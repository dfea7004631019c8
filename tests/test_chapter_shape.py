"""Every chapter in the chapter shape (docs/architecture.md): the parameters papermill sees, the reader's
prediction asked before the run, short code cells, and an emulated run where the chapter declares one."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _code_lines(cell: dict) -> int:
    return sum(1 for line in "".join(cell["source"]).splitlines() if line.strip() and not line.lstrip().startswith("#"))


#: chapters whose cluster profile only names a GPU (nothing in them is emulated): their parameter is ``cluster``
NOT_EMULATED = {"01_memory_budgets", "12_serving_under_load"}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_parameters_cell_has_world_size_emulate_and_my_prediction(path):
    """world_size, my_prediction, and ``emulate`` where the chapter emulates a run — ``cluster`` instead where
    nothing is emulated (an ``emulate`` parameter that emulates nothing misleads the reader)."""
    from labkit import notebooks

    names = notebooks.declared_parameters(path)
    which = "cluster" if path.stem in NOT_EMULATED else "emulate"
    assert {"world_size", which, "my_prediction"} <= set(names), f"{path.name}: parameters {sorted(names)}"
    if path.stem in NOT_EMULATED:
        assert "emulate" not in names, f"{path.name} emulates nothing: name its profile parameter cluster"
    assert names["my_prediction"]["default"] == "None", "my_prediction defaults to None (CI runs unattended)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_reader_predicts_before_the_run(path):
    cells = _cells(path)
    i = next(k for k, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    first_launch = next((k for k, c in enumerate(cells) if c["cell_type"] == "code" and k > i
                         and any(w in "".join(c["source"]) for w in ("launch(", ".run(", "run_"))), len(cells))
    asked = [c for c in cells[:first_launch]
             if c["cell_type"] == "markdown" and "my_prediction" in "".join(c["source"])]
    assert asked, f"{path.name}: no question naming my_prediction before the first run"
    assert any("compare_prediction(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code"), \
        f"{path.name}: the reader's prediction is never compared with the run"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_code_cells_are_short(path):
    sizes = [_code_lines(c) for c in _cells(path) if c["cell_type"] == "code"]
    assert statistics.median(sizes) <= 6, f"{path.name}: median code cell {statistics.median(sizes)} lines"
    assert max(sizes) <= 15, f"{path.name}: a code cell of {max(sizes)} lines (cells: {sizes})"
