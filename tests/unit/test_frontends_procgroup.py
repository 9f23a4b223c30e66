"""tools/frontends.py (install paths, checks and failures, the frontends' command
lines) and tools/procgroup.py (process groups that leave nothing behind), without
the real frontends: the installs that download are exercised by tests/e2e."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gmock_engine.tools import frontends, procgroup


# -- frontends.py ------------------------------------------------------------------


def test_home_from_env_xdg_or_default(tmp_path):
    assert frontends.frontends_home({"GMOCK_FRONTENDS_HOME": str(tmp_path)}) == tmp_path
    assert frontends.frontends_home({"XDG_CACHE_HOME": "/x"}) == frontends.Path("/x/gmock-frontends")
    assert str(frontends.frontends_home({})).endswith("/.cache/gmock-frontends")


def _fake_install(home):
    """What a finished install leaves: the venv's mark and python, the binary."""
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "python").write_text("")
    (home / "venv" / ".gmock-frontends-ok").write_text(frontends.PYTHON_VERSION + "\n")
    (home / "bin").mkdir()
    binary = home / "bin" / f"vllm-rs-{frontends.RUST_VERSION}"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)


def test_a_finished_install_is_found_without_running_anything(tmp_path, monkeypatch):
    assert not frontends.python_installed(tmp_path) and not frontends.rust_installed(tmp_path)
    _fake_install(tmp_path)
    monkeypatch.setattr(frontends.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    fe = frontends.install(tmp_path)
    assert fe == frontends.Frontends(tmp_path / "venv", tmp_path / "bin" / "vllm-rs-0.33.0")
    assert fe.python == tmp_path / "venv" / "bin" / "python"
    assert not frontends.python_installed(tmp_path, "0.31.0")  # another version: not this install


def test_the_install_script_prints_the_paths(tmp_path):
    _fake_install(tmp_path)
    script = os.path.join(os.path.dirname(__file__), "..", "e2e", "install_frontends.sh")
    out = subprocess.run(["bash", script], env={**os.environ, "GMOCK_FRONTENDS_HOME": str(tmp_path), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"VLLM_VENV={tmp_path}/venv", f"VLLM_RS_0_33_0={tmp_path}/bin/vllm-rs-0.33.0",
                                       f"VLLM_RS={tmp_path}/bin/vllm-rs-0.33.0"]  # fmt: skip


def test_a_failed_download_names_the_step_and_how_to_retry(tmp_path, monkeypatch):
    monkeypatch.setattr(frontends, "_pip_python", lambda home: "/bin/false")
    said = []
    with pytest.raises(frontends.InstallError) as info:
        frontends.install_rust(tmp_path, say=said.append)
    text = str(info.value)
    assert "pip download vllm==0.33.0" in text and "failed (status 1)" in text and "run the same command again" in text
    assert said and "Rust frontend" in said[0] and "340 MB" in said[0]  # said before it started
    assert not frontends.rust_installed(tmp_path)
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == []  # no half-written binary


def test_the_python_install_refuses_a_full_disk_before_starting(tmp_path, monkeypatch):
    monkeypatch.setattr(frontends.shutil, "disk_usage", lambda path: type("U", (), {"free": 10**9})())
    with pytest.raises(frontends.InstallError, match=r"needs about 3.5 GB .* has only 1.0 GB free.*GMOCK_FRONTENDS_HOME"):
        frontends.install_python(tmp_path, say=lambda line: None)
    assert not (tmp_path / "venv").exists()


def test_frontend_command_lines_are_external_engine_mode(tmp_path):
    fe = frontends.Frontends(tmp_path / "venv", tmp_path / "vllm-rs")
    common = dict(served_model_name="m", host="127.0.0.1", port=8000, handshake_port=29550, dp=4)
    rust = frontends.frontend_argv("rust", fe, tmp_path / "model", **common)
    assert rust[:3] == [str(tmp_path / "vllm-rs"), "serve", str(tmp_path / "model")]
    assert " --data-parallel-size 4 --data-parallel-size-local 0 --handshake-port 29550" in " ".join(rust)
    python = frontends.frontend_argv("python", fe, tmp_path / "model", api_servers=2, **common)
    assert python[:3] == [str(fe.python), str(frontends.VLLM_CLI), "serve"]
    assert "--data-parallel-rpc-port 29550 --api-server-count 2" in " ".join(python)
    assert frontends.VLLM_CLI.exists()
    with pytest.raises(ValueError):
        frontends.frontend_argv("go", fe, tmp_path, **common)


def test_frontend_env_is_offline_and_drops_vllm_variables():
    env = frontends.frontend_env({"VLLM_FOO": "1", "PATH": "/bin"})
    assert "VLLM_FOO" not in env and env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1"


# -- procgroup.py ------------------------------------------------------------------


def test_a_group_and_its_children_stop_on_sigterm(tmp_path):
    g = procgroup.ProcessGroup("two-sleeps", ["sh", "-c", "sleep 30 & sleep 30"], tmp_path / "log", env=dict(os.environ))
    time.sleep(0.3)
    assert len(g.members()) >= 2
    assert procgroup.stop_groups([g], term_timeout=5) == []
    assert g.gone() and procgroup.group_members(g.pgid) == []
    assert (tmp_path / "log").read_text().startswith("$ sh -c ")


def test_a_group_that_ignores_sigterm_is_killed_and_reported(tmp_path):
    g = procgroup.ProcessGroup("stubborn", ["sh", "-c", "trap '' TERM; sleep 30 & wait"], tmp_path / "log", env=dict(os.environ))
    time.sleep(0.3)
    problems = procgroup.stop_groups([g], term_timeout=0.5, repeat_every=0.2)
    assert len(problems) == 1 and "sent SIGKILL" in problems[0]
    assert g.gone()


def test_a_child_dies_with_its_parent(tmp_path):
    # the parent (like `serve`) is SIGKILLed: its child still gets SIGTERM (PR_SET_PDEATHSIG)
    code = ("import os, sys, time; from gmock_engine.tools.procgroup import ProcessGroup; "
            f"g = ProcessGroup('c', ['sleep', '30'], {str(tmp_path / 'log')!r}, env=dict(os.environ), die_with_parent=True); "
            "print(g.pgid, flush=True); time.sleep(30)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while child in procgroup.group_members(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procgroup.group_members(child) == []


def test_ports_and_the_listen_check():
    a, b = procgroup.free_ports(2)
    assert a != b and not procgroup.is_listening(a)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", a))
        assert not procgroup.is_listening(a)  # bound is not listening
        s.listen(1)
        assert procgroup.is_listening(a)


def test_free_ports_stay_out_of_the_ephemeral_range():
    # a port there, once released, can go to anything binding port 0 first
    low, high = procgroup.ephemeral_range()
    ports = procgroup.free_ports(20)
    assert len(set(ports)) == 20
    assert all(not low <= p <= high and p >= 10000 for p in ports), ports
