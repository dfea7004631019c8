"""Replicated data parallelism: every rank holds the whole model and a slice of the batch, and gradients
are averaged over ranks before each optimizer step.

Three ways to do it, side by side:

* :class:`DataParallelNaive` (``naive.py``) — after the whole backward, one blocking ``all_reduce`` per
  gradient tensor. Simple; every byte of communication is exposed (nothing computes while it runs).
* :class:`DataParallelBucket` (``bucketed.py``) — gradients are packed into buckets (reverse parameter
  order, which is roughly the order backward produces them); a bucket's ``all_reduce`` is launched
  asynchronously from a gradient hook the moment its last gradient is ready, so communication overlaps the
  rest of backward (Li et al. 2020, "PyTorch Distributed", Sec. 3.2 and 4.2: bucketing and overlap).
* :func:`torch_ddp` (``torch_native.py``) — ``torch.nn.parallel.DistributedDataParallel`` (the C++
  reducer doing the same), with an optional comm hook that logs each bucket's all-reduce.

All three divide by the group size and average, support gradient accumulation with ``no_sync()`` (forward
and backward inside it skip synchronisation, as in DDP), take their options keyword-only after ``module``
(``bucket_cap_mb`` as DDP, None = one bucket), keep the user's model as ``.module``, and follow the wrapper
protocol of :mod:`labkit.runtime.training`. The hand-written two synchronise at the end of every backward by
themselves (a plain loop needs no extra call), whichever forward built the graph; ``docs/use-in-your-loop.md``
shows each in a plain training loop beside the torch call it mirrors.

Communication per step (ring all-reduce, Patarasuk & Yuan 2009): each rank sends 2(n-1)/n · Ψ · bytes per
element, for Ψ parameters — :func:`labkit.theory.data.predicted_allreduce_bytes`. The runs that measure it
are in :mod:`labkit.experiments.data`.
"""

from labkit.parallel.data.bucketed import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_BYTES,
    DataParallelBucket,
    bucket_cap,
)
from labkit.parallel.data.naive import DataParallelNaive, broadcast_parameters, module_device, queue_after_backward
from labkit.parallel.data.torch_native import logged_allreduce_hook, torch_ddp

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES", "DataParallelBucket",
           "DataParallelNaive", "broadcast_parameters", "bucket_cap", "logged_allreduce_hook", "module_device",
           "queue_after_backward", "torch_ddp"]
