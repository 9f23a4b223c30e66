"""Driving one EngineCore by hand in unit tests: step it until idle and pick
a request's outputs and tokens out of what it sent."""

from typing import Any, List, Tuple


def run(engine: Any, limit: int = 10000) -> List[Tuple[int, List[Any]]]:
    """Step until idle; return every (client, message) sent."""
    sent: List[Tuple[int, List[Any]]] = []
    for _ in range(limit):
        if not engine.has_work:
            return sent
        sent.extend(engine.step())
    raise AssertionError("engine never went idle")


def outputs_of(sent: List[Tuple[int, List[Any]]], rid: str) -> List[List[Any]]:
    """The EngineCoreOutputs of request `rid`, in order."""
    return [o for _, m in sent for o in m[1] if o[0] == rid]


def tokens_of(sent: List[Tuple[int, List[Any]]], rid: str) -> List[int]:
    """The token ids request `rid` was sent, in order."""
    return [t for o in outputs_of(sent, rid) for t in o[1]]
