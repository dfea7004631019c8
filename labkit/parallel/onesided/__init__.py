"""Fine-grained overlap and one-sided communication, on the ranks of one host.

Reading order:

* ``heap.py`` — :class:`SymmetricHeap`: one shared-memory segment every rank maps, NVSHMEM's one-sided verbs
  (``put``, ``get``, ``signal`` / ``wait_until``, ``quiet``) with bounded waits, nothing left behind;
* ``collective_matmul.py`` — all-gather + matmul and matmul + reduce-scatter, plain and split into chunks that
  overlap with the matmul (torch's async TP pattern, by hand);
* ``patterns.py`` — producer/consumer by tiles (one-sided puts and flags vs one send), and the TP -> DP
  re-partition (all-to-all with its two permutation passes vs strided puts to final addresses).

The predictions (makespan and hidden fraction per chunk count, bytes and passes of the re-partition) are
:mod:`labkit.theory.overlap`; the runs are :mod:`labkit.experiments.onesided`. Where CUDA runs, torch's
symmetric memory (``torch.distributed._symmetric_memory``) is the GPU form of the heap; the lab's heap is the
CPU one (processes of one host sharing a segment).
"""

from labkit.parallel.onesided.collective_matmul import (
    allgather_matmul,
    allgather_matmul_chunked,
    matmul_reducescatter,
    matmul_reducescatter_chunked,
)
from labkit.parallel.onesided.heap import SymmetricHeap, sweep_stale
from labkit.parallel.onesided.patterns import (
    repartition_alltoall,
    repartition_onesided,
    tiles_one_sided,
    tiles_two_sided,
)

__all__ = ["SymmetricHeap", "allgather_matmul", "allgather_matmul_chunked", "matmul_reducescatter",
           "matmul_reducescatter_chunked", "repartition_alltoall", "repartition_onesided", "sweep_stale",
           "tiles_one_sided", "tiles_two_sided"]
