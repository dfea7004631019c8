"""Install anywhere: labkit.paths decides where data/, notebooks/ and runs/ are; the wheel carries them.

The fast tests check the order of labkit.paths (LABKIT_HOME, a lab folder written by ``labkit notebooks``, the
source checkout, the installed package) and ``labkit notebooks DEST``. The slow one builds the wheel from the
project's files, installs it into a fresh venv outside the checkout (``--no-deps``; the dependencies come from
this venv's site-packages through a ``.pth`` line, since a fresh torch install takes minutes) and runs
``labkit memory`` and ``labkit run --chapters 00`` there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from labkit import paths
from labkit.commands.notebooks import write_lab

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LABKIT_HOME", raising=False)
    monkeypatch.delenv("LABKIT_RUNS", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_source_checkout_is_the_home_here(clean_env):
    root, how = paths.home()
    assert (root, how) == (ROOT, "source checkout")
    assert paths.data_dir() == ROOT / "data" and paths.notebooks_dir() == ROOT / "notebooks"
    assert paths.runs_dir() == ROOT / "runs"


def test_labkit_home_wins(clean_env, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(clean_env))
    assert paths.home() == (clean_env.resolve(), "LABKIT_HOME")
    assert paths.data_dir() == clean_env.resolve() / "data"
    monkeypatch.setenv("LABKIT_RUNS", str(clean_env / "elsewhere"))
    assert paths.runs_dir() == (clean_env / "elsewhere").resolve()


def test_installed_package_uses_its_own_copies(clean_env, monkeypatch):
    monkeypatch.setattr(paths, "_checkout", lambda: None)
    assert paths.home() == (None, "installed package")
    pkg = Path(paths.__file__).resolve().parent
    assert paths.data_dir() == pkg / "_data" and paths.notebooks_dir() == pkg / "_notebooks"
    assert paths.runs_dir() == clean_env.resolve() / "runs"  # runs go to the current directory
    assert "installed package" in paths.describe()
    with pytest.raises(ValueError, match="valid: data, notebooks"):
        paths.packaged("runs")


def test_notebooks_command_writes_a_lab_home(clean_env, monkeypatch):
    dest = clean_env / "lab"
    done = write_lab(dest)
    chapters = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(p.name for p in (dest / "notebooks").glob("*.ipynb")) == chapters
    assert done["notebooks"] == len(chapters)
    for name in ("models.yaml", "hardware.yaml"):
        assert (dest / "data" / name).read_bytes() == (ROOT / "data" / name).read_bytes()
    assert (dest / "data" / "reference").is_dir()
    marker = json.loads((dest / paths.HOME_MARKER).read_text())
    assert marker["labkit"] and "source checkout" in marker["source"]
    # inside the lab folder (or below it: a kernel starts in notebooks/) the lab folder is the home
    monkeypatch.chdir(dest / "notebooks")
    assert paths.home() == (dest.resolve(), "lab folder")
    assert paths.notebooks_dir() == dest.resolve() / "notebooks" and paths.runs_dir() == dest.resolve() / "runs"
    monkeypatch.chdir(clean_env)
    with pytest.raises(ValueError, match="already exist.*--force"):
        write_lab(dest)
    write_lab(dest, force=True)
    (clean_env / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        write_lab(clean_env / "afile")


def _broken_links(folder: Path) -> list[str]:
    """Relative links in the notebooks of ``folder`` whose file does not exist."""
    from labkit.notebooks import _LINK

    bad = []
    for nb in folder.glob("*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                bad += [f"{nb.name}: {m.group(1)}" for m in _LINK.finditer("".join(cell["source"]))
                        if not (nb.parent / m.group(1)).exists()]
    return bad


def test_every_chapter_link_works_in_the_checkout_and_in_a_lab_folder(clean_env):
    assert not _broken_links(ROOT / "notebooks")
    write_lab(clean_env / "lab")
    assert not _broken_links(clean_env / "lab" / "notebooks")
    assert (clean_env / "lab" / "docs" / "emulation.md").is_file()
    assert not (clean_env / "lab" / "labkit").exists(), "the reading copy must never shadow the installed package"


def test_notebooks_command_line(clean_env):
    from labkit.cli import main

    assert main(["notebooks", str(clean_env / "lab")]) == 0
    assert main(["notebooks", str(clean_env / "lab")]) == 2  # exists: one line, exit 2


def _copy_project(dest: Path) -> None:
    """The project's files as git sees them (tracked, and untracked but not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the project's files")
    src, wheels, venv, work = (tmp_path / n for n in ("src", "wheels", "venv", "work"))
    _copy_project(src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = wheels.glob("labkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("labkit/_data/models.yaml", "labkit/_data/hardware.yaml",
                 "labkit/_notebooks/00_getting_started.ipynb", "labkit/_docs/emulation.md"):
        assert must in names, f"{must} missing from the wheel"
    assert not [n for n in names if n.startswith(("data/", "notebooks/"))]

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # dependencies (torch, jupyter, ...) from this venv; the wheel installed into the fresh one comes first
    Path(purelib, "_labkit_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "install", "--no-deps", "--target", purelib, str(wheel)], check=True,
                   capture_output=True, timeout=300)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LABKIT_HOME", "LABKIT_RUNS", "PYTHONPATH")}
    env["JUPYTER_PATH"] = str(tmp_path / "jupyter")  # no user kernel specs: the venv's own python3 kernel

    def run(*args, cwd=work, timeout=120):
        return subprocess.run([str(py), "-P", "-c", "import sys; from labkit.cli import main; sys.exit(main())", *args],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    where = subprocess.run([str(py), "-P", "-c", "import labkit, labkit.paths as p; print(labkit.__file__); "
                            "print(p.home()[1])"], cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.splitlines() == [str(Path(purelib, "labkit", "__init__.py")), "installed package"]
    mem = run("memory", "--model", "llama-3-70b", "--mode", "train", "--dp", "8", "--tp", "8", "--pp", "2",
              "--zero", "1", "--seq", "4096", "--sp", "--device", "h100-80gb")
    assert mem.returncode == 0, mem.stderr
    assert "h100-80gb" in mem.stdout and "GiB" in mem.stdout

    made = run("notebooks", "lab")
    assert made.returncode == 0, made.stderr
    lab = work / "lab"
    assert not _broken_links(lab / "notebooks"), "a chapter's link points nowhere in the lab folder"
    kernel = subprocess.run([str(py), "-P", "-c", "from jupyter_client.kernelspec import KernelSpecManager as K; "
                             "print(K().get_kernel_spec('python3').argv[0])"], cwd=lab, env=env,
                            capture_output=True, text=True, check=True)
    assert kernel.stdout.strip() == str(py), "the chapters must run in the fresh venv's kernel"
    ran = run("run", "--chapters", "00", cwd=lab, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "1/1 chapters ok" in ran.stdout
    assert list((lab / "runs").glob("*/00_getting_started.ipynb")), "the executed chapter lands in DEST/runs/"
    assert not _broken_links(next((lab / "runs").glob("*/"))), "the executed copy's links must still work"
