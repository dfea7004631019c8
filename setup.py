"""Packaging beyond pyproject.toml: ship data/ and notebooks/ inside the wheel, from their one copy in git.

setuptools maps two extra packages onto the checkout's folders (``package_dir``), so a wheel or an sdist holds

* ``labkit/_data/``      <- ``data/``       (models.yaml, hardware.yaml, reference/ with published/ rows)
* ``labkit/_notebooks/`` <- ``notebooks/``  (the chapter notebooks, outputs stripped as they are in git)

without a second copy of either folder in git. :mod:`labkit.paths` finds them with ``importlib.resources``
when no ``$LABKIT_HOME``, lab folder (``labkit notebooks DEST``) or source checkout is there to win. Every
other setting (metadata, dependencies, scripts) lives in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["labkit", "labkit.*"]), "labkit._data", "labkit._notebooks"],
    package_dir={"labkit._data": "data", "labkit._notebooks": "notebooks"},
    package_data={"labkit._data": ["*.yaml", "reference/**/*"], "labkit._notebooks": ["*.ipynb"]},
    exclude_package_data={"labkit._notebooks": [".ipynb_checkpoints/*"]},
)
