"""Property-based tests of the pure EngineCore, driven by real wire frames.

Each example draws engine settings and a stream of operations: ADD, ABORT,
UTILITY and raw frames, built as the frontends build them (msgpack arrays,
fake_frontend.engine_core_request) with adversarial values, plus decode steps
on a fake clock. Every frame goes through `wire.inputs.decode_input` exactly as
the runtime's reader does (a ProtocolError is the reader's job: the frame is
dropped), then into `EngineCore.apply`; steps are taken when the engine says
one is due (`next_step_time`, as the runtime's stepper). At the end every
example steps until idle, aborts everything and steps until idle again.

Properties, each its own test so that one broken property does not hide
another:

(a) no exception escapes decode (other than ProtocolError), apply or step;
(b) every message the engine returns packs with msgpack and passes
    wire_rules, i.e. both real frontends can decode it;
(c) the engine's ledger reports no violation;
(d) no request is preempted in the step that admitted it, nor admitted in
    the step that preempted it (vLLM's scheduler, vllm/v1/core/sched/
    core/scheduler.py `schedule()`: running requests first, preemption only among
    them, waiting ones only `if not preempted_reqs`). Visible on the wire as
    SCHEDULED and PREEMPTED events with the same timestamp, of one request or
    of two (the fake clock advances on every step);
(e) every ADD the engine accepted gets exactly one terminal output (or, for
    abort_immediately, only its id in finished_requests), on its own client,
    nothing for it afterwards, its id in that message's finished_requests;
    every UTILITY call exactly one reply, on its caller's client; at the
    end, with every request ended, no KV block or token is held;
(f) a request whose stop ids (plus EOS) cover every id the engine may emit
    ends with finish_reason STOP on its first token (vLLM's check_stop);
(g), (h): with outputs reused, in test_reused_output_properties.py.

Failures raise an AssertionError subclass named after the rule, so Hypothesis
reports distinct rules as distinct bugs, each with its own shrunk example.
Reading one: the settings dict, then the operations; the leading
`('step', 0.001)`s are padding (a stream has at least 8 operations, and
"step" is what the shrinker turns unneeded ones into; on an idle engine a step
does nothing). The wire test runs once per focus (xargs, tokens, stops,
utility, scheduler, sampling, all), each its own search.

The scenarios (strategies) are in engine_scenarios.py; the driver, the
Observer base and `violation` in engine_driver.py. Profiles, example counts
and the printed case total: conftest.py here.

§N: section N of docs/protocol.md.
"""


from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, List, Optional, Tuple

import pytest
import wire_rules
from engine_driver import ADD_TYPES, LAYOUT, Observer, examples, run_scenario, violation
from engine_scenarios import ALL, MOCK_KEYS, WIRE_FOCUS, scenarios
from hypothesis import given, settings

from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall
from gmock_engine.wire.types import EngineCoreEventType, FinishReason

#: The engine's logging off and each test's cases counted (conftest.py).
pytestmark = pytest.mark.usefixtures("_quiet_engine_and_case_count", "_time_each_test")

#: Client index of the coordinator_output socket in the engine's (client, message) pairs (vLLM's too).
COORDINATOR = -1


# --------------------------------------------------------------------------
# Observers: one per property
# --------------------------------------------------------------------------


class WireObserver(Observer):
    """(b) every message packs and passes wire_rules."""

    def __init__(self) -> None:
        #: call id -> method, for typed results; an id reused for another
        #: method is dropped (a deferred reply could belong to either call).
        self.methods: Dict[int, str] = {}
        self.ambiguous: set = set()

    def input(self, run, message):
        if isinstance(message, UtilityCall) and message.call_id not in self.ambiguous:
            if self.methods.setdefault(message.call_id, message.method) != message.method:
                del self.methods[message.call_id]
                self.ambiguous.add(message.call_id)

    def output(self, run, client, message):
        _, problems = wire_rules.pack_and_check(message, LAYOUT, engine_index=run.settings.rank, utility_methods=self.methods)
        if problems:
            raise violation(
                "WireRule_" + wire_rules.rule_of(problems[0]),
                f"message to client {client} breaks the wire rules:\n  " + "\n  ".join(problems[:6]) + f"\nmessage: {message!r:.1500}",
            )


class LedgerObserver(Observer):
    """(c) the engine's own ledger finds nothing wrong."""

    def after(self, run):
        summary = run.engine.ledger.summary()
        if summary["violations"]:
            raise violation("Ledger_violation", f"ledger: {summary['violations']} violation(s), e.g. {run.engine.ledger.violations[:3]}")


