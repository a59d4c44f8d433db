"""Layer groups of the KV cache: layers whose cache lives alike share a block table.

A model with windowed layers (Gemma 3, gpt-oss: sliding; Llama 4: chunked) keeps, per
sequence, every token in its full-attention layers but only a window's worth in the
others. Each group has its own block table, and a windowed group frees the blocks that fell
out of its window while the request runs. All groups draw blocks from one pool: a block is
``width`` layers' K/V for ``block_size`` tokens, and the pool's tensors are ``width`` per
part, shared by every group — slot j of a block belongs to the group's j-th layer. So
windowed groups are as wide as the full one (a longer list of windowed layers is split into
several groups, the last padded), and a block a window frees serves any group next.
A model without windows is one group of all its layers: the plain paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlserve.layers.window import Window
from xlserve.models.arch import ModelArch


@dataclass(frozen=True)
class KVGroup:
    window: Window | None  # None: every token is kept
    layers: tuple[int, ...]  # model layers, in slot order (at most the plan's width)

    def first_block(self, position: int, block_size: int) -> int:
        """The first block a query at ``position`` (or later) still reads."""
        return self.window.first_key(position) // block_size if self.window else 0


@dataclass(frozen=True)
class KVGroupPlan:
    groups: tuple[KVGroup, ...]  # the full-attention group first, when there is one
    width: int  # layer slots per block: the pool's tensors per part

    @property
    def windowed(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].window is not None

    def placement(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, slot) of every model layer."""
        where = {layer: (g, slot) for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}
        return [where[i] for i in range(num_layers)]

    def slots_of(self, layers: range) -> list[int]:
        """The slots these layers use (a pipeline stage's: the ones its pool allocates)."""
        where = {layer: slot for group in self.groups for slot, layer in enumerate(group.layers)}
        return sorted({where[layer] for layer in layers})

    def windows(self) -> tuple:
        """Plain data for the KV layout: (window size, chunked) of each group after the first."""
        return tuple((g.window.size, g.window.chunked) if g.window else (0, False) for g in self.groups[1:])


def plan_groups(arch: ModelArch) -> KVGroupPlan:
    by_window: dict[Window | None, list[int]] = {}
    for i in range(arch.num_layers):
        size = arch.layer_windows[i] if arch.layer_windows else 0
        by_window.setdefault(Window(size, arch.chunked_attention) if size else None, []).append(i)
    full = by_window.pop(None, [])
    if not full:  # prefix hits and the hand-off are anchored on a group that keeps every token
        raise ValueError("models whose every layer is windowed are not supported; serve them with full attention "
                         "up to the window (as Mistral-style configs are)")
    width = len(full)
    groups = [KVGroup(None, tuple(full))]
    for window, layers in sorted(by_window.items(), key=lambda item: item[0].size):
        groups += [KVGroup(window, tuple(layers[i:i + width])) for i in range(0, len(layers), width)]
    return KVGroupPlan(tuple(groups), width)
