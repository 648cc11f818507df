"""This process's host as its KV peers compare it (`core/kvlinks.py`): the kernel's boot id and the hostname, so
two engines share memory only when they run in the same boot of the same machine (a container with its own
/proc keeps the host's boot id; a restarted or cloned machine gets a new one). It reads; it decides nothing."""

from __future__ import annotations

import functools
import socket

BOOT_ID = "/proc/sys/kernel/random/boot_id"


@functools.cache
def host_id() -> str:
    """`<boot id>@<hostname>`, or "" where the boot id cannot be read (then no peer counts as this host)."""
    try:
        with open(BOOT_ID) as file:
            boot = file.read().strip()
    except OSError:
        return ""
    return f"{boot}@{socket.gethostname()}" if boot else ""
