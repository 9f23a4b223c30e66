"""The reference emitter is the floor gmock is measured against (bench.py):
it must send what gmock sends, or the ratio means nothing (issue 17)."""

import msgpack
import pytest

from gmock_engine import protocol
from gmock_engine.tokens import RandomTokens
from gmock_engine.tools import reference_emitter

from test_engine import add, make, run


class Socket:
    def __init__(self):
        self.messages = []

    def send(self, data):
        self.messages.append(msgpack.unpackb(data, strict_map_key=False))


def without_times(output):
    """An output with its event timestamps taken out (the clocks differ)."""
    output = list(output)
    if len(output) > 7 and output[7]:
        output[7] = [event["type"] for event in output[7]]
    return output


@pytest.mark.parametrize("chunk,logprobs", [(1, None), (3, None), (4, None), (1, 5), (4, 2)])
def test_the_floor_sends_what_gmock_sends(chunk, logprobs):
    lengths = {"a": 1, "b": 4, "c": 7, "d": 12}
    asking = {"b", "d"} if logprobs is not None else set()  # with logprobs: the same rows too
    engine = make(chunk=chunk, clients=1)
    for rid, n in lengths.items():
        engine.apply(add(rid, max_tokens=n, logprobs=logprobs if rid in asking else None))
    # through the wire, as the frontend sees both (the rows are buffers of either type before)
    gmock = [msgpack.unpackb(msgpack.packb(m, use_bin_type=True), strict_map_key=False) for _, m in run(engine)]

    floor = reference_emitter.Engine(0, chunk, RandomTokens(32000, 0, 0), protocol.layout_for_version("0.33"))
    sock = Socket()
    floor.outputs.append(sock)
    for rid, n in lengths.items():
        body = [None] * 22
        body[0], body[1], body[3], body[11] = rid, [1, 2, 3], {"max_tokens": n}, 0
        if rid in asking:
            body[3]["logprobs"] = logprobs
        floor.add(body)
    while floor.busy:
        floor.run_step()

    for messages in (gmock, sock.messages):
        assert all(len(m) in (4, 6) for m in messages)
    # the same outputs per request, step by step (only their order within a message may differ)
    for rid in lengths:
        ours = [[without_times(o) for o in m[1] if o[0] == rid] for m in gmock]
        theirs = [[without_times(o) for o in m[1] if o[0] == rid] for m in sock.messages]
        assert ours == theirs, rid
        with_rows = [o for m in theirs for o in m if len(o) > 2 and o[2] is not None]
        assert len(with_rows) == (len([o for m in theirs for o in m]) if rid in asking else 0)
    assert [sorted(m[5]) for m in gmock if len(m) > 5] == [sorted(m[5]) for m in sock.messages if len(m) > 5]
    # SchedulerStats on the first message and on the one that leaves the engine idle, as gmock's
    # (in between, gmock's also follow its KV usage, which the floor does not keep)
    for messages in (gmock, sock.messages):
        assert messages[0][2] is not None and messages[-1][2] is not None
        assert messages[-1][2]["num_running_reqs"] == 0
