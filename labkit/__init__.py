"""labkit: the LLM Parallelism Lab's library.

Two kinds of modules (see DESIGN.md):

* predict — pure Python, no torch import: ``labkit.spec``, ``labkit.memory``, ``labkit.costmodel``,
  ``labkit.simulate``, ``labkit.mesh``, ``labkit.planner``, ``labkit.timeline``.
* run / measure — ``labkit.launch`` (the only way to start ranks), ``labkit.rank``, ``labkit.records``,
  ``labkit.models``, ``labkit.measure``, ``labkit.collectives``, ``labkit.parallel``.

``from labkit import launch`` is resolved lazily so that importing a predict module never imports torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "launch": ("labkit.launcher", "launch"),
    "LaunchError": ("labkit.launcher", "LaunchError"),
    "RankFailed": ("labkit.launcher", "RankFailed"),
    "LaunchTimeout": ("labkit.launcher", "LaunchTimeout"),
    "LaunchResult": ("labkit.launcher", "LaunchResult"),
    "RankContext": ("labkit.rank", "RankContext"),
    "Timeline": ("labkit.timeline", "Timeline"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
