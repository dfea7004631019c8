"""A symmetric heap for the ranks of one host: one shared-memory segment that every rank maps, a same-shaped
slot per rank, and NVSHMEM's one-sided verbs on it (NVSHMEM docs, "Memory Model" and "Remote Memory Access":
``put``, ``get``, ``signal`` / ``wait_until`` on flags, ``quiet``).

Layout of the segment (bytes)::

    [ slot 0 | slot 1 | ... | slot n-1 ]      slot r = [ data: nbytes (64-byte aligned) | flags: n_flags x int64 ]

Rank r's *symmetric* address ``offset`` is byte ``r * slot + offset``: the same offset names the same object on
every rank, so a rank writes into a peer's buffer without the peer taking part (a one-sided put), and tells it
with a flag (``signal``), which the peer polls (``wait_until``) with a bound.

Lifetime: rank 0 creates the segment (``/dev/shm/labkit-heap-<pid>-<random>``, mode 0600: only this user can
open it), sends its name to the others over the process group, every rank maps it, and after a barrier rank 0
**unlinks the name at once**: the mappings live on, but no file is left to leak, whatever kills a rank later.
A run killed inside that short window leaves a segment whose creator is dead: the next heap created by this
user removes those (:func:`sweep_stale`).

Memory ordering: on x86-64 (total store order) a put's stores are seen before a later ``signal``'s; elsewhere
``quiet`` is a barrier over the group. This is a CPU model of the mechanism, not a GPU one: a put is a
``memcpy`` by the calling process (what NVSHMEM's ``nvshmem_putmem`` over NVLink is, done by the SMs).

The emulator's tracer does not see puts and flag waits (they are plain memory operations): under
``launch(..., emulate=...)`` the heap refuses to start, naming the way out (the send/recv ring of
:mod:`labkit.parallel.onesided.collective_matmul`, which the tracer prices).
"""

from __future__ import annotations

import os
import platform
import secrets
import sys
import time
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

PREFIX = "labkit-heap-"
SHM_DIR = "/dev/shm"
NAME_BYTES = 64
ALIGN = 64
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove this user's heap segments whose creating process is gone (a run killed between creating a
    segment and unlinking it). Returns the names removed. Segments of live processes and of other users are
    left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            path = os.path.join(directory, name)
            if os.stat(path).st_uid != os.getuid() or _alive(pid):
                continue
            os.unlink(path)
            removed.append(name)
        except (ValueError, OSError):
            continue
    return removed


def _emulating() -> bool:
    """True inside an emulated rank (the runtime's tracer is active). Looked up in sys.modules, not imported:
    strategies never import the runtime."""
    state = sys.modules.get("labkit.runtime.emulate.state")
    return getattr(state, "ACTIVE", None) is not None


