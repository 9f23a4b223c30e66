"""The waiting queue (core/request_queue.py): FCFS and priority order, a
preempted request back at the front, removal (ABORT) without a scan, and
peek/pop past removed entries."""

import pytest

from gmock_engine.core.request import Request
from gmock_engine.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue


def request(rid, priority=0):
    r = Request(rid, 0, 4, None, 3, 0.0)
    r.priority = priority
    return r


def drain(queue):
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


def test_the_policy_names_the_queue():
    assert type(create_request_queue("fcfs")) is FCFSRequestQueue
    assert type(create_request_queue("priority")) is PriorityRequestQueue


def test_fcfs_is_arrival_order_and_a_preempted_request_goes_first():
    q = FCFSRequestQueue()
    for rid in "abc":
        q.add_request(request(rid))
    assert list(q) == ["a", "b", "c"] and len(q) == 3 and "b" in q
    assert q.peek_request().request_id == "a"
    first = q.pop_request()
    q.prepend_request(request("p"))  # preempted: back at the front
    assert first.request_id == "a" and list(q) == ["p", "b", "c"]
    assert drain(q) == ["p", "b", "c"] and not q


def test_priority_is_lower_value_first_then_arrival():
    q = PriorityRequestQueue()
    for rid, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        q.add_request(request(rid, priority))
    assert list(q) == ["a", "b", "c", "d", "e"]  # iteration: arrival order
    assert q.peek_request().request_id == "d"
    assert drain(q) == ["d", "b", "e", "a", "c"]


def test_a_preempted_priority_request_keeps_its_arrival_among_its_priority():
    q = PriorityRequestQueue()
    early, late = request("early", 1), request("late", 1)
    q.add_request(early)
    q.add_request(late)
    assert q.pop_request() is early
    q.add_request(request("newer", 1))
    q.prepend_request(early)  # preempted: before the later ones of its priority, not before a higher one
    q.add_request(request("urgent", 0))
    assert drain(q) == ["urgent", "early", "late", "newer"]


@pytest.mark.parametrize("queue", [FCFSRequestQueue, PriorityRequestQueue])
def test_removal_skips_the_removed_entries_and_a_re_added_id_is_new(queue):
    q = queue()
    for rid in "abcd":
        q.add_request(request(rid))
    assert q.remove_request("a").request_id == "a" and q.remove_request("a") is None
    assert q.remove_request("c").request_id == "c" and q.remove_request("zz") is None
    assert len(q) == 2 and "a" not in q and q.get("c") is None and q.get("b").request_id == "b"
    assert q.peek_request().request_id == "b"  # past the stale "a"
    q.add_request(request("a"))  # the same id again, a new request: at the back
    assert [r.request_id for r in q.requests()] == ["b", "d", "a"]
    assert drain(q) == ["b", "d", "a"]
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


@pytest.mark.parametrize("queue", [FCFSRequestQueue, PriorityRequestQueue])
def test_clear_empties_it(queue):
    q = queue()
    for rid in "ab":
        q.add_request(request(rid))
    q.clear()
    assert not q and len(q) == 0 and list(q) == [] and q.requests() == []
    with pytest.raises(IndexError):
        q.pop_request()
