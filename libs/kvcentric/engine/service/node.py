"""What an engine instance computes with: its model runner (or the one a role change hands over), its host
block pool, the one thread the model runs in, and the wake-up of its work loop.

It builds and runs; it does not schedule requests or talk to the network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable

import torch

from kvcentric.engine.config import EngineConfig
from kvcentric.engine.service.coreshare import CoreShare
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import load_model_config


def load_runner(config: EngineConfig, runner: ModelRunner | None = None) -> ModelRunner:
    """The model with its paged KV memory: `runner` when one is handed over, else loaded from `config` (in the
    model thread: see `ModelThread`)."""
    return runner or ModelRunner(load_model_config(config.model), config.num_kv_blocks, config.block_size,
                                 config.seed, config.dtype, config.device, config.onednn,
                                 config.cpu_kernels, config.gpu_kernels, config.cuda_graphs)


def host_pool(config: EngineConfig, block_bytes: int) -> HostBlockPool | None:
    """The host-memory block pool of --host-pool-mb (None when that is too small for one block); page-locked
    on a CUDA engine, whose side stream copies blocks into it behind the compute."""
    host_blocks = (config.host_pool_mb << 20) // block_bytes
    pinned = config.device.startswith("cuda")
    layers = load_model_config(config.model).num_layers if config.host_layer_major else 0
    return HostBlockPool(host_blocks, block_bytes, config.host_pool_policy, pinned, layers) if host_blocks else None


def gpu_uuids(device: torch.device) -> tuple[str, ...]:
    """The UUID of the GPU an engine computes on (a peer with the same one shares this host's GPUs); () on CPU."""
    if device.type != "cuda":
        return ()
    return (str(torch.cuda.get_device_properties(device).uuid),)


def engine_threads(config: EngineConfig, runner: ModelRunner | None = None) -> int:
    """The torch threads the model computes with: those of the runner handed over, else --torch-threads, else
    torch's default."""
    return (runner.threads if runner is not None else 0) or config.torch_threads or torch.get_num_threads()


def core_share(config: EngineConfig, role: str, name: str, threads: int) -> CoreShare | None:
    """This instance's part in the cores lent between the machine's instances (--core-share-dir; CPU only); a
    prefill instance takes lent cores within a call too (`LlamaModel.look`)."""
    if not config.core_share_dir or config.device != "cpu":
        return None
    return CoreShare(config.core_share_dir, name, threads, takes=role == "prefill")


HANDOVER_S = 0.002
"""The longest the event loop waits for an idle model thread to begin the call it was handed (`Handover`)."""


class Handover:
    """A call handed from the event loop to a model thread's executor, and awaited. Where the thread is idle, the
    event loop waits (GIL released) until the thread has begun the call: otherwise the thread, woken, waits for the
    GIL until the event loop next blocks, since a thread that asks for the GIL gets it only when its holder
    releases it (at a blocking call, or after `sys.getswitchinterval()`, 5 ms). The event loop goes on after a
    step's hand-off to publish the step's tokens and serve its other tasks, so the next step began 0.3–1 ms late
    at batch 1: the served step of `small` and `medium` on the Intel Xeon, `bench.serving.bench_served_step`
    (docs/performance-notebook.md, "The model thread's wake-up")."""

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor, wait_s: float = HANDOVER_S) -> None:
        self.executor, self.wait_s = executor, wait_s
        self.handed = 0
        """Calls handed over (written by the event loop's thread alone)."""
        self.ended = 0
        """Calls the thread has ended (written by the thread alone)."""

    def __call__(self, fn, *args) -> asyncio.Future:
        idle = self.handed == self.ended
        begun = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._call, begun, fn, *args)
        self.handed += 1
        if idle:
            begun.wait(self.wait_s)
        return future

    def _call(self, begun: threading.Event, fn, *args):
        begun.set()
        try:
            return fn(*args)
        finally:
            self.ended += 1


