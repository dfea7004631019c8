"""Packaging beyond pyproject.toml: ship data/ and notebooks/ inside the wheel, from their one copy in git.

setuptools maps four extra packages onto the checkout's folders (``package_dir``), so a wheel or an sdist holds

* ``labkit/_data/``      <- ``data/``       (models.yaml, hardware.yaml, reference/ with published/ rows)
* ``labkit/_notebooks/`` <- ``notebooks/``  (the chapter notebooks, outputs stripped as they are in git)
* ``labkit/_docs/``      <- ``docs/``       (the guides the chapters link to)
* ``labkit/_examples/``  <- ``examples/``   (the multi-node scripts chapter 11 links to)

without a second copy of either folder in git. :mod:`labkit.paths` finds them with ``importlib.resources``
when no ``$LABKIT_HOME``, lab folder (``labkit notebooks DEST``) or source checkout is there to win. Every
other setting (metadata, dependencies, scripts) lives in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["labkit", "labkit.*"]), "labkit._data", "labkit._notebooks", "labkit._docs",
              "labkit._examples"],
    package_dir={"labkit._data": "data", "labkit._notebooks": "notebooks", "labkit._docs": "docs",
                 "labkit._examples": "examples"},
    package_data={"labkit._data": ["*.yaml", "reference/**/*"], "labkit._notebooks": ["*.ipynb"],
                  "labkit._docs": ["*.md"], "labkit._examples": ["slurm/*"]},
    exclude_package_data={"labkit._notebooks": [".ipynb_checkpoints/*"]},
)
