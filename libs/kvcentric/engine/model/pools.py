"""Worker threads beside the model thread: each computes its torch ops on one thread.

torch keeps one process-wide thread count, the last one any thread set, and a thread takes it the first time
it runs a parallel op. The model thread sets its own count, and again each time cores are lent to it
(`ModelThread.use`), so a worker started while it computed on two threads would have become a second OpenMP
team. libgomp then manages more threads than the machine has cores, stops spinning, and puts the model
thread's team to sleep between its ops, a futex wake-up at every parallel op (docs/performance-notebook.md,
"One OpenMP team per engine")."""

from __future__ import annotations

import concurrent.futures

import torch


def serial_workers(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads each run torch on one thread, whatever count the model thread has now."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_serial)


def _serial() -> None:
    torch.set_num_threads(1)
    torch.get_num_threads()  # settled for this thread now