class SymmetricHeap:
    """One shared-memory segment mapped by every rank of ``group``, a slot of ``nbytes`` + ``n_flags`` int64
    flags per rank (module docstring). Collective to create (every rank of the group calls it) and to close.

    Args:
        nbytes: data bytes per rank (>= 1).
        n_flags: int64 flags per rank (>= 1), all 0 at start.
        group: the process group (default: the world). Its ranks must share this host.
        timeout_s: bound of every :meth:`wait_until` unless it gives its own.

    Raises ValueError for non-positive sizes, RuntimeError under emulation (the tracer cannot see puts).
    """

    def __init__(self, nbytes: int, *, n_flags: int = 64, group=None, timeout_s: float = 30.0):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"nbytes={nbytes!r} must be an int >= 1 (data bytes per rank)")
        if isinstance(n_flags, bool) or not isinstance(n_flags, int) or n_flags < 1:
            raise ValueError(f"n_flags={n_flags!r} must be an int >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        if _emulating():
            raise RuntimeError("SymmetricHeap cannot be emulated: its puts and flag waits are memory operations the "
                               "emulator's tracer does not see; emulate the send/recv ring version "
                               "(labkit.parallel.onesided.collective_matmul) or run without emulate=")
        self.group, self.timeout_s = group, float(timeout_s)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.nbytes, self.n_flags = nbytes, n_flags
        self.data_bytes = _align(nbytes)
        self.slot = self.data_bytes + _align(8 * n_flags)
        name = torch.zeros(NAME_BYTES, dtype=torch.uint8)  # [64]: the segment's name, NUL-padded
        self._shm = None
        if self.rank == 0:
            sweep_stale()
            nm = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            self._shm = shared_memory.SharedMemory(name=nm, create=True, size=self.world_size * self.slot)
            name[: len(nm)] = torch.tensor(list(nm.encode()), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        nm = bytes(name.tolist()).rstrip(b"\0").decode()
        if not nm.startswith(PREFIX):
            raise RuntimeError(f"rank {self.rank}: received a heap name {nm!r} that is not a labkit heap")
        if self._shm is None:
            self._shm = _attach(nm)
        dist.barrier(group=group)  # every rank has mapped the segment ...
        if self.rank == 0:
            self._shm.unlink()  # ... so its name goes now: nothing is left behind however a rank ends
        self.name = nm
        self._bytes = torch.frombuffer(self._shm.buf, dtype=torch.uint8)  # [n * slot], every rank's slot
        if self.rank == 0:
            self._bytes.zero_()
        dist.barrier(group=group)
        self.puts = 0
        self.put_bytes = 0

    # -- addresses ---------------------------------------------------------------------------------------------
    def _check_rank(self, what: str, r: int) -> int:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} must be a rank of the group, 0..{self.world_size - 1}")
        return r

    def _range(self, r: int, offset: int, nbytes: int) -> tuple[int, int]:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"offset={offset!r} with {nbytes} bytes does not fit the heap's {self.nbytes} data "
                             f"bytes per rank; give 0 <= offset <= {self.nbytes - nbytes}")
        lo = r * self.slot + offset
        return lo, lo + nbytes

    def view(self, rank: int, shape, dtype: torch.dtype = torch.float32, offset: int = 0) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at symmetric address ``offset`` of ``rank``'s slot: this rank's
        own buffer (rank = self.rank) or a peer's (writing into it is a put). ``offset`` must be a multiple of
        the dtype's size. Raises ValueError when it does not fit or is misaligned."""
        r = self._check_rank("rank", rank)
        size = torch.Size(shape)
        esize = torch.empty((), dtype=dtype).element_size()
        if offset % esize:
            raise ValueError(f"offset={offset} must be a multiple of {esize} bytes for {dtype}")
        lo, hi = self._range(r, offset, size.numel() * esize)
        return self._bytes[lo:hi].view(dtype).view(size)

    def _flags(self, r: int) -> torch.Tensor:
        lo = r * self.slot + self.data_bytes
        return self._bytes[lo: lo + 8 * self.n_flags].view(torch.int64)  # [n_flags]

    # -- one-sided verbs ---------------------------------------------------------------------------------------
    def put(self, dst: int, tensor: torch.Tensor, offset: int = 0) -> None:
        """Copy ``tensor`` (any shape, contiguous or not) into ``dst``'s slot at byte ``offset``; ``dst`` takes
        no part. Raises ValueError when it does not fit."""
        r = self._check_rank("dst", dst)
        src = tensor.detach().contiguous().view(-1).view(torch.uint8)  # [bytes]
        lo, hi = self._range(r, offset, src.numel())
        self._bytes[lo:hi].copy_(src)
        self.puts += 1
        self.put_bytes += src.numel()

    def put_strided(self, dst: int, tensor: torch.Tensor, into_shape, index) -> None:
        """Write ``tensor`` into the part ``index`` (a tuple of slices) of the [``into_shape``] tensor (same dtype)
        that starts at offset 0 of ``dst``'s slot: a strided put straight to the final address (no packing on
        either side). Raises ValueError when the shapes disagree."""
        out = self.view(dst, into_shape, tensor.dtype)
        part = out[index]
        if part.shape != tensor.shape:
            raise ValueError(f"put_strided: tensor {tuple(tensor.shape)} does not match the target part "
                             f"{tuple(part.shape)} of {tuple(into_shape)}")
        part.copy_(tensor)
        self.puts += 1
        self.put_bytes += tensor.numel() * tensor.element_size()

    def get(self, src: int, shape, dtype: torch.dtype = torch.float32, offset: int = 0) -> torch.Tensor:
        """A copy of the [``shape``] ``dtype`` tensor at ``offset`` of ``src``'s slot (a one-sided get)."""
        return self.view(src, shape, dtype, offset).clone()

    def signal(self, dst: int, flag: int, value: int = 1) -> None:
        """Set ``dst``'s flag ``flag`` to ``value`` (one aligned 8-byte store), after every earlier put of this
        rank is visible (x86-64 store order; elsewhere call :meth:`quiet` first)."""
        r = self._check_rank("dst", dst)
        f = self._flag_index(flag)
        self._flags(r)[f].fill_(int(value))

    def _flag_index(self, flag: int) -> int:
        if isinstance(flag, bool) or not isinstance(flag, int) or not 0 <= flag < self.n_flags:
            raise ValueError(f"flag={flag!r} must be 0..{self.n_flags - 1} (the heap has n_flags={self.n_flags})")
        return flag

    def flag(self, flag: int) -> int:
        """This rank's flag ``flag`` now."""
        return int(self._flags(self.rank)[self._flag_index(flag)])

    def wait_until(self, flag: int, value: int, *, timeout_s: float | None = None) -> float:
        """Wait until this rank's flag ``flag`` is >= ``value``; returns the seconds waited. Raises TimeoutError
        naming the rank, the flag, the value awaited and the value seen when ``timeout_s`` (default the heap's)
        passes: a missing signal fails, it never hangs."""
        f = self._flag_index(flag)
        cell = self._flags(self.rank)[f: f + 1]  # [1]
        bound = self.timeout_s if timeout_s is None else float(timeout_s)
        t0 = time.perf_counter()
        spins = 0
        while int(cell[0]) < value:
            waited = time.perf_counter() - t0
            if waited > bound:
                raise TimeoutError(f"rank {self.rank}: flag {flag} still {int(cell[0])} after {bound:g} s waiting "
                                   f"for >= {value} (a peer never signalled it)")
            spins += 1
            if spins > 100:
                time.sleep(20e-6)  # let the producer run on a 2-core laptop
        return time.perf_counter() - t0

    def quiet(self) -> None:
        """Every put of this rank is complete and visible to its target. Puts are synchronous copies, so on
        x86-64 this is free; elsewhere it is a barrier over the group (a full memory fence on every rank)."""
        if not _TSO:
            dist.barrier(group=self.group)

    def barrier(self) -> None:
        """A barrier over the group (NVSHMEM's ``barrier_all``: quiet, then wait for everyone)."""
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Unmap the segment (every view into it becomes invalid). Collective-free; idempotent."""
        if self._shm is None:
            return
        self._bytes = None
        try:
            self._shm.close()
        except BufferError:  # a view of the caller's still holds the mapping: it goes with the process
            pass
        self._shm = None

    def __enter__(self) -> SymmetricHeap:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map the segment ``name`` without registering it with Python's resource tracker (only the creator owns
    it; an attached rank's tracker would otherwise unlink it, or warn of a "leak", at exit)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (the stdlib's own key)
    except Exception:  # noqa: BLE001 - best effort: the creator unlinks the name anyway
        pass
    return shm
