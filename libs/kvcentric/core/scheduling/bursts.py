"""Bursts are queued, overload is refused: a leaky bucket of the prefill work offered to the pool. Pure, time
passed in; it measures and answers, it places and rejects nothing.

A TTFT SLO of 10x a prompt's unloaded prefill (Mooncake §8.1) cannot be met for every request of a burst: the 11th of
eleven equal prompts sent at once waits for ten prefills on one instance, whatever the machine. Refusing it wastes
nothing, but a client that sent 32 requests at once would rather have 32 answers in a few seconds than 25 refusals,
and what the paper's early rejection is for (§7) is overload, a sustained arrival rate above what the prefill pool
computes, where a queue grows without bound and every request would miss its SLO.

So every request offers its predicted prefill seconds (on the instance chosen for it, refused or not) to a bucket
that drains at the pool's capacity: one second of work per second per alive prefill instance. While the bucket
holds at most `burst_s` seconds per instance, what came is a burst that the pool clears within `burst_s`, and a
request is queued while its predicted TTFT is within `burst_s`; once the offered work outruns capacity for long
enough to fill the bucket, the TTFT SLO judges again. A burst of B seconds of work is queued whole iff
B <= burst_s x instances; a sustained rate r above capacity c fills the bucket within burst_s x c / (r - c) s, and
the bucket stays full (refusing at the SLO) for as long as the rate stays above capacity, since refused requests
are offered work too. `burst_s` 0: no allowance, every request is held to its TTFT SLO (the paper's admission).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class OfferedWork:
    """The leaky bucket: predicted prefill seconds offered to the pool, drained at its capacity."""

    burst_s: float
    """Seconds of queue a burst may build per instance before the TTFT SLO judges again (0: never)."""
    level_s: float = 0.0
    """Seconds of offered work not yet drained."""
    at: float = 0.0
    """When `level_s` was last brought up to date."""
    instances: int = 1
    """Prefill instances at the last update: the drain rate, in seconds of work per second."""

    def drain(self, now: float, instances: int) -> None:
        """Bring the level up to `now` at the capacity of the `instances` alive since the last update."""
        if now > self.at:
            self.level_s = max(0.0, self.level_s - (now - self.at) * self.instances)
            self.at = now
        self.instances = max(1, instances)

    def offer(self, prefill_s: float, now: float, instances: int) -> None:
        """A request was judged: its predicted prefill seconds join the bucket, admitted or refused."""
        self.drain(now, instances)
        self.level_s += max(0.0, prefill_s)

    def allowance_s(self, now: float, instances: int) -> float:
        """The TTFT a request may be queued for now: `burst_s` while the bucket holds at most that much work per
        instance (a burst), else 0 (overload: the SLO alone judges)."""
        if self.burst_s <= 0:
            return 0.0
        self.drain(now, instances)
        return self.burst_s if self.level_s <= self.burst_s * self.instances else 0.0

    @property
    def per_instance_s(self) -> float:
        """The bucket's level per instance, seconds of work (a gauge)."""
        return self.level_s / self.instances
