"""Each request's `status` (request.RequestStatus, vLLM's) against the
scheduler's books, over random runs of the engine (the scenarios of
engine_scenarios.py: ADDs, aborts, utilities, steps, with the KV cache,
the batch limit and the token budget drawn): after every input and every
step, a request in the running batch is RUNNING (WAITING_FOR_REMOTE_KVS
while it waits for its KV), one in the waiting queue WAITING or PREEMPTED
(PREEMPTED only once it was preempted), and one that left both has the
finished status of the finish reason its terminal output carried. A P/D
consumer's wait for its KV (WAITING_FOR_REMOTE_KVS) is checked on its own
at the end."""

from typing import Dict, List

from hypothesis import given, settings
from engine_driver import Observer, examples, run_scenario, violation
from engine_scenarios import ALL, scenarios

from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import EngineCoreEventType, FinishReason
from gmock_engine.core.request import FINISHED_STATUS, Request, RequestStatus

class StatusObserver(Observer):
    """Every request object the scheduler held, checked after each apply and step."""

    def __init__(self) -> None:
        self.seen: Dict[int, Request] = {}  # id(object) -> the request (ids may be reused)
        self.ended: Dict[str, FinishReason] = {}  # request id -> finish reason of its terminal output

    def output(self, run, client, message):
        ended = set()
        for output in message[1]:
            if len(output) > 5 and output[5] is not None:
                self.ended[output[0]] = FinishReason(output[5])
                ended.add(output[0])
        for rid in message[5] if len(message) > 5 and message[5] else ():
            if rid not in ended:  # the id alone ends it (an abort the frontend asked for)
                self.ended[rid] = FinishReason.ABORT

    def after(self, run):
        scheduler = run.engine.scheduler
        held = set()
        for request in scheduler.running.values():
            held.add(id(request))
            self.seen.setdefault(id(request), request)
            want = RequestStatus.WAITING_FOR_REMOTE_KVS if request.request_id in scheduler.transferring else RequestStatus.RUNNING
            if request.status is not want:
                raise violation("Status_running", f"running request {request.request_id!r:.60} has status {request.status.name}, not {want.name}")
        for request in scheduler.waiting.requests():
            held.add(id(request))
            self.seen.setdefault(id(request), request)
            # PREEMPTED: back in the queue after a preemption, whose event
            # waits for its next output
            preempted = any(event["type"] == EngineCoreEventType.PREEMPTED for event in request.pending_events or ())
            want = RequestStatus.PREEMPTED if preempted else RequestStatus.WAITING
            if request.status is not want:
                raise violation("Status_waiting", f"waiting request {request.request_id!r:.60} has status {request.status.name}, not {want.name}")
        gone: List[int] = []
        for key, request in self.seen.items():
            if key in held:
                continue
            if not RequestStatus.is_finished(request.status):
                raise violation("Status_finished", f"request {request.request_id!r:.60} left the books with status {request.status.name}")
            reason = self.ended.get(request.request_id)
            allowed = {FINISHED_STATUS[reason]} if reason is not None else set()
            if reason is FinishReason.ERROR:
                allowed.add(RequestStatus.FINISHED_IGNORED)  # KV that can never fit: an ERROR on the wire
            if request.status not in allowed:
                raise violation("Status_reason", f"request {request.request_id!r:.60} ended {reason} on the wire, status {request.status.name}")
            gone.append(key)
        for key in gone:
            del self.seen[key]

    def end(self, run):
        self.after(run)


@settings(max_examples=examples(400))
@given(scenario=scenarios(ALL))
def test_status_follows_the_books(scenario):
    """(a) + each request's status against where the scheduler holds it."""
    run_scenario(scenario, [StatusObserver()])


@settings(max_examples=examples(300))
@given(scenario=scenarios(frozenset({"scheduler", "bulk"}), kv_blocks=True))
def test_status_follows_the_books_with_preemptions(scenario):
    """The same with the KV cache always enforced: preemptions are common."""
    run_scenario(scenario, [StatusObserver()])


# -- P/D: the consumer's wait for its KV (not in the random scenarios) ----------


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _consumer(**kw):
    from gmock_engine.core.engine import EngineCore, EngineSettings
    from gmock_engine.kv.transfer import KVTransferSettings

    clock = _Clock()
    settings = EngineSettings(rank=0, num_clients=1, kv_transfer=KVTransferSettings(role="consumer", **kw), block_size=16)
    return EngineCore(settings, clock=clock), clock


def _decode_add(rid, **extra):
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0]],
        "remote_engine_id": "gmock",
        "remote_request_id": "p-" + rid,
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    }
    return EngineCoreRequest(request_id=rid, prompt_len=10, max_tokens=4, has_sampling_params=True, extra_args={"kv_transfer_params": params, **extra})


def test_a_consumer_waits_for_remote_kvs_then_runs_then_ends():
    engine, clock = _consumer(ms_per_token=10.0)
    for rid in ("d", "gone"):
        engine.apply(_decode_add(rid))
    engine.apply(_decode_add("bad", mock_kv_load="fail"))
    assert {r.status for r in engine.scheduler.waiting.requests()} == {RequestStatus.WAITING}
    engine.step()  # admitted: each waits for its KV
    held = dict(engine.scheduler.running)
    assert {rid: r.status for rid, r in held.items()} == dict.fromkeys(("d", "gone", "bad"), RequestStatus.WAITING_FOR_REMOTE_KVS)
    engine.abort_requests(["gone"])
    assert held["gone"].status is RequestStatus.FINISHED_ABORTED
    clock.now += 0.2  # 10 tokens x 10 ms: the KV is here
    engine.step()
    assert held["d"].status is RequestStatus.RUNNING
    assert held["bad"].status is RequestStatus.FINISHED_ERROR  # kv_load_failure_policy "fail"
    while engine.has_work:
        engine.step()
    assert held["d"].status is RequestStatus.FINISHED_LENGTH_CAPPED
