"""A continuous decode batch advanced many steps at a time in closed form; it keeps step and token
bookkeeping for the simulator and knows nothing of events or requests beyond their lengths.

Between two changes of membership the batch size B is fixed and every step adds B context tokens, so
with a step time d0 + d1*B + d2*kv (`CostModel.t_decode`) the j-th step from now lasts
c + d2*B*j with c = d0 + d1*B + d2*kv, and k steps last k*c + d2*B*k*(k-1)/2. The simulator runs
whole segments of steps up to the next finish, cutting one short at a step boundary when a request
joins, instead of one event per token.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

from kvcentric.core.costmodel import CostModel


Item = TypeVar("Item")


class DecodeBatch(Generic[Item]):
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.steps = 0
        """Decode steps run so far (a global clock in steps)."""
        self.kv_tokens = 0
        """Context tokens of every sequence in the batch (prompt plus tokens generated)."""
        self.heap: list[tuple[int, int, Item]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, item: Item, context_tokens: int, steps_left: int) -> None:
        """Join with `context_tokens` of KV; it leaves after `steps_left` more steps (>= 1)."""
        self._seq += 1
        heapq.heappush(self.heap, (self.steps + steps_left, self._seq, item))
        self.kv_tokens += context_tokens

    def steps_to_next_finish(self) -> int:
        return self.heap[0][0] - self.steps if self.heap else 0

    def first_step_s(self) -> float:
        return self.cost.t_decode(len(self.heap), self.kv_tokens)

    def duration(self, k: int) -> float:
        """Seconds for the next k steps with the current membership."""
        batch = len(self.heap)
        d2 = self.cost.decode[2]
        return k * self.first_step_s() + d2 * batch * k * (k - 1) / 2

    def steps_within(self, seconds: float) -> int:
        """The most whole steps that fit in `seconds` with the current membership."""
        if seconds <= 0 or not self.heap:
            return 0
        c = self.first_step_s()
        a = self.cost.decode[2] * len(self.heap) / 2
        if a <= 0:
            k = int(seconds // c) if c > 0 else 1 << 40
        else:
            b = c - a
            k = int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a))
        while k > 0 and self.duration(k) > seconds:
            k -= 1
        while self.duration(k + 1) <= seconds:
            k += 1
        return k

    def advance(self, k: int) -> list[Item]:
        """Run k steps; returns the items that finished (their context leaves the batch)."""
        self.kv_tokens += len(self.heap) * k
        self.steps += k
        finished: list[Item] = []
        while self.heap and self.heap[0][0] <= self.steps:
            finished.append(heapq.heappop(self.heap)[2])
        return finished

    def release(self, context_tokens: int) -> None:
        """Drop a finished item's final context from the KV total."""
        self.kv_tokens -= context_tokens
