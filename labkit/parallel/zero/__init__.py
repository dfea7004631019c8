"""Sharded data parallelism: ZeRO stages 1, 2 and 3 written from scratch, and torch's FSDP2 beside them.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
removes the redundancy of replicated data parallelism one model state at a time: stage 1 (P_os) the
optimizer state, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the parameters.

* ``units.py`` — ``_Unit``: a group of parameters laid out in one flat buffer [padded], padded to a
  multiple of n; rank r owns the shard [r·k, (r+1)·k), k = padded/n; gather (all-gather), free, and
  reduce-scatter of its gradients;
* ``wrapper.py`` — :class:`ZeroDataParallel`: stages 1-3 over those units (hooks, the wrapper protocol of
  :mod:`labkit.runtime.training`); ``guards.py`` what it checks (``ignored_params``, the optimizer) and casts;
* ``fsdp2.py`` — :func:`fsdp2`: torch's ``fully_shard`` (stage 3), and :func:`check_fsdp_devices`;
* ``optimizer.py`` — :class:`ShardedOptimizer`: ZeRO-1 as an optimizer wrapper (torch's
  ``ZeroRedundancyOptimizer`` shape), state sharded by parameter, on top of any DDP.

Frozen parameters (``requires_grad=False``) never enter a shard, a reduction or the optimizer; how each of
these drops into a plain training loop, beside the torch call it mirrors, is ``docs/use-in-your-loop.md``.

Model-state bytes per rank are predicted by the lab's calculator (``labkit.theory.memory``, convention
"torch-fp32") and for these exact layouts by :func:`labkit.theory.zero.layout_bytes`; communication per
step by :func:`labkit.theory.zero.predicted_comm_bytes`. The runs that measure both are in
:mod:`labkit.experiments.zero`.
"""

from labkit.parallel.zero.fsdp2 import BACKEND_DEVICE, check_fsdp_devices, fsdp2
from labkit.parallel.zero.optimizer import ShardedOptimizer
from labkit.parallel.zero.wrapper import ZeroDataParallel

__all__ = ["BACKEND_DEVICE", "ShardedOptimizer", "ZeroDataParallel", "check_fsdp_devices", "fsdp2"]
