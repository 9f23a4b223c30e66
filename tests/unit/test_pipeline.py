"""Start-up as a pipeline: argv -> parsed options (config/loader.py, the loader) ->
settings (config/settings.py) -> app. The stages after the loader never import it
(a reload gets the loader bound to the command line from runtime/cli.py,
config.reader), and the loader so bound reads the command line, the
environment and the --config file afresh at each call, as a reload must."""

import subprocess
import sys

import pytest

from gmock_engine.config import reload
from gmock_engine.config.loader import parse_config, reader
from gmock_engine.config.parsed import ConfigError

#: The stages after the loader, and the parsed options' own module.
AFTER_THE_LOADER = ["config.parsed", "config.settings", "config.reload", "runtime.processes", "runtime.app", "runtime.runner"]


@pytest.mark.parametrize("module", AFTER_THE_LOADER)
def test_the_stages_after_the_loader_do_not_import_it(module):
    code = (
        f"import sys, gmock_engine.{module}; "
        "print('gmock_engine.config.loader' in sys.modules); "
        "sys.exit(1 if 'gmock_engine.config.loader' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"gmock_engine.{module} imports the loader (gmock_engine.config.loader) {result.stderr[-500:]}"


def test_the_bound_loader_reads_the_environment_and_the_file_afresh(tmp_path, monkeypatch):
    path = tmp_path / "live.ini"
    path.write_text("[gmock_engine]\nitl-ms = 1\n")
    monkeypatch.delenv("GMOCK_TTFT_MS", raising=False)
    read = reader(["--config", str(path), "--jitter", "0.5"])
    first = read()
    assert (first.itl_ms, first.ttft_ms, first.jitter) == (1.0, 0.0, 0.5)
    path.write_text("[gmock_engine]\nitl-ms = 20\njitter = 0.9\n")
    monkeypatch.setenv("GMOCK_TTFT_MS", "7")
    again = read()
    assert (again.itl_ms, again.ttft_ms, again.jitter) == (20.0, 7.0, 0.5)  # the command line still wins
    assert str(again.sources["ttft_ms"]) == "environment GMOCK_TTFT_MS"
    path.write_text("[gmock_engine]\nitl-ms = -1\n")
    with pytest.raises(ConfigError, match="--itl-ms"):
        read()


def test_a_reload_goes_on_from_the_parsed_options_read_again(tmp_path):
    """reload.compare takes parsed options, wherever they were read;
    reload.check reads them with the reader it is given, and a ConfigError
    of that reading refuses the reload."""
    current = parse_config(["--itl-ms", "1"], env={})
    found = reload.compare(current, parse_config(["--itl-ms", "5", "--vocab-size", "64"], env={}))
    assert [str(c) for c in found.changes] == ["--itl-ms 1 -> 5 (command line)"]
    assert [c.flag for c in found.fixed] == ["--vocab-size"] and found.config.vocab_size == current.vocab_size

    def bad():
        raise ConfigError("argument --itl-ms: bad")

    refused = reload.check(current, bad)
    assert refused.config is None and refused.error == "argument --itl-ms: bad"