class ModelThread:
    """One worker thread runs the model, so the event loop keeps serving NATS and gRPC meanwhile.

    Every parallel torch op the model runs is parallel in this thread's OpenMP team only. The model is built
    here too (`call`), and a service's process then keeps its other threads serial (`serial_elsewhere`): a
    second team in the process, made by a parallel op in the event loop's thread (loading the weights there
    was one), leaves libgomp with more threads than cores, and it then puts idle team threads to sleep at
    once, so every parallel op pays a wake-up (docs/performance-notebook.md, "One OpenMP team per engine")."""

    def __init__(self, role: str, threads: int = 0, share: CoreShare | None = None) -> None:
        """`share`: the cores lent between this machine's instances (`cores.py`); each call then runs on this
        thread's `threads` plus those of the idle instances beside it."""
        self.threads = threads
        self.share = share
        self.current = threads
        self.look_ns = 0
        """The time between the last two looks (`refresh`): a peer resuming sooner than that keeps its core."""
        self.looked_ns = 0
        self.borrowing = True
        """Whether the call running now may take lent cores (`run`)."""
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{role}-model",
                                                              initializer=_use_threads, initargs=(threads,))
        self.handover = Handover(self.executor)
        self.call(int)  # the thread starts and takes its count now
        self.lane: Lane | None = None
        """A prefill instance's second model thread (`add_lane`, `lane_call`)."""
        self.calls = 0
        """Calls computing now, the model thread's and the lane's (with a core share: `_begin`, `_end`)."""
        self.calls_lock = threading.Lock()
        if _serial_elsewhere:
            torch.set_num_threads(1)  # what the model thread's setting changed, for threads started later

    def call(self, fn, *args):
        """fn(*args) in the model thread, waited for (building the model, before the event loop runs)."""
        return self.executor.submit(fn, *args).result()

    async def run(self, fn, *args, borrow: bool = True):
        """fn(*args) in the model thread, awaited; with a core share, on the threads it allows now, or on this
        instance's own when it may not `borrow` (a calibration, which times this instance alone)."""
        if self.share is None:
            if self.lane is None:
                return await self.handover(fn, *args)
            return await self.handover(self.owned, fn, *args)
        return await self.handover(self.shared, borrow, fn, *args)

    def owned(self, fn, *args):
        """fn(*args) in the model thread of an instance with a lane and its own cores (no core share)."""
        self.follow_lane()
        return fn(*args)

    def follow_lane(self) -> None:
        """With a lane and no core share (in the model thread, at a call's start and at its looks): one thread fewer
        than the instance's own while the lane computes, all of them otherwise."""
        assert self.lane is not None
        self.use(max(1, self.threads - 1) if self.lane.computing else self.threads)

    def shared(self, borrow: bool, fn, *args):
        """fn(*args) on the threads the core share allows now (in the model thread); on one while the lane computes
        too (`lane_call`)."""
        assert self.share is not None
        self.borrowing = borrow
        threads = self._begin(borrow)
        self.use(1 if self.lane is not None and self.lane.computing else threads)
        self.looked_ns = 0
        try:
            return fn(*args)
        finally:
            self._end()

    def _begin(self, borrow: bool = True) -> int:
        """The instance computes from now (the model thread's call or the lane's, whichever begins first)."""
        assert self.share is not None
        with self.calls_lock:
            self.calls += 1
            if self.calls == 1:
                return self.share.begin(borrow)
            self.share.using(2)
            return 1

    def _end(self) -> None:
        assert self.share is not None
        with self.calls_lock:
            self.calls -= 1
            if self.calls == 0:
                self.share.end()
            else:
                self.share.using(1)

    def lane_call(self, fn, *args):
        """fn(*args) in the lane's thread (a prefill pass of its own, beside the model thread's): on one torch
        thread, starting once a core is lent to it or the model thread is idle, and pausing at its looks while
        neither holds (`Lane.look`)."""
        lane = self.lane
        assert lane is not None
        if self.share is None:  # the instance's own cores: the lane takes one of them for its pass
            return self._owned_lane_call(lane, fn, *args)
        lane.computing = True
        lane.looked_ns = 0
        lane.calls += 1
        self._begin()
        if self.model_idle():
            self.share.using(1)
        try:
            lane.look(self.share, self.model_idle)
            return fn(*args)
        finally:
            lane.computing = False
            self._end()

    @staticmethod
    def _owned_lane_call(lane: Lane, fn, *args):
        lane.computing = True
        lane.calls += 1
        try:
            return fn(*args)
        finally:
            lane.computing = False

    def model_idle(self) -> bool:
        """The model thread computes nothing now (so its core is the lane's)."""
        return self.calls <= 1

    def refresh(self) -> None:
        """At a look within a call (`LlamaModel.look`, in the model thread): take a core an instance beside this
        one left idle since the call began, or give one back to an instance that started computing or resumes
        sooner than the time since the last look. In a call of two lanes the model thread keeps its one thread
        and the lane's thread waits at its looks while the lent core is not there (`Lane.look`)."""
        if self.share is None:  # the instance's own cores: one fewer for the model thread while the lane computes
            if self.lane is not None and threading.get_ident() != self.lane.ident:
                self.follow_lane()
            return
        if self.lane is not None and threading.get_ident() == self.lane.ident:
            self.lane.look(self.share, self.model_idle)
            return
        if self.lane is not None and self.lane.computing:  # the lane has the lent core: this thread keeps one
            self.use(1)
            return
        if not self.borrowing:
            return
        now = time.monotonic_ns()
        self.look_ns = now - self.looked_ns if self.looked_ns else self.look_ns
        self.looked_ns = now
        if self.use(self.share.threads(self.look_ns, now)):
            self.share.using(self.current)

    def use(self, threads: int) -> bool:
        """Compute on `threads` from now (in the model thread); whether that changed the count."""
        if threads == self.current:
            return False
        torch.set_num_threads(threads)
        self.current = threads
        return True

    def add_lane(self, role: str) -> None:
        """A second model thread of one torch thread, for prefill passes beside the model thread's (`lane_call`):
        a prefill instance's with cores lent, or a colocated instance's on its own cores."""
        self.lane = Lane(role)

    async def run_lane(self, fn, *args):
        """fn(*args) in the lane's thread, awaited (`lane_call`)."""
        assert self.lane is not None
        return await self.lane.handover(self.lane_call, fn, *args)

    def stats(self) -> dict[str, float]:
        """Gauges of the cores lent to this instance (none without a core share) and of its lane."""
        lanes: dict[str, float] = {} if self.lane is None else {"lane_calls": self.lane.calls,
                                                                 "lane_waits": self.lane.waits}
        if self.share is None:
            return lanes
        return {"torch_threads_now": self.current, "model_calls_on_lent_cores": self.share.lent_calls, **lanes}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.lane is not None:
            self.lane.executor.shutdown(wait=False, cancel_futures=True)
        if self.share is not None:
            self.share.close()  # a call still running then computes on its own threads (`CoreShare.closed`)


