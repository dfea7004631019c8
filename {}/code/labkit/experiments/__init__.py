"""Rank functions that tests, benchmarks and chapters share (parity, counting, timing), one module per topic.

``labkit.experiments:hello`` and ``labkit.experiments:straggler_all_reduce`` stay valid torchrun targets.
"""

from labkit.experiments.basics import hello, probe_collectives, straggler_all_reduce

__all__ = ["hello", "probe_collectives", "straggler_all_reduce"]
