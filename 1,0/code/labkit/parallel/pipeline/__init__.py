"""Pipeline parallelism: the schedules of :mod:`labkit.theory.simulate`, executed action by action on real ranks.

* :mod:`.stage` — :class:`StageModule` (the model cut into ``pp * v`` consecutive stages), ZB-H1's split
  backward (:class:`WeightGradStore`, :func:`defer_weight_grads`), the tied embedding's gradient sum.
* :mod:`.p2p` — :class:`P2P`: isend / irecv between stages with every handle waited on; message tags.
* :mod:`.runner` — hand-written: :class:`ScheduleRunner` walks ``schedule.actions[rank]`` (GPipe, 1F1B,
  interleaved 1F1B, ZB-H1: the very lists the simulator runs), with :class:`StageCompute` (the real model)
  or :class:`StandInCompute` (sleeping stand-ins of fixed F/B/W durations). gloo only.
* :mod:`.torch_native` — :class:`TorchPipeline`: ``torch.distributed.pipelining`` on the same stage modules,
  its calls timed into the timeline; :func:`torch_pipeline_order` reads torch's planned order.

Launching, bubbles measured from timelines and the assembled runs are in :mod:`labkit.experiments.pipeline`;
the job checks (before any launch) in :mod:`labkit.theory.pipeline`.
"""

from labkit.parallel.pipeline.p2p import P2P
from labkit.parallel.pipeline.runner import ScheduleRunner, StageCompute, StandInCompute
from labkit.parallel.pipeline.stage import (
    StageModule,
    WeightGradStore,
    build_stages,
    defer_weight_grads,
    named_grads,
    sync_tied_grads,
)
from labkit.parallel.pipeline.torch_native import TorchPipeline, torch_pipeline_order

__all__ = ["P2P", "ScheduleRunner", "StageCompute", "StageModule", "StandInCompute", "TorchPipeline",
           "WeightGradStore", "build_stages", "defer_weight_grads", "named_grads", "sync_tied_grads",
           "torch_pipeline_order"]
