"""Routing: which endpoint gets the next sub-batch.

Least outstanding tokens (per unit of the endpoint's weight), with prefix affinity: each
endpoint remembers the prompt prefixes it was sent recently (hashes of 16-token blocks, chained
as vLLM's and our prefix caches key them), and a sub-batch whose prompts start with a prefix
one endpoint holds longer than the others goes there, so that server's prefix cache hits,
as long as that endpoint keeps up: it has a free slot and holds no more than `slack` tokens
more than the least loaded one. A prefix every endpoint holds (a system prompt shared by all
prompts) decides nothing: the load does.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from .endpoint import Endpoint

BLOCK = 16  # tokens per hashed block
MAX_BLOCKS = 256  # prefixes are compared over their first 4096 tokens at most


def block_hashes(ids: Sequence[int], block: int = BLOCK, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """One hash per full block of the prefix, each covering every token before it."""
    out, h = [], 0
    for i in range(min(len(ids) // block, max_blocks)):
        h = hash((h, tuple(ids[i * block:(i + 1) * block])))
        out.append(h)
    return out


class PrefixIndex:
    """The prefix blocks one endpoint was sent recently (least recently used dropped first)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the endpoint holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._blocks.clear()


class Router:
    def __init__(self, endpoints: Sequence[Endpoint], slack_tokens: int):
        self.endpoints = list(endpoints)
        self.slack_tokens = slack_tokens
        self.indexes = {e.index: PrefixIndex() for e in self.endpoints}
        self.affinity_hits = 0  # sub-batches sent where their prefix was (and not simply the least loaded)

    def choose(self, ids: Sequence[int], candidates: Sequence[Endpoint], avoid: frozenset[int] = frozenset()
               ) -> Endpoint:
        """The endpoint for a sub-batch starting with `ids`, among `candidates` (those with a
        free slot); those in `avoid` (endpoints that failed this work) only if no other is."""
        pool = [e for e in candidates if e.index not in avoid] or list(candidates)
        load = {e.index: e.outstanding_tokens / e.weight for e in pool}
        least = min(load.values())
        hashes = block_hashes(ids)
        matches = {e.index: self.indexes[e.index].match(hashes) for e in pool}
        lightest = [e for e in pool if load[e.index] == least]
        best_light = max(matches[e.index] for e in lightest)
        keeping_up = [e for e in pool if load[e.index] <= least + self.slack_tokens]
        best = max(keeping_up, key=lambda e: (matches[e.index], -load[e.index]))
        if matches[best.index] > best_light:
            self.affinity_hits += 1
            return best
        ties = [e for e in lightest if matches[e.index] == best_light]
        return random.choice(ties)

    def record(self, endpoint: Endpoint, prompts: Sequence[Sequence[int]]) -> None:
        index = self.indexes[endpoint.index]
        for ids in prompts:
            index.add(block_hashes(ids))

    def forget(self, endpoint: Endpoint) -> None:
        """A dead endpoint comes back with an empty cache (a restarted server)."""
        self.indexes[endpoint.index].clear()
