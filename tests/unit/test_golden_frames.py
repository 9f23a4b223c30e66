"""gmock_engine.wire against golden frames made by each vLLM version's
own msgspec types (tests/golden/vllm-<version>.json, tests/golden/generate.py).

For every version with a golden file:
* its layout (`wire.eras.layout_for_version`) lists the fields that version's
  classes declare, in the same order, and knows the same FinishReasons (§8.1);
* `decode_add` reads the real frontend's ADD frames (§3.2) back to the
  values they were built from;
* `engine_core_outputs` / `engine_core_output` / `logprobs_lists` build, for
  the same logical content, what the real engine's encoder sends (§4.2,
  §4.3, Appendix E), index by index (`golden.differences` says where not).
The expected values all come from the golden files; nothing here restates
a layout.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gmock_engine.wire.eras import WIRE_LAYOUTS, WireLayout, layout_for_version
from gmock_engine.wire.inputs import EngineCoreRequest, decode_add
from gmock_engine.wire.outputs import engine_core_output
from gmock_engine.wire.types import FinishReason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))

import golden  # noqa: E402

FILES = golden.golden_files()
DOCUMENTS = {path.stem[len("vllm-"):]: golden.load(path) for path in FILES}
VERSIONS = list(DOCUMENTS)


def _layout(version: str) -> WireLayout:
    return layout_for_version(version)


def _cases(kind: str):
    return [pytest.param(version, item["name"], id=f"{version}-{item['name']}") for version, document in DOCUMENTS.items()
            for item in document[kind]]


def _item(version: str, kind: str, name: str):
    return next(item for item in DOCUMENTS[version][kind] if item["name"] == name)


def test_golden_files_cover_every_era():
    """At least one golden version per era from 0.11 to 0.32 (0.33 has no
    Python wheel to generate from), and each file says which vLLM made it."""
    assert len(FILES) >= 20, f"only {len(FILES)} golden files in {golden.GOLDEN_DIR}"
    eras = {_layout(v).version for v in VERSIONS}
    assert eras >= set(WIRE_LAYOUTS) - {"0.33"}, f"eras without a golden file: {sorted(set(WIRE_LAYOUTS) - eras)}"
    for version, document in DOCUMENTS.items():
        assert document["vllm_version"] == version


@pytest.mark.parametrize("version", VERSIONS)
def test_layout_fields_are_the_versions_own(version):
    """The era's field lists are the version's `__struct_fields__`, in
    order (§8.1), and its FinishReason names the version's enum."""
    layout, fields = _layout(version), DOCUMENTS[version]["fields"]
    assert layout.version in WIRE_LAYOUTS
    assert list(layout.request_fields) == fields["EngineCoreRequest"]
    assert list(layout.output_fields) == fields["EngineCoreOutput"]
    assert list(layout.outputs_fields) == fields["EngineCoreOutputs"]
    assert sorted(_finish_reason_names(layout)) == sorted(DOCUMENTS[version]["finish_reasons"])
    # Appendix E: a LogprobsLists/LogprobsTensors NamedTuple decodes from at
    # least its 3 required fields and at most all of them (msgspec rejects
    # a longer array for a NamedTuple); where the era has 4 or fewer, ours
    # is exactly that long.
    for arity, name in ((layout.logprobs_arity, "LogprobsLists"), (layout.tensors_arity, "LogprobsTensors")):
        real = len(fields[name])
        assert 3 <= arity <= real, f"{name}: arity {arity}, the era has {real} fields"
        assert arity == real or arity == 4, f"{name}: arity {arity}, the era has {real} fields"


def _finish_reason_names(layout):
    # WireLayout.finish_reasons (the names the era knows) where the layout
    # has it; else the enum up to max_finish_reason (§4.4: values only grow).
    names = getattr(layout, "finish_reasons", None)
    if names is None:
        names = [r.name for r in FinishReason if r <= layout.max_finish_reason]
    return list(names)


def test_layout_for_version_refuses_unknown_versions():
    """Versions before 0.11 and nonsense raise ValueError (not a guess)."""
    for text in ("0.10.2", "0.9", "banana", ""):
        with pytest.raises(ValueError):
            layout_for_version(text)


@pytest.mark.parametrize("version,name", _cases("requests"))
def test_decode_add_reads_the_real_frontends_add(version, name):
    """decode_add of the real frontend's ADD frame 1 (§3.2, §3.3) gives back
    the values the golden request was built from."""
    document, item = DOCUMENTS[version], _item(version, "requests", name)
    request = decode_add(item["unpacked"], _layout(version))
    problems = golden.request_problems(request, item["logical"], document["sampling_default_max_tokens"])
    assert not problems, f"vLLM {version} {name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("version,name", _cases("outputs"))
def test_outputs_match_the_real_engines_encoding(version, name):
    """Our EngineCoreOutputs for the golden logical content, unpacked, is the
    real engine's encoding unpacked, up to trailing defaults (§0, §4)."""
    document, item = DOCUMENTS[version], _item(version, "outputs", name)
    ours = golden.our_outputs(item["logical"], _layout(version))
    problems = golden.output_differences(document, item, ours)
    assert not problems, f"vLLM {version} {name}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("version", [v for v in VERSIONS if "ERROR" not in DOCUMENTS[v]["finish_reasons"]])
def test_error_finish_is_one_the_era_knows(version):
    """Where the era has no ERROR (before 0.13, §4.4), an ERROR end goes on
    the wire as a reason the era's enum has: an unknown value is a fatal
    decode error in the frontend."""
    layout = _layout(version)
    out = engine_core_output("r", [], FinishReason.ERROR, layout=layout)
    assert out[layout.output_fields.index("finish_reason")] in DOCUMENTS[version]["finish_reasons"].values()


