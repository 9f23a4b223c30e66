"""The waiting queue: pure (vLLM: `vllm/v1/core/sched/request_queue.py`).

`FCFSRequestQueue` keeps arrival order on a deque; `PriorityRequestQueue`
orders by (`priority`, arrival) on a heap, lower first, as vLLM's. Both put a
preempted request back at its old place (`prepend_request`: the front for
FCFS; for priority its original arrival, which sorts before later ones).

Removal by id (an ABORT of a waiting request) is O(1): the id leaves the
index at once and its queue entry is skipped when it reaches the front, so
20 000 aborts of 100 000 waiting requests cost no queue rebuilds. Iterating
a queue yields the waiting request ids in the order they would be admitted
(FCFS) or in arrival order (priority), like the dict this replaced.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Deque, Dict, Iterator, List, Optional, Tuple

from gmock_engine.core.request import Request


class FCFSRequestQueue:
    """First come, first served."""

    def __init__(self) -> None:
        self._queue: Deque[Request] = deque()
        #: id -> request for the requests really waiting (the deque may hold stale entries)
        self._waiting: Dict[str, Request] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def __iter__(self) -> Iterator[str]:
        waiting = self._waiting
        return iter([r.request_id for r in self._queue if waiting.get(r.request_id) is r])

    def get(self, request_id: str) -> Optional[Request]:
        return self._waiting.get(request_id)

    def requests(self) -> List[Request]:
        """The waiting requests in queue order."""
        waiting = self._waiting
        return [r for r in self._queue if waiting.get(r.request_id) is r]

    def add_request(self, request: Request) -> None:
        """A new arrival joins the back."""
        request.arrival = next(self._arrivals)
        self._queue.append(request)
        self._waiting[request.request_id] = request

    def prepend_request(self, request: Request) -> None:
        """A preempted request goes back to the front."""
        self._queue.appendleft(request)
        self._waiting[request.request_id] = request

    def peek_request(self) -> Request:
        """The next request to admit (IndexError when empty)."""
        self._skip_stale()
        return self._queue[0]

    def pop_request(self) -> Request:
        self._skip_stale()
        request = self._queue.popleft()
        del self._waiting[request.request_id]
        return request

    def remove_request(self, request_id: str) -> Optional[Request]:
        """Take a waiting request out (ABORT); None if it is not waiting."""
        return self._waiting.pop(request_id, None)

    def clear(self) -> None:
        self._queue.clear()
        self._waiting.clear()

    def _skip_stale(self) -> None:
        queue, waiting = self._queue, self._waiting
        while queue and waiting.get(queue[0].request_id) is not queue[0]:
            queue.popleft()
        if not queue:
            raise IndexError("no request is waiting")


class PriorityRequestQueue(FCFSRequestQueue):
    """Lower `priority` first, then arrival (vLLM's priority policy)."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: List[Tuple[int, int, int, Request]] = []
        self._pushes = itertools.count()  # a tie-break: requests themselves do not compare

    def __iter__(self) -> Iterator[str]:
        return iter([r.request_id for r in self.requests()])

    def requests(self) -> List[Request]:
        return sorted(self._waiting.values(), key=lambda r: r.arrival)

    def add_request(self, request: Request) -> None:
        request.arrival = next(self._arrivals)
        self._push(request)

    def prepend_request(self, request: Request) -> None:
        # its original arrival puts it before everything of its priority that came later
        self._push(request)

    def _push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival, next(self._pushes), request))
        self._waiting[request.request_id] = request

    def peek_request(self) -> Request:
        self._skip_stale()
        return self._heap[0][3]

    def pop_request(self) -> Request:
        self._skip_stale()
        request = heapq.heappop(self._heap)[3]
        del self._waiting[request.request_id]
        return request

    def clear(self) -> None:
        self._heap.clear()
        self._waiting.clear()

    def _skip_stale(self) -> None:
        heap, waiting = self._heap, self._waiting
        while heap and waiting.get(heap[0][3].request_id) is not heap[0][3]:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("no request is waiting")


def create_request_queue(policy: str) -> FCFSRequestQueue:
    """The queue for `--scheduling-policy` (fcfs | priority)."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
