"""Each request's `status` (request.RequestStatus, vLLM's) against the
scheduler's books, over random runs of the engine (the scenarios of
test_engine_properties: ADDs, aborts, utilities, steps, with the KV cache,
the batch limit and the token budget drawn): after every input and every
step, a request in the running batch is RUNNING (WAITING_FOR_REMOTE_KVS
while it waits for its KV), one in the waiting queue WAITING or PREEMPTED
(PREEMPTED only once it was preempted), and one that left both has the
finished status of the finish reason its terminal output carried."""

from typing import Dict, List

from hypothesis import given, settings
from test_engine_properties import ALL, Observer, examples, run_scenario, scenarios, violation

from gmock_engine.protocol import EngineCoreEventType, FinishReason
from gmock_engine.request import FINISHED_STATUS, Request, RequestStatus

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