class Lane:
    """A prefill instance's second model thread, of one torch thread: with a core lent and prompts queued, the
    instance computes a second prompt in a pass of its own beside the model thread's, each on one thread, rather
    than one prompt on a team of two. A team stalls at every op whose second thread the scheduler gave to another
    process for a while (the decode's steps, the streams, the event loops), its first thread spinning meanwhile;
    a lane that loses its core slows only its own prompt (docs/performance.md, "What serving adds to a prompt's
    prefill")."""

    WAIT_S = 0.0005
    """How often a paused lane looks again for its core."""

    def __init__(self, role: str) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{role}-lane",
                                                              initializer=_use_threads, initargs=(1,))
        self.handover = Handover(self.executor)
        self.ident = self.executor.submit(threading.get_ident).result()
        self.computing = False
        self.look_ns = 0
        self.looked_ns = 0
        self.calls = 0
        self.waits = 0
        """Looks at which the lane paused for a core."""

    def look(self, share: CoreShare, model_idle: Callable[[], bool]) -> None:
        """In the lane's thread, at the start of its pass and at each look: go on while a core is lent to this
        instance (the instances beside it idle beyond the time since the last look) or the model thread is idle;
        else wait for that, telling the others this instance computes on one thread meanwhile."""
        now = time.monotonic_ns()
        self.look_ns = now - self.looked_ns if self.looked_ns else self.look_ns
        self.looked_ns = now
        paused = False
        while not model_idle() and share.threads(self.look_ns, now) < 2:
            if not paused:
                paused = True
                self.waits += 1
                share.using(1)
            time.sleep(self.WAIT_S)
            now = time.monotonic_ns()
        if paused:
            share.using(1 if model_idle() else 2)
            self.looked_ns = time.monotonic_ns()


def _use_threads(threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    torch.get_num_threads()  # torch settles this thread's count now, while the setting is this one


_serial_elsewhere = False


def serial_elsewhere() -> None:
    """Torch ops of the calling thread, and of every thread but a `ModelThread` that starts torch work later,
    run on one thread: called once in a service's own process, before the service is built."""
    global _serial_elsewhere
    _serial_elsewhere = True
    torch.set_num_threads(1)
    torch.get_num_threads()  # this thread's count is settled at 1


class Wakeup:
    """The work loop's wake-up: a new job or a committed KV sets it; the loop sleeps until then."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def set(self) -> None:
        self.event.set()

    async def sleep(self, timeout_s: float) -> None:
        """Until set or `timeout_s` passed, whichever is first; then unset."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except TimeoutError:
            pass
        self.event.clear()
