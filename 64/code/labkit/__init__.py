"""labkit: the LLM Parallelism Lab's library.

Rooms (docs/architecture.md): ``labkit.parallel`` (the strategies), ``labkit.theory`` (predictions: pure
Python, no torch), ``labkit.runtime`` (``launch``, a ``Pool`` of warm ranks, and measuring),
``labkit.experiments`` (rank functions), ``labkit.chapters`` (one module per chapter notebook), and the views
(plots, widgets, notebooks, cli).

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
