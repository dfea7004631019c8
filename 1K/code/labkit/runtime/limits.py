"""How many ranks this host can hold, and what killed a rank that was SIGKILLed.

**World-size cap.** Every rank is a Python interpreter with torch loaded. Measured on torch 2.13 (CPU
build, gloo, Linux, Python 3.11), a rank after ``init_process_group`` and one all_reduce has RSS 224 MiB,
of which 144 MiB are its own (USS; the rest are torch's shared libraries) — see PHASE1.md / the test
``test_rank_footprint_is_what_the_cap_assumes``. :data:`RANK_FOOTPRINT_BYTES` = 512 MiB allows for that
plus the lab's tiny models, their activations and allocator slack. A launch of ``world_size`` ranks is
refused before anything starts when ``world_size x 512 MiB`` exceeds the memory available now (MemAvailable,
and what the cgroup limit leaves), naming the largest world size that fits: on a 24 GiB laptop with ~20 GiB
free that is 40, so the 16-rank emulated runs fit; ``world_size=1000`` does not.

Override it explicitly: ``launch(..., max_world_size=N)`` / ``Pool(..., max_world_size=N)``, or
``LABKIT_MAX_WORLD_SIZE=N`` in the environment (also for ``labkit doctor``, ``labkit bench``, ``labkit run``).

**OOM named.** A rank killed by SIGKILL was either taken by the kernel's OOM killer or killed by someone.
:func:`describe_sigkill` compares the OOM-kill counters read before the run and after the death (the
cgroup's ``oom_kill`` and the machine's /proc/vmstat ``oom_kill``) and states the rank's memory high-water
mark (VmHWM, sampled by the supervisor) beside the memory available, so the message says which it was.
"""

from __future__ import annotations

import os

from labkit.runtime import probes

MiB = 2**20
GiB = 2**30
RANK_FOOTPRINT_BYTES = 512 * MiB
ENV_MAX_WORLD_SIZE = "LABKIT_MAX_WORLD_SIZE"


def available_bytes() -> int | None:
    """Memory that new processes can take now: MemAvailable, lowered to what the cgroup limit leaves."""
    avail = probes.available_memory_bytes()
    cg = probes.cgroup_memory()
    if cg["limit"] is not None and cg["usage"] is not None:
        left = max(0, cg["limit"] - cg["usage"])
        avail = left if avail is None else min(avail, left)
    return avail


def largest_world_size(per_rank_bytes: int = RANK_FOOTPRINT_BYTES) -> int | None:
    """``available_bytes() // per_rank_bytes`` (at least 1), or None when memory cannot be read."""
    avail = available_bytes()
    return None if avail is None else max(1, avail // per_rank_bytes)


def _explicit_cap(max_world_size) -> tuple[int | None, str]:
    from labkit.checks import positive_int

    if max_world_size is not None:
        return positive_int("max_world_size", max_world_size), "max_world_size"
    env = os.environ.get(ENV_MAX_WORLD_SIZE)
    if env:
        try:
            return positive_int(ENV_MAX_WORLD_SIZE, int(env)), ENV_MAX_WORLD_SIZE
        except ValueError:
            raise ValueError(f"{ENV_MAX_WORLD_SIZE}={env!r} must be an integer >= 1") from None
    return None, ""


def check_world_size(world_size: int, max_world_size=None, *, name: str = "world_size") -> None:
    """Raise ValueError, before anything is started, when ``world_size`` ranks do not fit in host memory (or
    exceed an explicit ``max_world_size`` / ``$LABKIT_MAX_WORLD_SIZE``), naming the largest that fits and how to
    override. Bounded time: a few /proc reads."""
    cap, source = _explicit_cap(max_world_size)
    if cap is not None:
        if world_size > cap:
            raise ValueError(f"{name}={world_size} is above {source}={cap}; the largest world_size allowed is {cap}")
        return
    avail = available_bytes()
    if avail is None:
        return  # cannot tell (not Linux): nothing to refuse on
    fits = max(1, avail // RANK_FOOTPRINT_BYTES)
    if world_size > fits:
        need = world_size * RANK_FOOTPRINT_BYTES
        if world_size > 1024 * fits:  # a typo, not a tight fit: no override to suggest
            override = ""
        elif name.startswith("-"):  # the command line has no max_world_size option: the environment does it
            override = f" (to launch anyway set {ENV_MAX_WORLD_SIZE}={world_size})"
        else:
            override = f" (to launch anyway pass max_world_size={world_size} or set {ENV_MAX_WORLD_SIZE}={world_size})"
        raise ValueError(
            f"{name}={world_size} does not fit in this host's memory: {world_size} ranks x "
            f"{RANK_FOOTPRINT_BYTES / MiB:.0f} MiB per rank = {need / GiB:.3g} GiB, {avail / GiB:.1f} GiB available; "
            f"the largest world_size that fits is {fits}{override}")


def oom_kill_counts() -> dict:
    """``{"cgroup": n or None, "system": n or None}``: OOM kills so far (this cgroup; the machine)."""
    return {"cgroup": probes.cgroup_memory()["oom_kill"], "system": probes.system_oom_kills()}


def _gib(n) -> str:
    return f"{n / GiB:.2f} GiB" if n is not None else "unknown"


def describe_sigkill(before: dict, after: dict, hwm_bytes: int | None) -> str:
    """What a SIGKILL most likely was, in one sentence, from the OOM counters before and after and the rank's
    high-water mark."""
    peak = f"its memory high-water mark was {_gib(hwm_bytes)} (VmHWM)"
    avail = f"{_gib(available_bytes())} available now"
    def grew(k):
        return before.get(k) is not None and after.get(k) is not None and after[k] > before[k]

    if grew("cgroup"):
        return (f"out of memory: the kernel's OOM killer ended it (cgroup oom_kill {before['cgroup']} -> "
                f"{after['cgroup']}); {peak}, {avail}. Use fewer ranks or a smaller model, or give the machine more "
                "memory")
    if grew("system"):
        return (f"probably out of memory: the kernel's OOM killer killed a process on this machine during the run "
                f"(/proc/vmstat oom_kill {before['system']} -> {after['system']}); {peak}, {avail}")
    if all(before.get(k) is None or after.get(k) is None for k in ("cgroup", "system")):
        return f"not known whether by the OOM killer (no OOM counter readable here); {peak}, {avail}"
    return (f"not by the OOM killer (the OOM-kill counters did not move); something sent it SIGKILL; {peak}, "
            f"{avail}")
