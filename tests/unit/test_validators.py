"""The option value types (config/validators.py) on their own: the texts each
accepts (and the value it makes of them), the texts it refuses, and the
message it refuses them with (config/loader.py adds the flag and the source)."""

import argparse

import pytest

from gmock_engine.config import validators as v
from gmock_engine.wire.eras import layout_for_version


def refused(parse, text):
    """The message `parse` refuses `text` with."""
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    return str(info.value)


# -- numbers -------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("1", 1), ("0x10", 16), ("0o7", 7), ("0b11", 3), (" 5 ", 5), ("9223372036854775807", (1 << 63) - 1)])
def test_int_at_least_accepts(text, value):
    assert v.int_at_least(1)(text) == value


def test_int_at_least_refuses_with_a_message():
    parse = v.int_at_least(1)
    assert refused(parse, "abc") == "'abc' is not an integer"
    assert refused(parse, "1.5") == "'1.5' is not an integer"
    assert refused(parse, "") == "'' is not an integer"
    assert refused(parse, "0") == "0 is less than 1"
    assert refused(parse, "-0x2") == "-2 is less than 1"
    assert refused(parse, str(1 << 63)) == f"{1 << 63} is more than {(1 << 63) - 1}"


def test_int_at_least_with_a_maximum_and_its_name():
    parse = v.int_at_least(0, 10)
    assert parse("0") == 0 and parse("10") == 10
    assert refused(parse, "11") == "11 is more than 10"
    assert parse.__name__ == "integer in [0, 10]"
    assert v.int_at_least(2).__name__ == "integer >= 2"


def test_float_at_least():
    parse = v.float_at_least(0.0)
    assert parse("0") == 0.0 and parse("2.5") == 2.5 and parse("1e3") == 1000.0 and parse("inf") == float("inf")
    assert refused(parse, "x") == "'x' is not a number"
    assert refused(parse, "-0.5") == "-0.5 is less than 0.0"
    assert refused(parse, "nan") == "nan is less than 0.0"
    assert parse.__name__ == "number >= 0.0"


def test_float_in():
    parse = v.float_in(0.0, 1.0)
    assert parse("0") == 0.0 and parse("1") == 1.0 and parse("0.25") == 0.25
    assert refused(parse, "1.01") == "1.01 is more than 1.0"
    assert refused(parse, "-1") == "-1.0 is less than 0.0"
    assert refused(parse, "nan") == "nan is less than 0.0"
    assert refused(parse, "half") == "'half' is not a number"
    assert parse.__name__ == "number in [0.0, 1.0]"


# -- texts checked against other modules ------------------------------------


def test_length_spec_keeps_the_stripped_text():
    assert v.length_spec(" fixed:5 ") == "fixed:5"
    assert v.length_spec("uniform:1:10") == "uniform:1:10"
    assert "the kind must be one of" in refused(v.length_spec, "gauss:1")
    assert "parameters must be numbers" in refused(v.length_spec, "fixed:x")


def test_token_source(tmp_path):
    assert v.token_source("random") == "random" and v.token_source(" echo ") == "echo"
    good = tmp_path / "ids.txt"
    good.write_text("1 2 3\n")
    assert v.token_source(f"file:{good}") == f"file:{good}"
    bad = tmp_path / "bad.txt"
    bad.write_text("1 two")
    message = refused(v.token_source, f"file:{bad}")
    assert message.startswith(f"'file:{bad}': ") and "is not an integer token id" in message
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "holds no token ids" in refused(v.token_source, f"file:{empty}")
    assert "No such file" in refused(v.token_source, f"file:{tmp_path / 'missing'}")
    assert refused(v.token_source, "Random") == "'Random' is not random, echo, text or file:PATH"


def test_id_range():
    bounds = v.id_range("0:100")
    assert (bounds.low, bounds.high) == (0, 100) and str(bounds) == "0:100"
    assert v.id_range("5:6") == v.IdRange(5, 6)
    for text in ("5", "5:5", "6:5", "-1:5", "a:b", "1:2:3", ":3", ""):
        assert refused(v.id_range, text) == f"{text!r} is not LOW:HIGH with 0 <= LOW < HIGH"


@pytest.mark.parametrize(
    "text",
    ["tcp://127.0.0.1:5555", "tcp://*:1", "tcp://host-name.example_1:65535", "tcp://[::1]:8000", "ipc:///tmp/x", "ipc://rel"],
)
def test_zmq_address_accepts(text):
    assert v.zmq_address(f" {text} ") == text


def test_zmq_address_refuses():
    assert refused(v.zmq_address, "ipc://") == "'ipc://' has no path after ipc://"
    for text in ("tcp://host", "http://h:1", "tcp://:80", "tcp://h:123456", "tcp://h h:1", "localhost:5555"):
        assert refused(v.zmq_address, text) == f"{text!r} is not tcp://host:port or ipc:///path"
    assert refused(v.zmq_address, "tcp://h:0") == "'tcp://h:0' has port 0, not in 1..65535"
    assert refused(v.zmq_address, "tcp://h:65536") == "'tcp://h:65536' has port 65536, not in 1..65535"


def test_task_list():
    assert v.task_list("generate") == ("generate",)
    assert v.task_list(" generate , embed ,,") == ("generate", "embed")
    for text in ("", " , ,"):
        assert refused(v.task_list, text) == "needs at least one task, e.g. generate"


def test_fault():
    parse = v.fault("slow-steps")
    assert parse.__name__ == "fault spec"
    assert parse("factor=3 duration=2 at=5") is not None
    assert refused(parse, "factor=3") == "slow-steps needs exactly one trigger of rate=P, every=N or at=T (got 0)"
    assert refused(parse, "factor") == "'factor' is not key=value"
    assert refused(parse, "factor=2 factor=3") == "factor= given twice"


def test_kv_events_config():
    assert v.kv_events_config.__name__ == "KV events config"
    config = v.kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    assert config is not None
    assert refused(v.kv_events_config, "{").startswith("not JSON (")
    assert refused(v.kv_events_config, '{"nope": 1}').startswith("unknown key 'nope'; known: ")
    assert refused(v.kv_events_config, "[]").startswith("not a JSON object")


def test_choice_folds_and_lists_the_choices():
    parse = v.choice(("fcfs", "priority"))
    assert parse(" FCFS ") == "fcfs" and parse("priority") == "priority"
    assert refused(parse, "lifo") == "'lifo' is not one of fcfs, priority"
    assert parse.__name__ == "choice"
    exact = v.choice(("A", "b"), fold=str.strip)
    assert exact(" A ") == "A"
    assert refused(exact, "a") == "'a' is not one of A, b"


def test_kv_transfer_config_prefixes_the_text():
    assert v.kv_transfer_config.__name__ == "JSON"
    message = refused(v.kv_transfer_config, "{")
    assert message.startswith("'{': ")


def test_protocol_version():
    assert v.protocol_version(" AUTO ") == "auto"
    layout_for_version("0.11")  # a known one
    assert v.protocol_version("0.11") == "0.11"
    message = refused(v.protocol_version, "99.0")
    assert "has no wire layout here" in message and message.endswith("; or auto")


def test_nonempty():
    assert v.nonempty("  x ") == "x"
    for text in ("", "   "):
        assert refused(v.nonempty, text) == "must not be empty"
