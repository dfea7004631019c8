"""The papermill runner behind `labkit run`: a cell timeout names the cell (index and first line), and the executed
notebook marks that cell failed, not completed; the cells after it never ran."""

from __future__ import annotations

import nbformat
import pytest

from labkit.notebooks import last_started_cell, mark_cell_failed, run_notebook


def _notebook(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


@pytest.mark.slow
def test_cell_timeout_names_the_cell_and_marks_it_failed(tmp_path):
    src = tmp_path / "00_hang.ipynb"
    _notebook(src, ["x = 1", "# the slow one\nimport time\ntime.sleep(120)", "y = 2"])
    out = tmp_path / "out" / "00_hang.ipynb"
    row = run_notebook(src, out, cell_timeout_s=8)
    assert row["status"] == "timeout", row
    assert row["error"].startswith("cell 1 ('# the slow one') did not finish within the 8 s cell timeout"), row
    nb = nbformat.read(str(out), as_version=4)
    statuses = [c.metadata.papermill["status"] for c in nb.cells]
    assert statuses[1] == "failed" and statuses[2] != "completed", statuses
    assert nb.cells[1].metadata.papermill["exception"] is True and nb.metadata.papermill["exception"] is True
    assert nb.cells[1].outputs[-1]["ename"] == "CellTimeoutError"


def test_mark_cell_failed_and_last_started_cell(tmp_path):
    path = tmp_path / "nb.ipynb"
    _notebook(path, ["a = 1", "b = 2", "c = 3"])
    nb = nbformat.read(str(path), as_version=4)
    for i, cell in enumerate(nb.cells):  # as papermill leaves a run stopped in cell 1
        cell.metadata["papermill"] = {"status": "completed", "start_time": "t" if i < 2 else None}
    nb.metadata["papermill"] = {}
    nbformat.write(nb, str(path))
    assert last_started_cell(path) == (1, "b = 2")
    mark_cell_failed(path, 1, "CellTimeoutError", "cell 1 timed out")
    nb = nbformat.read(str(path), as_version=4)
    assert [c.metadata.papermill["status"] for c in nb.cells] == ["completed", "failed", "pending"]
    assert nb.cells[1].outputs[-1]["evalue"] == "cell 1 timed out"
