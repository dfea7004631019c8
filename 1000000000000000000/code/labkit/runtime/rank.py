"""Inside a rank: the RankContext every launched function receives as its first argument.

The process group already exists when ``fn(ctx, ...)`` starts and is destroyed after it returns; a rank
function never calls ``init_process_group`` itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.runtime.timeline import Timeline, now_ns


@dataclass
class RankContext:
    """What a rank knows about itself.

    Attributes:
        rank: global rank, 0..world_size-1.
        world_size: number of ranks.
        local_rank: rank within this node (also the CUDA device index under NCCL).
        local_world_size: ranks on this node.
        node_rank: index of this node (0 for single-node launches).
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``torch.device("cpu")`` under gloo, ``cuda:<local_rank>`` under NCCL.
        timeline: this rank's :class:`~labkit.runtime.timeline.Timeline`; ``launch`` gathers it for you.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device
    clock_offset_ns: int = 0
    timeline: Timeline = field(init=False)

    def __post_init__(self):
        self.timeline = Timeline(self.rank, self.clock_offset_ns, sync=self.sync)

    # -- small helpers -------------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for this rank's queued device work (``torch.cuda.synchronize``); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Synchronise the device, then all ranks (``dist.barrier``)."""
        self.sync()
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def print0(self, *args, **kwargs) -> None:
        """``print`` on rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def now_ns(self) -> int:
        return now_ns()

    @contextlib.contextmanager
    def timer(self, name: str, kind: str = "compute", *, barrier: bool = False, **tags) -> Iterator[None]:
        """Time the enclosed block into ``ctx.timeline`` (device synchronised at both ends).

        ``barrier=True`` aligns all ranks before the block starts (for collective timings).
        Tags: step, microbatch, stage, nbytes.
        """
        if barrier:
            self.barrier()
        with self.timeline.span(name, kind, **tags):
            yield

    def track_async(self, work, name: str, nbytes: int = 0):
        """Put an asynchronous collective on this rank's timeline as a ``comm`` event from now (its issue) to
        its completion (:func:`labkit.runtime.training.track_async`). Returns an object whose ``wait()``
        replaces ``work.wait()``. Strategies call this on the ``ctx`` they were given, so they need not
        import the runtime."""
        from labkit.runtime.training import track_async

        return track_async(self, work, name, nbytes)

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(max(1, int(n)))


def estimate_clock_offsets(ctx: RankContext, rounds: int = 8) -> int:
    """This rank's clock minus rank 0's clock, in ns, by ping-pong with rank 0 (Cristian 1989).

    For each round rank 0 sends t0, the peer answers with its clock t1 when it receives it, and rank 0
    notes t2 on receipt; offset = t1 - (t0 + t2)/2, keeping the round with the smallest round trip.
    Every rank takes part (collective call). Returns 0 on rank 0.
    """
    best = [0] * ctx.world_size
    dev = ctx.device
    for peer in range(1, ctx.world_size):
        if ctx.rank == 0:
            best_rtt = None
            for _ in range(rounds):
                t0 = now_ns()
                dist.send(torch.tensor([t0], dtype=torch.int64, device=dev), dst=peer)
                buf = torch.zeros(1, dtype=torch.int64, device=dev)
                dist.recv(buf, src=peer)
                t2 = now_ns()
                t1 = int(buf.item())
                if best_rtt is None or t2 - t0 < best_rtt:
                    best_rtt = t2 - t0
                    best[peer] = t1 - (t0 + t2) // 2
        elif ctx.rank == peer:
            for _ in range(rounds):
                buf = torch.zeros(1, dtype=torch.int64, device=dev)
                dist.recv(buf, src=0)
                dist.send(torch.tensor([now_ns()], dtype=torch.int64, device=dev), dst=0)
    offsets = torch.tensor(best, dtype=torch.int64, device=dev)
    dist.broadcast(offsets, src=0)
    return int(offsets[ctx.rank].item())


def cpu_threads_per_rank(local_world_size: int) -> int:
    """``max(1, cores // local_world_size)``: threads per rank so ranks on a node do not oversubscribe."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def in_notebook() -> bool:
    return "ipykernel" in sys.modules