class PreemptionObserver(Observer):
    """(d) no PREEMPTED event at the timestamp of a SCHEDULED one (same step,
    in either order: vLLM schedules waiting requests only in a step that
    preempted none, and preempts only requests scheduled before), within one
    request's events and across requests: a request preempted in a step
    holds up every admission of that step, whoever it would admit (with the
    priority policy, a newcomer that fits in the blocks just freed). A
    request's events ride on its next output, so the times are gathered over
    the whole run and each new one is checked against all the others."""

    def __init__(self) -> None:
        self.scheduled: Dict[float, str] = {}  # timestamp -> a request SCHEDULED then
        self.preempted: Dict[float, str] = {}  # timestamp -> a request PREEMPTED then

    def output(self, run, client, message):
        events_at = LAYOUT.output_position("events")
        for output in message[1]:
            events = output[events_at] if len(output) > events_at else None
            if not events:
                continue
            rid = output[0]
            scheduled = {e["timestamp"] for e in events if e["type"] == EngineCoreEventType.SCHEDULED}
            preempted = {e["timestamp"] for e in events if e["type"] == EngineCoreEventType.PREEMPTED}
            if scheduled & preempted:
                raise violation(
                    "Preempted_in_admitting_step",
                    f"request {rid!r:.60} was SCHEDULED and PREEMPTED in the same step (t={sorted(scheduled & preempted)}): events {events}",
                )
            for t in scheduled:
                self.scheduled.setdefault(t, rid)
                if t in self.preempted:
                    raise violation(
                        "Admitted_in_preempting_step",
                        f"request {rid!r:.60} was SCHEDULED at t={t}, the step that PREEMPTED {self.preempted[t]!r:.60}: events {events}",
                    )
            for t in preempted:
                self.preempted.setdefault(t, rid)
                if t in self.scheduled:
                    raise violation(
                        "Admitted_in_preempting_step",
                        f"request {rid!r:.60} was PREEMPTED at t={t}, the step that SCHEDULED {self.scheduled[t]!r:.60}: events {events}",
                    )


class LifecycleObserver(Observer):
    """(e) one terminal per accepted ADD, on its client, nothing after it;
    finished_requests names every end; one reply per UTILITY, on its client;
    coordinator messages are stats only."""

    def __init__(self) -> None:
        self.open: Dict[str, List[int]] = defaultdict(list)  # id -> clients of its open ADDs
        self.calls: Counter = Counter()  # (client, call_id) -> replies owed

    def input(self, run, message):
        clients = run.settings.num_clients
        if isinstance(message, ADD_TYPES) and message.client_index < clients:
            self.open[message.request_id].append(message.client_index)
        elif isinstance(message, UtilityCall) and message.client_index < clients:
            self.calls[(message.client_index, message.call_id)] += 1

    def output(self, run, client, message):
        if client == COORDINATOR:
            if not run.settings.has_coordinator or message[1] or message[2] is None or len(message) > 4:
                raise violation("Lifecycle_coordinator", f"coordinator message is not stats-only (or no coordinator): {message!r:.300}")
            return
        if not 0 <= client < run.settings.num_clients:
            raise violation("Lifecycle_client", f"message to client {client}, which does not exist: {message!r:.300}")
        if len(message) > 4 and message[4] is not None:
            key = (client, message[4][0])
            if self.calls[key] <= 0:
                raise violation("Lifecycle_utility_reply", f"reply to call {message[4][0]} on client {client}: no such call pending (second reply or wrong client)")
            self.calls[key] -= 1
        finished = list(message[5]) if len(message) > 5 and message[5] else []
        terminal = Counter()
        for output in message[1]:
            rid = output[0]
            clients = self.open.get(rid)
            if not clients:
                raise violation("Lifecycle_after_terminal", f"output for {rid!r:.60} with no open ADD (after its terminal output, or never added): {output!r:.200}")
            if client not in clients:
                raise violation("Lifecycle_routing", f"output for {rid!r:.60} on client {client}, its ADD came from client(s) {clients}")
            if len(output) > 5 and output[5] is not None:
                terminal[rid] += 1
                clients.remove(client)
                if rid not in finished:
                    raise violation("Lifecycle_finished_requests", f"terminal output for {rid!r:.60} but its id is not in finished_requests {finished!r:.200}")
        for rid, count in Counter(finished).items():
            extra = count - terminal[rid]
            for _ in range(extra):  # abort_immediately: the id alone ends it
                clients = self.open.get(rid)
                if not clients or client not in clients:
                    raise violation("Lifecycle_finished_requests", f"finished_requests names {rid!r:.60} on client {client}, which has no open ADD there")
                clients.remove(client)
        for rid in terminal:
            if not self.open.get(rid):
                self.open.pop(rid, None)

    def end(self, run):
        still_open = {rid: clients for rid, clients in self.open.items() if clients}
        if still_open:
            raise violation("Lifecycle_no_terminal", f"{len(still_open)} request(s) never ended (after abort of every id): {list(still_open.items())[:5]!r:.400}")
        engine = run.engine
        if engine.num_active == 0 and (engine.used_blocks or engine.kv_tokens):
            # every request ended (by ABORT, pause/sleep in abort mode, ...): none holds KV
            raise violation("Lifecycle_kv_held", f"no request active, but {engine.used_blocks} KV block(s) and {engine.kv_tokens} token(s) held")
        owed = {key: n for key, n in self.calls.items() if n}
        if owed:
            raise violation("Lifecycle_utility_unanswered", f"utility calls never answered: {list(owed.items())[:5]}")


