"""labkit: the LLM Parallelism Lab's library.

Two kinds of modules (see DESIGN.md):

* predict — pure Python, no torch import: ``labkit.theory.spec``, ``labkit.theory.memory``, ``labkit.theory.costmodel``,
  ``labkit.theory.simulate``, ``labkit.theory.mesh``, ``labkit.theory.planner``, ``labkit.runtime.timeline``.
* run / measure — ``labkit.launch`` (the only way to start ranks; ``labkit.Pool`` keeps them warm),
  ``labkit.runtime.rank``, ``labkit.runtime.records``, ``labkit.models``, ``labkit.runtime.measure``,
  ``labkit.collectives``, ``labkit.parallel``.

``from labkit import launch`` is resolved lazily so that importing a predict module never imports torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "launch": ("labkit.runtime.launcher", "launch"),
    "Pool": ("labkit.runtime.pool", "Pool"),
    "LaunchError": ("labkit.runtime.launcher", "LaunchError"),
    "RankFailed": ("labkit.runtime.launcher", "RankFailed"),
    "LaunchTimeout": ("labkit.runtime.launcher", "LaunchTimeout"),
    "LaunchResult": ("labkit.runtime.launcher", "LaunchResult"),
    "RankContext": ("labkit.runtime.rank", "RankContext"),
    "Timeline": ("labkit.runtime.timeline", "Timeline"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
