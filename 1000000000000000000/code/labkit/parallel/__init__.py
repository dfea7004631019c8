"""The strategies, and nothing else: one sub-package per strategy, the hand-written variant beside the
torch-native one. No launching, no tables, no figures here (``tests/test_layout.py`` checks the imports):
a strategy that records its collectives on a rank's timeline takes an optional ``ctx`` with
``ctx.timeline`` and ``ctx.now_ns()``.
"""
