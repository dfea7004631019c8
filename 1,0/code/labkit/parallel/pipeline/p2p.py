"""Point-to-point messages between pipeline stages, every work handle waited on.

A stage sends its output activation [b, T, H] forward to the next stage's rank and its input gradient
[b, T, H] back to the previous stage's rank with ``isend``; the receiver posts ``irecv`` s early and waits on
each right before the op that consumes it. gloo can hang when only some handles of a batch are waited on,
so :class:`P2P` counts handles and refuses (``check``) to finish a step with one outstanding.

Tags name the message: the activation entering global stage ``s`` for micro-batch ``j`` and the gradient
leaving stage ``s`` for micro-batch ``j`` each get their own tag (:func:`tag`), so messages of a step can
be posted in any order and still meet the right receive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: message kinds of :func:`tag`
ACTIVATION, GRADIENT = 0, 1


def tag(kind: int, stage: int, microbatch: int, m: int) -> int:
    """p2p tag for the activation (``ACTIVATION``) entering ``stage`` or the gradient (``GRADIENT``) leaving
    it, for ``microbatch`` of ``m``."""
    return (2 * stage + kind) * m + microbatch


def tied_grad_tag(n_stages: int, m: int) -> int:
    """The tag of the tied-embedding gradient exchange: above every :func:`tag` of the step."""
    return 2 * n_stages * m + 1


class P2P:
    """isend / irecv that remember every work handle. ``drain()`` waits on all sends; ``check()`` raises
    RuntimeError when a handle was never waited on (gloo can hang when only some handles of a batch are
    waited on, so the runner refuses to finish a step with one outstanding).

    ``ctx``: anything with ``rank``, ``timeline.add(...)`` and ``now_ns()`` (a RankContext). Posting an
    isend is recorded as a ``send`` event, waiting on an irecv as a ``recv`` event (kind comm, with bytes).
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.sends: list[tuple] = []
        self.created = 0
        self.waited = 0

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, **tags) -> None:
        t0 = self.ctx.now_ns()
        work = dist.isend(tensor, dst=dst, tag=tag)
        self.created += 1
        self.sends.append((work, tensor))  # keep the tensor alive until the send completes
        self.ctx.timeline.add("send", "comm", t0, self.ctx.now_ns(), nbytes=tensor.numel() * tensor.element_size(),
                              **tags)

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        self.created += 1
        return dist.irecv(buf, src=src, tag=tag)

    def wait(self, work, buf: torch.Tensor, **tags) -> None:
        t0 = self.ctx.now_ns()
        work.wait()
        self.waited += 1
        self.ctx.timeline.add("recv", "comm", t0, self.ctx.now_ns(), nbytes=buf.numel() * buf.element_size(), **tags)

    def drain(self) -> None:
        for work, _ in self.sends:
            work.wait()
            self.waited += 1
        self.sends.clear()

    def check(self) -> None:
        if self.created != self.waited:
            raise RuntimeError(f"rank {self.ctx.rank}: {self.created - self.waited} p2p work handle(s) were never "
                               "waited on; every isend/irecv handle must be waited on")