class StopCoverObserver(Observer):
    """(f) stop ids (+ EOS unless ignore_eos) covering the engine's whole
    vocabulary: the first token is a stop token, finish_reason STOP (vLLM
    check_stop, vllm/v1/core/sched/utils.py: EOS first, stop_reason nil; a
    stop id: stop_reason = that id)."""

    def __init__(self) -> None:
        self.watch: Dict[str, Tuple[Optional[int], bool]] = {}  # id -> (EOS id on the wire, ignore_eos)
        self.checked = 0

    def input(self, run, message):
        if not isinstance(message, EngineCoreRequest) or message.client_index >= run.settings.num_clients:
            return
        rid = message.request_id
        if rid in run.engine.active or rid in run.engine.waiting:
            return  # a duplicate of an active id (answered with ERROR)
        vocab = run.settings.vocab_size
        eos = message.eos_token_id if not message.ignore_eos else None
        cover = set(message.stop_token_ids) | ({eos} if eos is not None else set())
        eligible = (
            message.has_sampling_params
            and not message.abort_immediately
            and message.min_tokens == 0
            and (message.max_tokens or 0) > 0
            and run.settings.max_model_len > message.prompt_len
            and not any(key in message.extra_args for key in MOCK_KEYS)
            and run.spec["token_source"] == ("random",)
            and cover.issuperset(range(vocab))
            # (newer decoders) ids the sampling controls may force must be in the vocabulary
            and set(getattr(message, "allowed_token_ids", None) or ()).issubset(range(vocab))
            and set(getattr(message, "logit_bias", None) or ()).issubset(range(vocab))
        )
        if eligible:
            self.watch[rid] = (message.eos_token_id, message.ignore_eos)

    def output(self, run, client, message):
        for output in message[1]:
            rid = output[0]
            if rid not in self.watch:
                continue
            final = len(output) > 5 and output[5] is not None
            if not output[1]:
                if final:
                    del self.watch[rid]  # ended without a token (abort, pause, ...)
                continue
            eos, ignore_eos = self.watch.pop(rid)
            self.checked += 1
            token = output[1][0]
            stop_reason = output[6] if len(output) > 6 else None
            # EOS: stop_reason nil; a stop id: that id. An EOS id sent with
            # ignore_eos (no frontend does: Python drops the id, vllm-rs sends
            # none) is EOS to vLLM's check_stop and not to the mock: either.
            if token != eos:
                expected = {token}
            else:
                expected = {None, token} if ignore_eos else {None}
            if not (len(output[1]) == 1 and final and output[5] == FinishReason.STOP and stop_reason in expected):
                raise violation(
                    "StopCover_first_token_not_stop",
                    f"request {rid!r:.60}: its stop ids + EOS {eos} (ignore_eos {ignore_eos}) cover the vocabulary of "
                    f"{run.settings.vocab_size}, but its first output is tokens {output[1][:8]} finish_reason "
                    f"{output[5] if len(output) > 5 else None} stop_reason {stop_reason!r} (expected one stop token, "
                    f"STOP, stop_reason {' or '.join(sorted(map(repr, expected)))})",
                )


# --------------------------------------------------------------------------
# The properties
# --------------------------------------------------------------------------


@pytest.mark.parametrize("focus", list(WIRE_FOCUS))
def test_every_output_packs_and_decodes_in_both_frontends(focus):
    """(a) + (b)."""

    @settings(max_examples=examples(650))
    @given(scenario=scenarios(WIRE_FOCUS[focus]))
    def check(scenario):
        run_scenario(scenario, [WireObserver()])

    check()


@settings(max_examples=examples(750))
@given(scenario=scenarios(ALL))
def test_the_ledger_finds_no_violation(scenario):
    """(a) + (c)."""
    run_scenario(scenario, [LedgerObserver()])


def test_no_request_is_preempted_in_the_step_that_admitted_it():
    """(a) + (d), with the KV cache always enforced (3..40 blocks of 16);
    fails unless some examples preempted under the priority policy (where a
    newcomer may outrank the preempted request at the head of the queue)."""
    counts: Counter = Counter()

    @settings(max_examples=examples(700))
    @given(scenario=scenarios(frozenset({"scheduler", "bulk"}), kv_blocks=True))
    def check(scenario):
        run = run_scenario(scenario, [PreemptionObserver()])
        if run.engine.counters["preemptions"]:
            counts[run.settings.scheduling_policy] += 1

    check()
    assert counts["priority"] > 0, f"no example preempted under the priority policy: {dict(counts)}"


@settings(max_examples=examples(900))
@given(scenario=scenarios(ALL))
def test_every_request_ends_exactly_once_and_every_call_is_answered(scenario):
    """(a) + (e)."""
    run_scenario(scenario, [LifecycleObserver()])


@settings(max_examples=examples(700))
@given(scenario=scenarios(frozenset({"stops", "scheduler"})))
def test_stop_ids_covering_the_vocabulary_stop_on_the_first_token(scenario):
    """(a) + (f)."""
    run_scenario(scenario, [StopCoverObserver()])
