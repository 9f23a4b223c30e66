"""The links between one engine's stages: readers -> stepper -> sender.

The stages of an engine (runner.py wires them) talk to each other only
through one `StageLinks`, by name:

* a reader (transport.Reader) `deliver`s each decoded input to the
  stepper and `wake`s it; it reads its socket only while `input_open`
  (else `wait_input_open`), and asks `paced` how to take a burst;
* the stepper (runner.EngineRunner) takes input from `input_queue`,
  sleeps on `woken`, and hands each message it makes to the sender:
  `send_now` (the sender is idle: sent from the stepper's greenlet) or
  `queue_output`, the bytes from `encode`;
* the sender (transport.Sender) `take_output`s and sends each message
  while `outputs_open` (else `wait_outputs_open`).

The queues are bounded, so a slow frontend throttles the stepper instead of
growing memory (the PUSH blocks at its high-water mark, the sender waits,
the output queue fills, the stepper waits); a flood of input waits in
`deliver`. The gates are the fault layer's (fault_injection.py: closed
during a hang or a stall; the same gates across a reload).

Each link is a callable bound once, here, to the queue, event or stage
that does the work, so a loop that binds it to a local name calls that
directly: the links cost nothing per frame (a method of this class would
add a Python call to every message).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import gevent.event
import gevent.queue

#: Bounds of the queues between the stages (messages, not tokens).
INPUT_QUEUE_SIZE = 4096
OUTPUT_QUEUE_SIZE = 1024


def _not_sent(item: Any) -> bool:
    return False


def _as_is(message: Any) -> Any:
    return message


class StageLinks:
    """What one engine's readers, stepper and sender share, by name."""

    def __init__(self) -> None:
        #: Decoded input, in arrival order (readers -> stepper).
        self.input_queue: gevent.queue.Queue = gevent.queue.Queue(INPUT_QUEUE_SIZE)
        #: (client_index, encoded message) the sender has yet to send (stepper -> sender).
        self.output_queue: gevent.queue.Queue = gevent.queue.Queue(OUTPUT_QUEUE_SIZE)
        #: The stepper sleeps on this when it has nothing to do.
        self.woken = gevent.event.Event()
        #: The engine whose latency model `paced` reads (set once it joined).
        self.engine: Optional[Any] = None

        # -- reader -> stepper --
        #: Queue one decoded input for the stepper (waits while the queue is full).
        self.deliver: Callable[[Any], None] = self.input_queue.put
        #: Tell the stepper there is something to do (input, or a step due).
        self.wake: Callable[[], None] = self.woken.set

        # -- stepper -> sender --
        #: Queue one (client_index, message) for the sender, after what is queued.
        self.queue_output: Callable[[Any], None] = self.output_queue.put
        #: The sender's next (client_index, message); waits for one.
        self.take_output: Callable[[], Any] = self.output_queue.get
        #: Send one (client_index, encoded message) from the caller's greenlet
        #: if the sender is idle (transport.Sender.send_now); False: queue it.
        #: Until the sender exists: never.
        self.send_now: Callable[[Any], bool] = _not_sent
        #: The bytes of a message as the sender would send them (None: nothing
        #: to send; transport.Sender.encode). Until the sender exists: the
        #: message itself, for the sender to encode when it takes it.
        self.encode: Callable[[Any], Any] = _as_is

        # -- the gates (set_gates) --
        self.input_open: Callable[[], bool] = lambda: True
        self.wait_input_open: Callable[[], Any] = lambda: True
        self.outputs_open: Callable[[], bool] = lambda: True
        self.wait_outputs_open: Callable[[], Any] = lambda: True

    def set_gates(self, flowing: gevent.event.Event, outputs_flowing: gevent.event.Event) -> None:
        """Stop the stages at the fault layer's gates: `flowing` (closed by a
        hang: the readers and the stepper wait) and `outputs_flowing` (closed
        by a stall or a hang: the sender waits)."""
        #: May the inputs be read and applied? (False during a hang.)
        self.input_open = flowing.is_set
        #: Wait until they may.
        self.wait_input_open = flowing.wait
        #: May outputs be sent? (False during a stall or a hang.)
        self.outputs_open = outputs_flowing.is_set
        #: Wait until they may.
        self.wait_outputs_open = outputs_flowing.wait

    def attach_sender(self, send_now: Callable[[Any], bool], encode: Callable[[Any], Any]) -> None:
        """The sender exists: the stepper sends through its `send_now` and
        encodes with its `encode` from now on."""
        self.send_now = send_now
        self.encode = encode

    def paced(self) -> bool:
        """The engine steps on a clock (a latency model; a reload may change
        it): a reader then takes a burst of input in slices."""
        return self.engine is not None and self.engine.latency.paced
