"""``labkit notebooks DEST``: write the chapter notebooks and the data they read into a folder of your own.

For a user who installed labkit from a wheel or a git URL (a hub, a conda env): the package carries the
chapters and ``data/`` (models.yaml, hardware.yaml, reference/) inside it; this copies them out into

    DEST/notebooks/NN_topic.ipynb   the chapters (outputs stripped)
    DEST/data/...                   models.yaml, hardware.yaml, reference/ (recorded and published rows)
    DEST/docs/*.md, DEST/examples/  the guides and the multi-node scripts the chapters link to
    DEST/code/labkit/...            a reading copy of the package's code, where each chapter's "Code in this
                                    chapter" links point (never imported: the installed package is what runs)
    DEST/labkit-home.json           the marker that makes DEST the lab's home (labkit.paths)

after which ``cd DEST && labkit run`` (or ``jupyter lab notebooks/``) uses DEST's files and writes runs to
``DEST/runs/``. Existing files are left alone unless ``--force``.
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

NAME = "notebooks"
HELP = "write the chapter notebooks and the data they read to DEST (then `cd DEST && labkit run`)"


def add_arguments(p) -> None:
    p.add_argument("dest", metavar="DEST", help="folder to write (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files that already exist in DEST")


def _files(folder: Path) -> list[Path]:
    skip = {"__pycache__", ".ipynb_checkpoints"}
    return sorted(p for p in folder.rglob("*") if p.is_file() and not skip & set(p.relative_to(folder).parts))


def write_lab(dest: str | Path, *, force: bool = False) -> dict:
    """Copy the chapters (:func:`labkit.paths.notebooks_dir`, ``*.ipynb``) and the data folder
    (:func:`labkit.paths.data_dir`) into ``dest/notebooks`` and ``dest/data`` and write the home marker.

    Returns ``{"dest", "notebooks", "data_files", "source"}`` (counts and where they came from). Raises
    ValueError when ``dest`` is a file, when there are no chapters to copy, or when a file would be
    overwritten and ``force`` is False (naming how many and the first one).
    """
    import labkit
    from labkit import paths

    dest = Path(dest).expanduser().resolve()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"DEST={str(dest)!r} is a file; give a folder (it is created if missing)")
    nb_src, data_src = paths.notebooks_dir(), paths.data_dir()
    chapters = sorted(nb_src.glob("[0-9][0-9]_*.ipynb"))
    if not chapters:
        raise ValueError(f"no chapter notebooks in {nb_src} to copy ({paths.describe()})")
    plan = [(p, dest / "notebooks" / p.name) for p in chapters]
    plan += [(p, dest / "data" / p.relative_to(data_src)) for p in _files(data_src)]
    n_data = len(plan) - len(chapters)
    for name in ("docs", "examples"):
        src = paths.guide_dir(name)
        if src.is_dir():
            plan += [(p, dest / name / p.relative_to(src)) for p in _files(src) if p.name != "__init__.py"]
    code_src = Path(labkit.__file__).resolve().parent
    plan += [(p, dest / "code" / "labkit" / p.relative_to(code_src)) for p in _files(code_src)
             if p.suffix == ".py" and not {"_data", "_notebooks", "_docs"} & set(p.relative_to(code_src).parts)]
    if dest.resolve() in (nb_src.parent.resolve(), data_src.parent.resolve()):
        raise ValueError(f"DEST={str(dest)!r} is where the files come from; give another folder")
    clash = [t for _, t in plan if t.exists()]
    if clash and not force:
        raise ValueError(f"{len(clash)} file(s) already exist in {dest} (first: {clash[0].relative_to(dest)}); "
                         "add --force to overwrite them")
    for src, target in plan:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    from labkit.notebooks import rewrite_links

    for _, target in plan[:len(chapters)]:  # "Code in this chapter": ../labkit/X -> the reading copy
        rewrite_links(target, lambda link: "../code/" + link[3:] if link.startswith("../labkit/") else None)
    marker = {"labkit": labkit.__version__, "source": paths.describe(),
              "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "what": "this folder is a labkit home: `labkit run` here uses notebooks/ and data/ below it"}
    (dest / paths.HOME_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return {"dest": dest, "notebooks": len(chapters), "data_files": n_data,
            "source": paths.describe()}


def run(args) -> int:
    done = write_lab(args.dest, force=args.force)
    print(f"wrote {done['notebooks']} chapter notebooks and {done['data_files']} data files to {done['dest']}")
    print(f"next: cd {done['dest']} && labkit run --chapters 00   (or: jupyter lab notebooks/)")
    return 0
