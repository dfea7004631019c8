"""The shared argument checks and the CLI's -p values: a number given as a string is never passed on."""

from __future__ import annotations

import pytest

from labkit.checks import positive_float


@pytest.mark.parametrize("value", ["1e12", "5", b"5", True])
def test_positive_float_refuses_strings_and_bools(value):
    with pytest.raises(ValueError, match="must be a finite number"):
        positive_float("work_ms", value)


def test_positive_float_accepts_numbers():
    assert positive_float("work_ms", 1e12) == 1e12 and positive_float("x", 0, allow_zero=True) == 0.0


def test_a_chapter_refuses_a_number_given_as_a_string():
    from labkit.chapters import ch00_getting_started as ch

    with pytest.raises(ValueError, match="work_ms='1e12'"):
        ch.check_chapter(world_size=2, emulate=None, my_prediction=None, work_ms="1e12", steps=1, timeout_s=10.0)


def test_run_names_emulate_and_a_file_given_as_out(tmp_path, capsys):
    from labkit.cli import main

    assert main(["run", "--chapters", "00", "-p", "emulate=dgx-h101"]) == 2
    err = capsys.readouterr().err
    assert "-p emulate='dgx-h101'" in err and "None / null / off" in err and len(err.strip().splitlines()) == 1
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["run", "--chapters", "00", "--out", str(f)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_an_executed_copy_keeps_its_code_links_working(tmp_path):
    import nbformat

    from labkit import notebooks

    src = tmp_path / "repo" / "notebooks"
    (tmp_path / "repo" / "labkit").mkdir(parents=True)
    (tmp_path / "repo" / "labkit" / "x.py").write_text("")
    src.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "[x](../labkit/x.py#L1), [gone](../labkit/gone.py), [web](https://example.org), [sec](#top)")])
    out = tmp_path / "runs" / "stamp" / "00_x.ipynb"
    out.parent.mkdir(parents=True)
    nbformat.write(nb, str(out))
    assert notebooks.relink(out, src) == 1
    text = nbformat.read(str(out), as_version=4).cells[0].source
    assert "[x](../../repo/labkit/x.py#L1)" in text and "(../labkit/gone.py)" in text
    assert "(https://example.org)" in text and "(#top)" in text
    assert (out.parent / "../../repo/labkit/x.py").resolve().exists()
