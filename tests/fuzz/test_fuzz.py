"""Fuzzing: 100 000+ generated frames against the decoder and the engine, and
a flood of them against a running engine that must serve normally afterwards.

Frames: random bytes, mutations of the real frames in tests/data (bit flips,
cuts, splices, repeated bytes), well-formed messages with wrong types and
lengths in every field, and huge size headers. The only acceptable reaction
to a bad frame is ProtocolError (logged and dropped by the runtime); nothing
is ever unpickled. Deterministic (seeded), so a failure can be replayed.

Every message the engine returns is also packed (as the runtime's sender
does) and checked with wire_rules against what the real frontends decode: a
value that reaches the packer as an int beyond 64 bits, or a token id that
does not fit vllm-rs's u32, is a failure here, not only a frame that crashes
the decoder.
"""

import json
import os
import random
import sys

import gevent
import msgpack
import pytest

import wire_rules
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, UtilityCall, decode_input
from gmock_engine.wire.types import ProtocolError

LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
DATA = os.path.join(os.path.dirname(__file__), "..", "data", "frames.json")
with open(DATA) as _f:
    REAL = [
        [bytes.fromhex(h) for h in r["frames_hex"]]
        for r in json.load(_f)["records"]
        if r["socket"].startswith("input") and r["dir"] == "recv"
    ]

WEIRD_VALUES = [
    None, True, -1, 0, 2**63, -(2**63), 2**64 - 1, 1.5, 1e300, -1e300, float("nan"), float("inf"), "", "stop", "x" * 1000, b"\x00\x01",
    [], [1, "a"], {}, {"k": [None]}, {1: 2}, msgpack.ExtType(3, b"raw"), [[[[]]]],
]  # fmt: skip
XARGS_KEYS = ["mock_output_len", "mock_fail_after", "mock_finish", "mock_ttft_ms", "mock_stop_token_id"]
SAMPLING_KEYS = ["max_tokens", "min_tokens", "stop_token_ids", "_eos_token_id", "_all_stop_token_ids", "ignore_eos", "extra_args"]


