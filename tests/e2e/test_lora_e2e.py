"""LoRA adapters through the real frontends (docs/lora.md).

Each frontend starts with a static adapter (`--lora-modules sql=DIR`, plus
`--enable-lora` for `vllm serve`) and runtime updates allowed; the engine runs
with `--enable-lora --max-loras 1 --max-cpu-loras 2`. DIR is the smallest
adapter directory the stack accepts: the frontends read nothing from it (the
Python frontend passes the path to the engine's add_lora, vllm-rs only checks
that a runtime path exists under VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES), and
the engine reads `adapter_config.json` as vLLM's worker does (r, lora_alpha,
target_modules; no weights).

Proved here: the static adapter is listed and served, and requests naming it
reach the engine as that adapter (the engine log counts them per adapter); a
runtime `/v1/load_lora_adapter` loads through the engine's add_lora, and a
path without an adapter is refused with the engine's (vLLM's) message, and
one whose adapter_config.json has a field of the wrong type with the
engine's; with one GPU slot a second adapter's request waits while the first
runs, and the frontend's `vllm:lora_requests_info` shows it waiting.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import requests

import e2e_harness as h

ENGINE_ARGS = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--itl-ms", "20"]
LONG_TOKENS = 150  # 3 s at 20 ms a step: long enough to be seen running

pytestmark = pytest.mark.e2e


def write_adapter(path: Path) -> str:
    """The smallest adapter directory: adapter_config.json with PEFT's required keys."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    return str(path)


class LoRAStack(h.Stack):
    """A DP 1 stack whose frontend gets LoRA flags after the harness's own."""

    def __init__(self, *args, frontend_extra: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.frontend_extra = frontend_extra

    def frontend_argv(self) -> list[str]:
        return super().frontend_argv() + self.frontend_extra


@pytest.fixture(scope="module", params=["python", "rust"], ids=["py-dp1-api1", "rs-dp1"])
def stack(request, frontends, model_dir, tmp_path_factory):
    adapters = tmp_path_factory.mktemp("adapters")
    sql = write_adapter(adapters / "sql")
    write_adapter(adapters / "dyn")
    if request.param == "python":
        extra = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--lora-modules", f"sql={sql}"]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    else:
        # vllm-rs has no --enable-lora: the engines' supports_lora decides
        extra = ["--lora-modules", f"sql={sql}"]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES": str(adapters)}
    s = LoRAStack(h.Topology(request.param, dp=1), frontends, model_dir, tmp_path_factory.mktemp(f"lora-{request.param}"),
                  engine_args=ENGINE_ARGS, frontend_env_extra=env, frontend_extra=extra)
    s.adapters = adapters
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        if problems:
            pytest.fail(f"teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


def complete(stack, model: str, max_tokens: int) -> dict:
    resp = stack.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True})
    assert resp.status_code == 200, resp.text[:500]
    return resp.json()


def test_static_adapter_is_listed_and_served(stack):
    models = {m["id"]: m for m in requests.get(stack.url("/v1/models"), timeout=10).json()["data"]}
    assert models["sql"]["parent"] == h.MODEL_NAME
    offset = stack.engine_log_size()
    for _ in range(3):
        body = complete(stack, "sql", 5)
        assert body["model"] == "sql" and body["usage"]["completion_tokens"] == 5
    h.wait_until(lambda: stack.engine_log_since(offset).count(" lora=sql") == 3, 15, "3 sql requests in the engine log")
    assert "lora=" not in stack.engine_log_since(offset).replace(" lora=sql", "")


