"""What this host offers, read from the operating system: cores, memory, bytes a process wrote.

No torch and no pandas here: a rank, the launcher and a chapter's checks all read these cheaply.
"""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def socket_bytes_written() -> int | None:
    """Bytes this process has written through write-like system calls (``wchar`` in /proc/self/io; gloo's
    TCP sends are among them). None where /proc/self/io does not exist (not Linux)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes): what can be allocated now without swapping. None where it
    cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_bytes() -> int | None:
    """Memory of this machine in bytes: ``os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``, lowered
    to the cgroup's limit when the process runs under one (``/sys/fs/cgroup/memory.max``, cgroup v2, or
    ``memory.limit_in_bytes``, v1: containers, Slurm jobs). None where neither can be read."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            sizes.append(int(text))
    sizes = [x for x in sizes if x > 0]
    return min(sizes) if sizes else None
