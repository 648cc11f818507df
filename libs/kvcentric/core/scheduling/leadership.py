"""Which of several conductor replicas acts alone on cluster-wide changes (role switches by re-planning):
the lowest instance id among those heard from lately, itself included. Pure bookkeeping of heartbeats with
time passed in; it sends none and decides nothing per request (every replica places requests).

A replica that has just started does not lead until one heartbeat period of its own has passed, so it has
heard whether a replica with a lower id is alive before it acts; two replicas may both lead for at most
that long after a partition heals, which the re-planner's pause after a switch makes harmless.
"""

from __future__ import annotations


class Leadership:
    def __init__(self, instance_id: str, started: float, lease_s: float = 1.5) -> None:
        self.instance_id = instance_id
        self.lease_s = lease_s
        """A replica not heard from for this long is taken for gone."""
        self.started = started
        self.last_heard: dict[str, float] = {}

    def heard(self, instance_id: str, now: float) -> None:
        """A heartbeat from a replica (this one's own, echoed back by the bus, is ignored)."""
        if instance_id != self.instance_id:
            self.last_heard[instance_id] = now

    def replicas(self, now: float) -> list[str]:
        """The live replicas' ids, this one included, sorted."""
        self.last_heard = {peer: at for peer, at in self.last_heard.items() if now - at <= self.lease_s}
        return sorted([self.instance_id, *self.last_heard])

    def forget(self, instance_id: str) -> None:
        """A replica known to be gone before its lease ran out (nobody answers on its own subject)."""
        self.last_heard.pop(instance_id, None)

    def peers(self, now: float) -> list[str]:
        """The live replicas other than this one (for a gateway, which is none of them: all of them)."""
        return [replica for replica in self.replicas(now) if replica != self.instance_id]

    def leader(self, now: float) -> str:
        return self.replicas(now)[0]

    def leads(self, now: float) -> bool:
        """Whether this replica should act now."""
        return now - self.started >= self.lease_s and self.leader(now) == self.instance_id