def test_runtime_load_goes_through_the_engine(stack):
    resp = stack.post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(stack.adapters / "dyn")})
    assert resp.status_code == 200, resp.text[:500]
    assert complete(stack, "dyn", 4)["usage"]["completion_tokens"] == 4
    # a directory without adapter_config.json: the engine's add_lora fails with
    # vLLM's LoRAAdapterNotFoundError text, which the Python frontend turns into 404
    (stack.adapters / "empty").mkdir()
    resp = stack.post("/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": str(stack.adapters / "empty")})
    assert resp.status_code in (400, 404, 500), resp.text[:500]
    if stack.topology.frontend == "python":
        assert resp.status_code == 404 and "No adapter found" in resp.json()["error"]["message"], resp.text[:500]
    else:
        # vllm-rs: 500 with the engine's failure message
        assert resp.status_code == 500 and "No adapter found" in resp.text, resp.text[:500]
    # a config of the wrong type: both frontends answer 500 with the engine's message
    (stack.adapters / "bad").mkdir()
    (stack.adapters / "bad" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": 5}))
    resp = stack.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(stack.adapters / "bad")})
    assert resp.status_code == 500 and "`target_modules` must be a list of strings or a string" in resp.text, resp.text[:500]
    models = {m["id"] for m in requests.get(stack.url("/v1/models"), timeout=10).json()["data"]}
    assert "dyn" in models and "empty" not in models and "bad" not in models


def newest_lora_info(text: str) -> tuple[set, set]:
    """running and waiting adapters of the newest vllm:lora_requests_info sample
    (the gauge is set to the time on every stats update, one series per label set)."""
    best, best_t = (set(), set()), -1.0
    for labels, value in h.metric_samples(text, "vllm:lora_requests_info"):
        if value > best_t:
            running = re.search(r'running_lora_adapters="([^"]*)"', labels).group(1)
            waiting = re.search(r'waiting_lora_adapters="([^"]*)"', labels).group(1)
            best, best_t = ({a for a in running.split(",") if a}, {a for a in waiting.split(",") if a}), value
    return best


def test_one_gpu_slot_makes_the_second_adapter_wait(stack):
    if "dyn" not in {m["id"] for m in requests.get(stack.url("/v1/models"), timeout=10).json()["data"]}:
        stack.post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(stack.adapters / "dyn")})
    results: dict[str, dict] = {}

    def run(name: str, model: str) -> None:
        results[name] = complete(stack, model, LONG_TOKENS)

    threads = [threading.Thread(target=run, args=(f"sql-{i}", "sql")) for i in range(2)]
    for t in threads:
        t.start()
    h.wait_until(lambda: "sql" in newest_lora_info(stack.metrics())[0], 15, "sql to show as running", interval=0.1)
    late = threading.Thread(target=run, args=("dyn", "dyn"))
    late.start()
    threads.append(late)
    seen: list = []

    def dyn_waits_behind_sql() -> bool:
        running, waiting = newest_lora_info(stack.metrics())
        seen.append((sorted(running), sorted(waiting)))
        return "sql" in running and "dyn" not in running and "dyn" in waiting

    h.wait_until(dyn_waits_behind_sql, 15, "dyn waiting while sql runs (--max-loras 1)", interval=0.1)
    for t in threads:
        t.join(60)
    assert sorted(results) == ["dyn", "sql-0", "sql-1"]
    assert all(r["usage"]["completion_tokens"] == LONG_TOKENS for r in results.values())
    # dyn ran, alone, after both sql requests (one slot): never seen running with sql
    assert not any("dyn" in running and "sql" in running for running, _ in seen), seen


def test_unload_removes_the_adapter_from_the_frontend(stack):
    offset = stack.engine_log_size()
    resp = stack.post("/v1/unload_lora_adapter", {"lora_name": "dyn"})
    assert resp.status_code == 200, resp.text[:500]
    resp = stack.post("/v1/completions", {"model": "dyn", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 404, resp.text[:500]
    if stack.topology.frontend == "rust":
        # vllm-rs calls remove_lora on every engine; vllm serve 0.32 only forgets
        # the name (serving.py unload_lora_adapter), the engine keeps it cached
        h.wait_until(lambda: "LoRA adapter id 2 removed: True" in stack.engine_log_since(offset), 15, "remove_lora in the engine log")
    else:
        assert "removed" not in stack.engine_log_since(offset)