#: The EngineCoreRequest fields decode_add reads at a position (§3.2).
_READ_FIELDS = ("client_index", "current_wave", "priority", "arrival_time", "eos_token_id")


def _positions(fields, names):
    return [fields.index(n) if n in fields else None for n in names]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_wrong_era_is_caught(version):
    """The comparisons have teeth: every other era that puts a field the
    mock reads (requests) or a field among those ours writes (outputs)
    somewhere else than this version does fails at least one golden check.
    (Eras that differ only beyond them are compatible by design, §0, and
    are not counted.)"""
    document = DOCUMENTS[version]
    real_request, real_output = document["fields"]["EngineCoreRequest"], document["fields"]["EngineCoreOutput"]
    # the EngineCoreOutput positions ours writes for this content: an era
    # that differs only beyond them sends the same bytes
    written = max(len(o) for item in document["outputs"] for o in golden.our_outputs(item["logical"], _layout(version))[1])
    checked = 0
    for other in WIRE_LAYOUTS.values():
        if _positions(list(other.request_fields), _READ_FIELDS) != _positions(real_request, _READ_FIELDS):
            checked += 1
            wrong = 0
            for item in document["requests"]:
                request = decode_add(item["unpacked"], other)
                logical = item["logical"]
                wrong += not isinstance(request, EngineCoreRequest) or (
                    request.client_index, request.current_wave, request.priority, request.arrival_time, request.eos_token_id
                ) != (logical.get("client_index", 0), logical.get("current_wave", 0), logical.get("priority", 0),
                      logical["arrival_time"], logical.get("eos_token_id"))
            assert wrong, f"era {other.version}'s request layout passes vLLM {version}'s ADDs"
        if list(other.output_fields[:written]) != real_output[:written]:
            checked += 1
            wrong = 0
            for item in document["outputs"]:
                try:
                    ours = golden.our_outputs(item["logical"], other)
                except (KeyError, ValueError):
                    wrong += 1
                    continue
                wrong += bool(golden.output_differences(document, item, ours))
            assert wrong, f"era {other.version}'s output layout passes vLLM {version}'s outputs"
    assert checked, "no other era differs: the check proved nothing"


# -- ignore_eos, as a frontend sends it with the EOS id --------------------------------

#: The golden ADDs whose SamplingParams carry the EOS id (`_eos_token_id`, the eras from 0.17).
EOS_CASES = [
    pytest.param(version, item["name"], id=f"{version}-{item['name']}")
    for version, document in DOCUMENTS.items()
    for item in document["requests"]
    if "_eos_token_id" in item["unpacked"][_layout(version).request_fields.index("sampling_params")]
]


def _with_ignore_eos(version: str, name: str, value: object) -> bytes:
    """The golden ADD frame with `ignore_eos` set in its SamplingParams map
    (msgspec leaves the field out at its default, False, and writes it as a
    key when it is set), packed again."""
    import copy

    import msgpack

    fields = copy.deepcopy(_item(version, "requests", name)["unpacked"])
    fields[_layout(version).request_fields.index("sampling_params")]["ignore_eos"] = value
    return msgpack.packb(fields, use_bin_type=True)


def test_the_eos_eras_have_golden_adds_with_the_eos_id():
    eras = {_layout(version).version for version, _ in (p.values for p in EOS_CASES)}
    assert len(eras) >= 5, eras


@pytest.mark.parametrize("version,name", EOS_CASES)
def test_decode_add_reads_ignore_eos_beside_the_eos_id(version, name):
    """ignore_eos true decodes as True next to the frame's EOS id, and false
    (or absent, the golden frame itself) as False."""
    from gmock_engine.wire.inputs import unpack

    sampling = _item(version, "requests", name)["unpacked"][_layout(version).request_fields.index("sampling_params")]
    request = decode_add(unpack(_with_ignore_eos(version, name, True)), _layout(version))
    assert isinstance(request, EngineCoreRequest), request
    assert request.ignore_eos is True and request.eos_token_id == sampling["_eos_token_id"]
    assert decode_add(unpack(_with_ignore_eos(version, name, False)), _layout(version)).ignore_eos is False
    assert decode_add(_item(version, "requests", name)["unpacked"], _layout(version)).ignore_eos is False


@pytest.mark.parametrize("version", sorted({v for v, _ in (p.values for p in EOS_CASES)}, key=golden.version_key))
def test_an_eos_scenario_request_with_ignore_eos_runs_to_max_tokens(version):
    """An engine whose requests end by EOS after one token: the decoded ADD
    with ignore_eos runs to its max_tokens and ends LENGTH; the same ADD
    without it ends STOP on the frame's EOS id after one token."""
    from engine_steps import engine_with, outputs_of, run, tokens_of
    from gmock_engine.content.lengths import OutputLengths
    from gmock_engine.wire.inputs import unpack

    name = next(n for v, n in (p.values for p in EOS_CASES) if v == version)
    ended = {}
    for ignore in (True, False):
        request = decode_add(unpack(_with_ignore_eos(version, name, ignore)), _layout(version))
        assert request.max_tokens > 1
        engine = engine_with(output_lengths=OutputLengths.parse("fixed:1"))
        engine.apply(request)
        sent = run(engine)
        ended[ignore] = (tokens_of(sent, request.request_id), outputs_of(sent, request.request_id)[-1][5], request)
    tokens, finish, request = ended[True]
    assert len(tokens) == request.max_tokens and finish == FinishReason.LENGTH
    tokens, finish, request = ended[False]
    assert tokens == [request.eos_token_id] and finish == FinishReason.STOP
