"""--replay behind a real frontend (docs/record.md, Replay): the mock is
recorded through the tap with --record-token-ids, then a fresh stack whose
engine would make other tokens (another --seed, no EOS lengths) replays the
trace: the client gets the same text, token counts and finish reasons, and
a request beyond the trace is served by the engine's model."""

from __future__ import annotations

import e2e_harness as h
from test_record_e2e import TapStack, completion

#: (max_tokens, tokens, finish) of the recorded run: --output-len-dist fixed:5 stops the longer ones
REQUESTS = ((4, 4, "length"), (9, 5, "stop"), (7, 5, "stop"))


class RecordingTap(TapStack):
    tap_args = ("--record-token-ids",)


def test_a_recorded_run_replays_to_the_same_text(frontends, model_dir, tmp_path):
    topology = h.Topology("python", dp=1)
    recorder = RecordingTap(topology, frontends, model_dir, tmp_path / "record", engine_args=["--seed", "1", "--output-len-dist", "fixed:5"])
    recorder.log_dir.mkdir()
    recorder.start()
    try:
        # one at a time: --replay-match arrival pairs the k-th ADD with the k-th recorded one
        recorded = [completion(recorder, n) for n, _, _ in REQUESTS]
    finally:
        problems = recorder.stop()
    assert not problems, problems
    assert [(tokens, finishes) for _, tokens, finishes in recorded] == [(t, [f]) for _, t, f in REQUESTS]

    replayer = h.Stack(topology, frontends, model_dir, tmp_path / "replay", engine_args=["--seed", "2", "--replay", str(recorder.trace_path)])
    replayer.log_dir.mkdir()
    replayer.start()
    try:
        replayed = [completion(replayer, n) for n, _, _ in REQUESTS]
        beyond = completion(replayer, 9)
    finally:
        problems = replayer.stop()
    assert not problems, problems
    assert replayed == recorded
    assert beyond[1:] == (9, ["length"])  # not in the trace: the model's (no EOS lengths here)
    assert len({text for text, _, _ in recorded}) == len(REQUESTS)  # the texts tell the requests apart
