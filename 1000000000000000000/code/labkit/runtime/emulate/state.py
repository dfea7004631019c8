"""Process-wide emulation state (no torch import): the active rank-side tracer, and the ambient emulation a
``with labkit.runtime.emulate.emulation(...)`` block gives every ``launch`` inside it."""

from __future__ import annotations

#: the rank's active :class:`labkit.runtime.emulate.tracer.Tracer` (None outside an emulated rank)
ACTIVE = None
#: the stack of ambient emulation specs of the calling process (``emulation(...)`` blocks)
AMBIENT: list = []