def random_value(rng, depth=0):
    if depth > 2 or rng.random() < 0.6:
        return rng.choice(WEIRD_VALUES)
    if rng.random() < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(SAMPLING_KEYS + XARGS_KEYS + ["x"]): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate(rng, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        kind = rng.randrange(5)
        if kind == 0 and data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:
            del data[rng.randrange(len(data)) :]
        elif kind == 2:
            i = rng.randrange(len(data) + 1)
            data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif kind == 3 and data:
            i = rng.randrange(len(data))
            data[i : i + 1] = data[i : i + 1] * rng.randrange(2, 50)
        elif kind == 4:
            data[rng.randrange(len(data) + 1) :] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc7\xff\x01"])
    return bytes(data)


def structured(rng):
    """Well-formed msgpack of the right shape with wrong values in places."""
    kind = rng.randrange(4)
    if kind == 0:
        request = [f"fz-{rng.randrange(10**6)}", [rng.randrange(32000) for _ in range(rng.randrange(5))], None,
                   {"max_tokens": rng.randrange(1, 8)}, None] + [None] * 6 + [0, 0, 0, None, False, None, None, None, False]  # fmt: skip
        for _ in range(rng.randrange(1, 4)):
            target = rng.randrange(len(request) + 2)
            if target < len(request):
                request[target] = random_value(rng)
            elif isinstance(request[3], dict):
                request[3] = dict(request[3])  # it may be one of WEIRD_VALUES' maps: never grow a shared one
                key = rng.choice(SAMPLING_KEYS)
                request[3][key] = {k: random_value(rng) for k in rng.sample(XARGS_KEYS, 2)} if key == "extra_args" else random_value(rng)
        return [b"\x00", msgpack.packb(request[: rng.randrange(4, len(request) + 1)])]
    if kind == 1:
        return [b"\x01", msgpack.packb(random_value(rng) if rng.random() < 0.5 else [f"fz-{rng.randrange(10)}"])]
    if kind == 2:
        call = [random_value(rng), rng.randrange(2**64), rng.choice(["is_sleeping", "sleep", "wake_up", "pause_generation", "x"]), random_value(rng)]
        return [b"\x03", msgpack.packb(call)]
    return [bytes([rng.randrange(8)]), msgpack.packb(random_value(rng))]


def frames_for(rng):
    choice = rng.random()
    if choice < 0.25:
        return [bytes(rng.randrange(256) for _ in range(rng.randrange(3))), bytes(rng.randrange(256) for _ in range(rng.randrange(64)))]
    if choice < 0.6:
        original = rng.choice(REAL)
        return [original[0], mutate(rng, original[1])] + original[2:]
    if choice < 0.95:
        return structured(rng)
    return rng.choice([[b"\x00"], [], [b"\x00", msgpack.packb(msgpack.ExtType(1, b"cos\nsystem\n(S'echo'\ntR."))], [b"\x00", b"\x00" * 1_000_000]])


class WireCheck:
    """Packs and checks every message the engine returns (wire_rules);
    keeps the first example of each broken rule."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.messages = 0
        self.broken = {}

    def __call__(self, out):
        for _client, message in out:
            self.messages += 1
            _, problems = wire_rules.pack_and_check(message, LAYOUT, engine_index=self.rank)
            for problem in problems:
                self.broken.setdefault(wire_rules.rule_of(problem), f"{problem}\n    in {message!r:.400}")
        return out

    def report(self) -> str:
        return f"{len(self.broken)} wire rule(s) broken in {self.messages} messages:\n" + "\n".join(
            f"  [{rule}] {example}" for rule, example in sorted(self.broken.items())
        )


def test_decoder_and_engine_survive_100k_fuzzed_frames():
    rng = random.Random(20261129)
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, max_model_len=4096))
    wire = WireCheck()
    outcomes = {"decoded": 0, "rejected": 0}
    for i in range(100_000):
        frames = frames_for(rng)
        try:
            message = decode_input(frames, LAYOUT)
        except ProtocolError:
            outcomes["rejected"] += 1
            continue
        outcomes["decoded"] += 1
        wire(engine.apply(message))  # must not raise, whatever the values
        if i % 10 == 0:  # often enough that fuzzed requests reach their last output
            wire(engine.step())
        if len(engine.active) + len(engine.waiting) > 200:
            wire(engine.apply(AbortRequests(list(engine.active) + list(engine.waiting))))
    wire(engine.apply(AbortRequests(list(engine.active) + list(engine.waiting))))
    print(f"fuzz: {outcomes}, {wire.messages} messages checked")
    assert outcomes["decoded"] > 10_000 and outcomes["rejected"] > 30_000
    assert engine.ledger.summary()["violations"] == 0
    assert not wire.broken, wire.report()
    # and the engine still serves a normal request (fuzzed utility calls may
    # have paused it or put it to sleep, as a frontend could: wake it first)
    wire(engine.apply(UtilityCall(0, 1, "wake_up", [None])))
    wire(engine.apply(EngineCoreRequest("after-fuzz", 3, 5, True)))
    tokens = []
    while engine.has_work:
        tokens += [t for _, m in wire(engine.step()) for o in m[1] if o[0] == "after-fuzz" for t in o[1]]
    assert len(tokens) == 5
    assert not wire.broken, wire.report()


def test_nothing_is_ever_unpickled(monkeypatch):
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle.loads was called")

    monkeypatch.setattr(pickle, "loads", forbidden)
    payload = msgpack.packb(["r", [1], None, {"max_tokens": msgpack.ExtType(1, pickle.dumps(object))}, None])
    with pytest.raises(ProtocolError, match="pickle"):
        decode_input([b"\x00", payload], LAYOUT)


def test_a_running_engine_survives_a_flood_of_fuzzed_frames():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fake_frontend import FakeFrontend
    from gmock_engine.config.loader import parse_config
    from gmock_engine.config.settings import from_config
    from gmock_engine.runtime.app import App

    frontend = FakeFrontend(num_clients=1, dp=1)
    config = parse_config(["--handshake-address", frontend.handshake_address, "--log-level", "ERROR"], env={})
    app = App(from_config(config), config)
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    try:
        frontend.accept_engines()
        rng = random.Random(7)
        for i in range(20_000):
            frontend.send_raw(0, 0, frames_for(rng))
            if i % 500 == 0:
                gevent.sleep(0)
        call_id = frontend.utility(0, "wake_up", [None])  # fuzzed calls may have paused it
        frontend.add(0, "after-flood", max_tokens=4)
        broken = {}  # every message the frontend got, checked as a real frontend decodes it
        with gevent.Timeout(60):
            while True:
                message = frontend.recv(0, timeout=60)
                for problem in wire_rules.check_message(message, LAYOUT, engine_index=0):
                    broken.setdefault(wire_rules.rule_of(problem), f"{problem} in {message!r:.300}")
                done = [o for o in message[1] if o[0] == "after-flood" and len(o) > 5 and o[5] is not None]
                if done:
                    break
        counts = app.counters()[0]
        assert counts["bad_frames"] > 5_000 and counts["violations"] == 0
        assert app.supervisor.failure is None
        assert not broken, f"wire rules broken: {broken}"
    finally:
        app.stop()
        assert waiter.get(timeout=10) == 0
        frontend.close()
