"""Layer-wise KV block allocation and per-layer block tables (LayerKV §3.1.1–3.1.2), as a `BlockPool`.

The device cache is `device_blocks` blocks in each of `num_layers` layers, and each (layer, block) is
allocated on its own; host memory holds `host_blocks` more layer blocks. A logical block (what the engine's
block tables hold) has a home per layer: a device block of that layer, or a host block. A prompt is given
the layers a placement names on the device and the rest on the host; a block a decoding request grows into
goes to the device in every layer that has room. `offload` moves a request's device layers to the host and
queues the copies (`take_moves`) for the engine to do before its next step. No prefix caching: a freed
block gives its layer blocks back at once. Bookkeeping only; no torch, no clock.
"""

from __future__ import annotations

import dataclasses

from kvcentric.core.block_pool import BlockPool, OutOfBlocks
from kvcentric.core.layerkv.placement import retained_layers


def host_home(host_block: int) -> int:
    """A home on the host, as the tables hold it (device homes are the block ids, 0 and up)."""
    return -host_block - 1


def host_block_of(home: int) -> int:
    return -home - 1


@dataclasses.dataclass(frozen=True)
class Move:
    """One layer block's KV to copy from the device to the host."""
    layer: int
    device_block: int
    host_block: int


class LayerBlockPool(BlockPool):
    def __init__(self, device_blocks: int, block_size: int, num_layers: int, host_blocks: int) -> None:
        if device_blocks < 1 or num_layers < 1 or host_blocks < 0:
            raise ValueError("device_blocks and num_layers must be positive, host_blocks not negative")
        super().__init__(device_blocks + host_blocks // num_layers, block_size)
        self.num_layers, self.device_blocks, self.host_blocks = num_layers, device_blocks, host_blocks
        self.device_free = [list(range(device_blocks - 1, -1, -1)) for _ in range(num_layers)]
        self.host_free = list(range(host_blocks - 1, -1, -1))
        self.homes: list[list[int] | None] = [None] * self.num_blocks
        self.placement: list[int] | None = None
        """Layers the next `allocate` puts on the device (the rest on the host); None: every layer that has room."""
        self.moves: list[Move] = []
        self.inbound: list[Move] = []
        """Host-to-device copies `reload` queued: done one layer ahead of that layer's compute."""
        self.stats = {"layerkv_layer_blocks_offloaded": 0, "layerkv_prompt_layers_offloaded": 0,
                      "layerkv_requests_offloaded": 0, "layerkv_layer_blocks_reloaded": 0}

    # ---------------------------------------------------------------- capacity

    @property
    def num_free(self) -> int:
        """Logical blocks that can still be allocated, their layers on the device or the host (as `num_blocks`
        counts them: what load reports carry)."""
        spare = (self.device_free_layer_blocks + len(self.host_free)) // self.num_layers
        return min(len(self._free), spare)

    @property
    def device_free_layer_blocks(self) -> int:
        return sum(len(free) for free in self.device_free)

    @property
    def device_layer_blocks(self) -> int:
        return self.device_blocks * self.num_layers

    def can_allocate(self, num_blocks: int) -> bool:
        if num_blocks > len(self._free):
            return False
        if self.placement is not None:
            on_host = num_blocks * (self.num_layers - len(self.placement))
            return all(len(self.device_free[layer]) >= num_blocks for layer in self.placement) and \
                on_host <= len(self.host_free)
        short = sum(max(0, num_blocks - len(free)) for free in self.device_free)
        return short <= len(self.host_free)

    def can_ever_place(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks fit with every block free: each layer on the device, else all on the host
        (a prompt's layer is placed whole, `fitting_layers`)."""
        return num_blocks <= self.device_blocks or num_blocks * self.num_layers <= self.host_blocks

    def fitting_layers(self, num_blocks: int, at_least: int, reserve: int) -> list[int] | None:
        """The most layers (at least `at_least`), spread evenly, whose `num_blocks` blocks each fit on the
        device leaving `reserve` layer blocks free, the rest fitting on the host; None when none do. Keeping
        none needs only the host. A prompt longer than a layer's device blocks keeps none, whatever `at_least`."""
        if num_blocks > self.device_blocks:
            at_least = 0
        for keep in range(self.num_layers, at_least - 1, -1):
            if keep and self.device_free_layer_blocks - keep * num_blocks < reserve:
                continue
            if (self.num_layers - keep) * num_blocks > len(self.host_free):
                break
            spacing = self.num_layers // keep if keep else 1
            phases = [retained_layers(self.num_layers, keep, phase) for phase in range(spacing)]
            fitting = [layers for layers in phases if all(len(self.device_free[i]) >= num_blocks for i in layers)]
            if fitting:
                return max(fitting, key=lambda layers: min((len(self.device_free[i]) for i in layers), default=0))
        return None

    # ---------------------------------------------------------------- verbs

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfBlocks(f"need {num_blocks} KV blocks in layers {self.placement}; device free per layer "
                              f"{[len(f) for f in self.device_free]}, host free {len(self.host_free)}")
        blocks = super().allocate(num_blocks)
        for block in blocks:
            self.homes[block] = [self._home(layer) for layer in range(self.num_layers)]
        if self.placement is not None:
            self.stats["layerkv_prompt_layers_offloaded"] += self.num_layers - len(self.placement)
        return blocks

    def _home(self, layer: int) -> int:
        on_device = layer in self.placement if self.placement is not None else bool(self.device_free[layer])
        return self.device_free[layer].pop() if on_device else host_home(self.host_free.pop())

    def free(self, blocks: list[int]) -> None:
        super().free(blocks)
        for block in blocks:
            homes = self.homes[block]
            if self.ref_counts[block] == 0 and homes is not None:
                self.homes[block] = None
                for layer, home in enumerate(homes):
                    if home >= 0:
                        self.device_free[layer].append(home)
                    else:
                        self.host_free.append(host_block_of(home))

    def cached_prefix(self, hashes: list[str]) -> list[int]:
        return []

    def cache(self, blocks: list[int], hashes: list[str]) -> None:
        """No prefix caching: a freed block's layer blocks go back at once."""

    def offload(self, blocks: list[int]) -> int:
        """Move every device layer of these blocks to the host (as far as the host has room); the copies wait
        in `moves`. Returns the layer blocks moved."""
        moved = 0
        for block in blocks:
            homes = self.homes[block]
            for layer, home in enumerate(homes or ()):
                if home < 0 or not self.host_free:
                    continue
                host_block = self.host_free.pop()
                self.moves.append(Move(layer, home, host_block))
                self.device_free[layer].append(home)
                homes[layer] = host_home(host_block)  # type: ignore[index]  # homes is not None in the loop
                moved += 1
        self.stats["layerkv_layer_blocks_offloaded"] += moved
        self.stats["layerkv_requests_offloaded"] += moved > 0
        return moved

    def host_layer_blocks_of(self, blocks: list[int]) -> int:
        """Layer blocks these blocks hold on the host."""
        return sum(home < 0 for block in blocks for home in self._homes_of(block))

    def reload(self, blocks: list[int]) -> int:
        """Bring the host layers of these blocks back into device blocks where the layers have room; the
        copies wait in `inbound`. Returns the layer blocks brought back."""
        moved = 0
        for block in blocks:
            homes = self._homes_of(block)
            for layer, home in enumerate(homes):
                if home >= 0 or not self.device_free[layer]:
                    continue
                device_block = self.device_free[layer].pop()
                self.inbound.append(Move(layer, device_block, host_block_of(home)))
                self.host_free.append(host_block_of(home))
                homes[layer] = device_block
                moved += 1
        self.stats["layerkv_layer_blocks_reloaded"] += moved
        return moved

    def take_inbound(self) -> list[Move]:
        """The host-to-device copies `reload` queued; they must be done before their layer computes."""
        moves, self.inbound = self.inbound, []
        return moves

    def take_moves(self) -> list[Move]:
        """The device-to-host copies `offload` queued; they must be done before the freed blocks are written."""
        moves, self.moves = self.moves, []
        return moves

    # ---------------------------------------------------------------- the tables

    def layer_table(self, blocks: list[int], layer: int) -> list[int]:
        """The homes of `blocks` in one layer: device block ids (>= 0) and host ones (`host_home`)."""
        return [self._homes_of(block)[layer] for block in blocks]

    def device_layers(self, blocks: list[int]) -> list[bool]:
        """The request's layer → device mapping: True where every one of its blocks is on the device."""
        return [all(self._homes_of(block)[layer] >= 0 for block in blocks) for layer in range(self.num_layers)]

    def device_layer_blocks_of(self, blocks: list[int]) -> int:
        """Layer blocks these blocks hold on the device."""
        return sum(home >= 0 for block in blocks for home in self._homes_of(block))

    def _homes_of(self, block: int) -> list[int]:
        homes = self.homes[block]
        if homes is None:
            raise KeyError(f"block {block} is not allocated")
        return homes
