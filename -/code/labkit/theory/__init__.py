"""Predict: pure Python, no torch. The memory calculator, the collective cost model, pipeline schedules and
their simulator, the rank grid and its rules, the planner, each strategy's byte / count formulas, cluster
profiles (:mod:`cluster`) and the emulator's deterministic replay (:mod:`replay`).

Nothing here imports torch, a strategy or the runtime (``tests/test_layout.py`` checks it), so every
function is fast enough to sit behind a widget slider.
"""
