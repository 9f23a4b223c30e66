"""A minimal P/D proxy for the e2e tests, modelled on vLLM's own
(`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, the
disaggregated-serving example): the standard two-step dance.

1. The client's body goes to the prefill server with `max_tokens=1`,
   `stream=false` and `kv_transfer_params = {"do_remote_decode": true, ...}`
   (the other keys null, as vLLM's proxy sends them); `min_tokens` and
   `stream_options` are left out there.
2. The `kv_transfer_params` of that response go, unchanged, into the
   original body, which is sent to the decode server; its response (a
   stream or not) is passed through to the client as it comes.

Plain standard library + `requests`, one thread per client connection.
`exchanges` keeps what each request's two legs carried, for the tests.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List

import requests

#: The prefill leg's kv_transfer_params, as vLLM's proxy sends them.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PDProxy:
    """The proxy on 127.0.0.1:`port` in a daemon thread, in front of one
    prefill and one decode frontend (base URLs without /v1)."""

    def __init__(self, prefill_url: str, decode_url: str, port: int = 0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        #: per request: {"path", "prefill_status", "kv_transfer_params" (from P), "decode_status"}
        self.exchanges: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                proxy._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="pd-proxy", daemon=True)

    def __enter__(self) -> "PDProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))) or b"{}")
        path = handler.path
        exchange: Dict[str, Any] = {"path": path}
        with self._lock:
            self.exchanges.append(exchange)
        # step 1: prefill, one token, no stream
        prefill = {k: v for k, v in body.items() if k not in ("min_tokens", "min_completion_tokens", "stream_options")}
        prefill.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        first = requests.post(self.prefill_url + path, json=prefill, timeout=120)
        exchange["prefill_status"] = first.status_code
        if first.status_code != 200:
            self._reply(handler, first.status_code, first.content, first.headers.get("content-type", "application/json"))
            return
        params = first.json().get("kv_transfer_params")
        exchange["kv_transfer_params"] = params
        # step 2: the original request with P's params, to decode; passed through as it comes
        decode = dict(body)
        if params:
            decode["kv_transfer_params"] = params
        with requests.post(self.decode_url + path, json=decode, stream=True, timeout=120) as second:
            exchange["decode_status"] = second.status_code
            handler.send_response(second.status_code)
            handler.send_header("Content-Type", second.headers.get("content-type", "application/json"))
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            for chunk in second.iter_content(chunk_size=None):
                if chunk:
                    handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, content: bytes, content_type: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)


def main() -> None:
    """`python tests/e2e/pd_proxy.py --prefill URL --decode URL [--port N]`:
    the proxy in the foreground, for trying a P/D pair by hand."""
    import argparse
    import signal
    import sys
    import time

    parser = argparse.ArgumentParser(description="minimal two-step P/D proxy (vLLM's toy_proxy_server, reduced)")
    parser.add_argument("--prefill", required=True, help="base URL of the prefill frontend, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="base URL of the decode frontend, e.g. http://127.0.0.1:8200")
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 to serve /v1/chat/completions and /v1/completions")
    args = parser.parse_args()
    # SIGTERM stops it as Ctrl-C does (a background job started by a script ignores SIGINT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with PDProxy(args.prefill, args.decode, args.port) as proxy:
        print(f"P/D proxy on {proxy.url}/v1: prefill {proxy.prefill_url}, decode {proxy.decode_url}; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except (KeyboardInterrupt, SystemExit):
            pass


if __name__ == "__main__":
    main()
