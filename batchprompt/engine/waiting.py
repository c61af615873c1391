"""WaitingQueue: the requests waiting for admission, by rank and then in arrival order.

A request's rank is `(promoted, priority)`: a promoted request (its class starved, see
scheduler.py) comes before every class, then higher priorities before lower. Within a rank the
order is first come, first served; `appendleft` puts a request back at the front of its rank
(a preempted request, or one a failed step gave back), so it keeps its turn. Every operation
but `remove` (an abort) is O(1) in the number of waiting requests.
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from .request import Request


def rank(req: Request) -> tuple[bool, int]:
    """Higher is served first: promoted requests, then by priority."""
    return req.promoted, req.priority


class WaitingQueue:
    def __init__(self) -> None:
        self._ranks: dict[tuple[bool, int], deque[Request]] = {}
        self._order: list[tuple[bool, int]] = []  # the ranks that have requests, highest first
        self._len = 0

    def _queue(self, req: Request) -> deque[Request]:
        key = rank(req)
        queue = self._ranks.get(key)
        if queue is None:
            queue = self._ranks[key] = deque()
            self._order.append(key)
            self._order.sort(reverse=True)
        return queue

    def _drop_if_empty(self, key: tuple[bool, int]) -> None:
        if not self._ranks[key]:
            del self._ranks[key]
            self._order.remove(key)

    def append(self, req: Request) -> None:
        self._queue(req).append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        self._queue(req).appendleft(req)
        self._len += 1

    def popleft(self) -> Request:
        key = self._order[0]
        req = self._ranks[key].popleft()
        self._drop_if_empty(key)
        self._len -= 1
        return req

    def remove(self, req: Request) -> None:
        key = rank(req)
        self._ranks[key].remove(req)
        self._drop_if_empty(key)
        self._len -= 1

    def promote_first(self, priority: int) -> Request | None:
        """Promote the oldest waiting request of class `priority` (None if it has none)."""
        queue = self._ranks.get((False, priority))
        if not queue:
            return None
        req = queue[0]
        self.remove(req)
        req.promoted = True
        self.append(req)
        return req

    def take_out(self, priority: int) -> dict[tuple[bool, int], deque[Request]]:
        """Take out the requests of `priority` or higher, promoted ones excepted (put them back
        with `put_back`)."""
        keys = [key for key in self._order if not key[0] and key[1] >= priority]
        taken = {key: self._ranks.pop(key) for key in keys}
        self._order = [key for key in self._order if key not in taken]
        self._len -= sum(len(q) for q in taken.values())
        return taken

    def put_back(self, taken: dict[tuple[bool, int], deque[Request]]) -> None:
        for key, queue in taken.items():
            mine = self._ranks.get(key)
            if mine is None:
                self._ranks[key] = queue
                self._order.append(key)
            else:  # requests put back since (preempted ones) go first, as appendleft would
                mine.extend(queue)
            self._len += len(queue)
        self._order.sort(reverse=True)

    def priorities(self) -> set[int]:
        """The priority classes of the waiting requests (promoted ones count in their own)."""
        out = {p for promoted, p in self._order if not promoted}
        for key in self._order:
            if key[0]:
                out.update(r.priority for r in self._ranks[key])
        return out

    def __getitem__(self, index: int) -> Request:
        if index == 0:
            return self._ranks[self._order[0]][0]
        for i, req in enumerate(self):
            if i == index:
                return req
        raise IndexError(index)

    def __iter__(self) -> Iterator[Request]:
        for key in list(self._order):
            yield from self._ranks[key]

    def __contains__(self, req: object) -> bool:
        if not isinstance(req, Request):
            return False
        queue = self._ranks.get(rank(req))
        return queue is not None and req in queue

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0
