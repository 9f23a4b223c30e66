"""Every engine option, declared once, in reading order and in groups.

Each `Option` carries what the parser needs (flag, value type, default,
help) and what the rest of the package asks of it: `reload`, when a live
reconfiguration (SIGHUP, reload.py) applies it, None when it is fixed while
the process runs; `setting`, the EngineSettings field it feeds when a reload
hands it to each engine (engine.RELOADABLE_SETTINGS). config.build_parser
adds the groups to the parser in this order: --help, --print-config,
conf/all-options.ini and docs/configuration.md list the options so, and
docs/configuration.md's option tables follow it (generated from the parsers;
a unit test keeps the page current).

Pure: neither gevent nor zmq, nor configargparse (the groups are added to
any argparse parser).
"""

from __future__ import annotations

from typing import Callable, FrozenSet, Optional, Tuple

from gmock_engine.config.option import AT_ONCE, FAULT_LAYER, NEW_REQUESTS, NEXT_STEP, Group, Option
from gmock_engine.wire.eras import AUTO
from gmock_engine.faults.specs import KINDS
from gmock_engine.config.validators import (
    choice,
    fault,
    float_at_least,
    float_in,
    rate_list,
    id_range,
    int_at_least,
    kv_events_config,
    kv_transfer_config,
    latency_profile,
    length_spec,
    protocol_version,
    replay_trace,
    task_list,
    token_source,
    tokenizer_path,
    zmq_address,
)

DTYPES = ("float16", "bfloat16", "float32")
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")

# -- the declarations ---------------------------------------------------------------

GENERAL = Group(
    None,
    (
        Option(
            "--print-config",
            "print every option's value and where it came from, then exit",
            default=False,
            boolean=True,
        ),
    ),
)

CONNECTION = Group(
    "frontend connection",
    (
        Option(
            "--handshake-address",
            "the frontend's handshake ROUTER (vllm serve --data-parallel-address/--data-parallel-rpc-port; vllm-rs --handshake-port)",
            default="tcp://127.0.0.1:29550",
            type=zmq_address,
        ),
        Option("--engine-count", "engines (DP ranks) run by this process", default=1, type=int_at_least(1)),
        Option(
            "--processes",
            "worker processes the engines are spread over (gevent runs on one core; "
            "more processes use more cores), supervised by this one",
            default=1,
            type=int_at_least(1),
        ),
        Option(
            "--data-parallel-start-rank",
            "rank of the first engine; engines get ranks start..start+count-1 (several mock hosts)",
            default=0,
            type=int_at_least(0),
        ),
        Option(
            "--data-parallel-size",
            "DP size reported in the ready response (default: start rank + engine count)",
            type=int_at_least(1),
        ),
        Option(
            "--parallel-config-hash",
            "parallel_config_hash sent in READY; only the Python frontend with an MoE model and DP > 1 "
            "needs it (it prints the expected value on mismatch, docs/protocol.md §2.7)",
        ),
        Option(
            "--protocol-version",
            "the frontend's vLLM version (0.11 to 0.33, e.g. 0.25, 0.25.1, 0.28.0): the wire layout of its era; "
            "auto (default) detects the era from the first request and logs what it found (docs/protocol.md §8)",
            default=AUTO,
            type=protocol_version,
        ),
        Option(
            "--frontend-heartbeat",
            "ZMTP heartbeat interval toward the frontend, seconds (default 0: off): a connection that answers "
            "none of the PINGs for 3 intervals is ended, so a cut link is noticed and logged. Only for a "
            "frontend on libzmq (vllm serve): vllm-rs's ZMQ does not know PING, and its output dispatcher fails at "
            "the first one (every request then gets 500). A reconnect may not resume serving (docs/operations.md, "
            "The frontend watch)",
            default=0.0,
            type=float_in(0.0, 600.0),
        ),
    ),
)

GENERATION = Group(
    "generation",
    (
        Option(
            "--output-token-chunk-size",
            "token ids per EngineCoreOutput and step (> 1 mimics MTP / speculative decoding)",
            default=1,
            type=int_at_least(1),
        ),
        Option(
            "--spec-tokens",
            "speculative decoding: K draft tokens verified per decoding request and step, which then emits 1 + the "
            "accepted ones and SchedulerStats carry spec_decoding_stats (0: off; not with --output-token-chunk-size > 1)",
            default=0,
            type=int_at_least(0, 64),
        ),
        Option(
            "--spec-acceptance",
            "--spec-tokens' acceptance rate per draft position, e.g. 0.8,0.6,0.4 (K rates), or one for every "
            "position; draft i is accepted only if every earlier one was (per request: vllm_xargs mock_spec_acceptance, "
            "one rate for every position)",
            default=(0.7,),
            type=rate_list,
            metavar="RATES",
            reload=NEXT_STEP,
            setting="spec_acceptance",
        ),
        Option(
            "--vocab-size",
            "token ids are drawn from [0, vocab-size) (at most 2**32)",
            default=32000,
            type=int_at_least(1, 1 << 32),  # ids must fit the frontends' u32 token type
        ),
        Option(
            "--tokenizer",
            "the served model's tokenizer: its model directory or tokenizer.json, for content a client parses "
            "(needs the optional extra: pip install 'gmock-engine[content]'); sets --vocab-size unless given",
            type=tokenizer_path,
            metavar="PATH",
        ),
        Option("--seed", "base seed; each request's tokens depend on (seed, rank, request id)", default=0, type=int_at_least(0)),
        Option(
            "--tool-call-rate",
            "share of requests whose prompt holds tools (tool_choice auto) answered with a hermes tool call "
            "(needs --tokenizer; per request: vllm_xargs mock_tool_call)",
            default=0.5,
            type=float_in(0.0, 1.0),
        ),
        Option(
            "--reasoning-rate",
            "above 0: a thinking model (Qwen3's format, for --reasoning-parser qwen3): every answer starts with a "
            "<think> block, this share with --reasoning-tokens ids in it, the others empty; none where the prompt "
            "closed one (enable_thinking false) (needs --tokenizer; per request: vllm_xargs mock_reasoning_tokens)",
            default=0.0,
            type=float_in(0.0, 1.0),
        ),
        Option("--reasoning-tokens", "ids in a reasoning span (between <think> and </think>)", default=64, type=int_at_least(1)),
        Option("--grammar-max-tokens", "most tokens generated for one structured answer; a longer one ends its request with "
               "an error naming this limit (docs/structured-outputs.md)", default=4096, type=int_at_least(1)),
        Option("--grammar-max-rules", "most rules in a request's Lark or GBNF grammar (deeper ones crash the grammar "
               "backend); more: the request ends with an error naming this limit", default=2000, type=int_at_least(1)),
        Option("--grammar-max-depth", "most schema nodes on one path of a request's JSON schema, its $refs followed (deeper "
               "ones crash the grammar backend); more: the request ends with an error naming this limit", default=500,
               type=int_at_least(1)),
        Option("--grammar-max-items", "the grammar backend's alternatives per parser row (llguidance max_items_in_row: a "
               "choice of more items); more: the request ends with an error naming this limit", default=10000,
               type=int_at_least(1)),
        Option("--grammar-timeout-ms", "the most a request with a structured-output constraint (or a tool call) waits for "
               "its grammar to compile and its answer to be made, off the engine's loop; past it the request ends with "
               "ERROR naming this option (0: no limit)", default=30000.0, type=float_at_least(0.0)),
        Option(
            "--token-source",
            "random (uniform ids from a pool of 65536 drawn per seed, each request from its seeded offset), "
            "echo (the prompt's ids, repeated), text (English sentences in a seeded order, encoded with --tokenizer, "
            "which it needs: text that reads like text) or file:PATH (whitespace-separated ids, cycled)",
            default="random",
            type=token_source,
            reload=NEW_REQUESTS,
            setting="token_source",
        ),
        Option(
            "--token-id-range",
            "random ids from [LOW, HIGH) only, e.g. ids your tokenizer decodes to clean text (default [0, vocab-size))",
            type=id_range,
            metavar="LOW:HIGH",
            reload=NEW_REQUESTS,
            setting="token_source",
        ),
        Option(
            "--supported-tasks",
            "comma-separated answer to get_supported_tasks; a pooling task among them (embed, classify, token_embed, "
            "token_classify; score, encode for old frontends) is served to ADDs with pooling_params",
            default=("generate",),
            type=task_list,
        ),
        Option(
            "--embedding-dim",
            "size of an embed / token_embed pooling_output (0: hidden_size in the --tokenizer dir's config.json, else 64)",
            default=0,
            type=int_at_least(0, 65536),
        ),
        Option("--num-labels", "size of a classify / token_classify pooling_output", default=2, type=int_at_least(1, 65536)),
        Option(
            "--logprobs-top1",
            "synthetic logprobs: mean probability of each position's top-1 token (higher: a more peaked distribution)",
            default=0.6,
            type=float_in(0.01, 0.99),
            reload=NEW_REQUESTS,
            setting="logprobs_top1",
        ),
        Option(
            "--logprobs-sampled-top1",
            "synthetic logprobs: share of sampled tokens that are their position's top-1 (the rest rank lower)",
            default=0.75,
            type=float_in(0.0, 1.0),
            reload=NEW_REQUESTS,
            setting="logprobs_sampled_top1",
        ),
    ),
)


def _latency(flag: str, help: str, default: float = 0.0, type: Callable[[str], float] = float_at_least(0.0)) -> Option:
    """An option of the latency model (timing/latency.py): reloads from the next step."""
    return Option(flag, help, default=default, type=type, reload=NEXT_STEP, setting="latency")


LATENCY = Group(
    "latency model (all off by default: steps back to back, instant prefill)",
    (
        _latency("--itl-ms", "decode step time in ms (inter-token latency); 0 with the others 0: steps as fast as the CPU allows"),
        _latency("--itl-ms-per-request", "extra step time per running request, ms (the batch slows down as it grows)"),
        _latency("--ttft-ms", "fixed part of the time from scheduling to a request's first token, ms (does not hold the batch back)"),
        _latency(
            "--prefill-ms-per-token",
            "prefill cost per prompt token, ms: delays the first token and lengthens the step that prefills",
        ),
        _latency(
            "--encoder-ms-per-token",
            "vision encoder cost per image token (the positions an image's encoder output fills), ms: lengthens "
            "the step that prefills the image's placeholder unless the encoder cache holds it",
        ),
        _latency(
            "--jitter",
            "each step time and fixed TTFT is scaled by a factor from [1-jitter, 1+jitter] (seeded by --seed)",
            type=float_in(0.0, 1.0),
        ),
        _latency("--time-scale", "multiplies every duration of the latency model (0.5 = twice as fast)", default=1.0),
        Option(
            "--latency-profile",
            "a step-time profile fitted from a real engine's trace (./run.sh fit; docs/latency-profile.md): it times "
            "every step from what is in it, instead of --itl-ms, --itl-ms-per-request and --prefill-ms-per-token; "
            "re-read on every reload",
            default=None,
            type=latency_profile,
            metavar="FILE",
            reload=NEXT_STEP,
            setting="latency",
        ),
    ),
)

ENDINGS = Group(
    "how requests end (default: by max_tokens only, as the Rust mock)",
    (
        Option(
            "--output-len-dist",
            "tokens until EOS per request: fixed:N, uniform:MIN:MAX, normal:MEAN:STD or exponential:MEAN; "
            "shorter than max_tokens ends with finish_reason stop (min_tokens and ignore_eos are honoured)",
            type=length_spec,
            reload=NEW_REQUESTS,
            setting="output_lengths",
        ),
        Option(
            "--eos-probability",
            "chance that each token is EOS (instead of --output-len-dist); 0: never",
            default=0.0,
            type=float_in(0.0, 1.0),
            reload=NEW_REQUESTS,
            setting="output_lengths",
        ),
    ),
)

REPLAY = Group(
    "replay of a recorded run (docs/record.md, Replay)",
    (
        Option(
            "--replay",
            "a trace of ./run.sh record: each request the trace covers gets its recorded outputs (token ids if "
            "recorded, else the token source's; the recorded counts, finish and stop_reason), none before its "
            "recorded time from its arrival; the client's max_tokens still caps it; other requests as configured",
            type=replay_trace,
            metavar="TRACE",
        ),
        Option(
            "--replay-match",
            "which recorded request an ADD replays: arrival (the k-th ADD the k-th recorded one; per rank when the "
            "trace has as many ranks as the deployment) or id (the recorded request of the same request id)",
            default="arrival",
            type=choice(("arrival", "id")),
        ),
    ),
)

SCHEDULER = Group(
    "scheduler",
    (
        Option(
            "--async-scheduling",
            "schedule a step ahead, as vLLM's async scheduling (its default on GPUs): a request that arrives "
            "while the engine is busy joins the step after the next, so its first token comes a step later",
            default=False,
            boolean=True,
        ),
        Option(
            "--prefix-caching",
            "cache prompt blocks (block hashes, LRU over --num-gpu-blocks): a repeated prefix is not prefilled "
            "again; hits show in the frontends' prefix-cache metrics",
            default=False,
            boolean=True,
        ),
        Option(
            "--scheduling-policy",
            "order of the waiting queue: arrival, or the request's priority (lower first) then arrival",
            default="fcfs",
            type=choice(("fcfs", "priority")),
        ),
    ),
)

# vLLM's LoRAConfig flags with its defaults (vllm/config/lora.py); lora.py serves them
LORA = Group(
    "LoRA adapters (vLLM's --enable-lora, --max-loras, --max-cpu-loras, --max-lora-rank)",
    (
        Option(
            "--enable-lora",
            "serve LoRA adapters: supports_lora and max_loras in the ready response, the add_lora/remove_lora/pin_lora/"
            "list_loras utilities, ADDs naming an adapter; off: those ADDs end with ERROR and add_lora fails, as in vLLM",
            default=False,
            boolean=True,
        ),
        Option(
            "--max-loras",
            "adapters in one batch (GPU slots): a request whose adapter would be one more waits",
            default=1,
            type=int_at_least(1, 1 << 20),
        ),
        Option(
            "--max-cpu-loras",
            "adapters registered (CPU cache, LRU; pinned ones stay); default: --max-loras; must be >= --max-loras",
            type=int_at_least(1, 1 << 20),
        ),
        Option(
            "--max-lora-rank",
            "largest adapter rank (adapter_config.json r) accepted when adapter directories are checked",
            default=16,
            type=int_at_least(1, 1 << 20),
        ),
        Option(
            "--lora-check-adapter-dir",
            "load an adapter as vLLM's worker reads it: PATH/adapter_config.json with r, lora_alpha, target_modules "
            "(no weights read); off: any path is accepted",
            default=True,
            boolean=True,
        ),
        _latency(
            "--lora-load-ms",
            "latency model: ms added to the first token of a request whose scheduling loaded its adapter "
            "(not registered, or evicted since)",
        ),
    ),
)

KV_EVENTS = Group(
    "KV-cache events for cache-aware routers (docs/protocol.md Appendix D)",
    (
        Option(
            "--kv-events-config",
            "vLLM's KV events config, e.g. {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
            "\"replay_endpoint\": \"tcp://*:5558\"}: a ZMQ PUB per engine (port + rank) publishing the prefix cache's "
            "BlockStored/BlockRemoved/AllBlocksCleared; needs --prefix-caching",
            type=kv_events_config,
            metavar="JSON",
        ),
    ),
)

DISAGGREGATION = Group(
    "prefill/decode disaggregation (off unless a role is given; docs/pd.md)",
    (
        Option(
            "--kv-role",
            "P/D role: producer ends do_remote_decode requests after their first token with kv_transfer_params "
            "for the decode side; consumer waits the KV transfer time for do_remote_prefill requests instead of "
            "prefilling; both does either (vLLM's kv_both)",
            type=choice(("producer", "consumer", "both")),
        ),
        Option(
            "--kv-transfer-config",
            'vLLM\'s KV transfer config, e.g. \'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\': kv_role '
            "(if --kv-role is not given), engine_id (remote_engine_id), kv_ip/kv_port (remote_host/remote_port; port + "
            "DP rank), kv_load_failure_policy (fail: a failed load ends the request with ERROR; recompute)",
            type=kv_transfer_config,
            metavar="JSON",
        ),
        Option(
            "--kv-transfer-ms-per-token",
            "consumer: KV transfer time per prompt token loaded, ms (its time to first token instead of a prefill)",
            default=0.0,
            type=float_at_least(0.0),
        ),
        Option(
            "--kv-transfer-ms-per-block",
            "consumer: KV transfer time per KV block (--block-size tokens) loaded, ms (adds to the per-token time)",
            default=0.0,
            type=float_at_least(0.0),
        ),
    ),
)

READY = Group(
    "ready response (what the frontend reads at startup, docs/protocol.md §2.5)",
    (
        Option("--max-model-len", "context length; the frontend uses the minimum over engines", default=1048576, type=int_at_least(1)),
        Option(
            "--num-gpu-blocks",
            "KV cache blocks per engine: reported; enforced only when given (a request holds ceil(tokens / block size), "
            "the newest is preempted when they run out)",
            default=65536,
            type=int_at_least(1),
        ),
        Option("--block-size", "KV cache block size in tokens", default=16, type=int_at_least(1)),
        Option("--dtype", "reported model dtype", default="bfloat16", type=choice(DTYPES)),
        Option(
            "--max-num-seqs",
            "max running requests per engine: reported; enforced (the rest wait) only when given",
            default=256,
            type=int_at_least(1),
            reload=NEXT_STEP,
            setting="max_num_seqs",
        ),
        Option(
            "--max-num-batched-tokens",
            "per-step token budget: reported; enforced only when given (decodes first, prompts prefilled in chunks)",
            default=8192,
            type=int_at_least(1),
            reload=NEXT_STEP,
            setting="max_num_batched_tokens",
        ),
        Option(
            "--mm-processor-cache-gb",
            "multimodal receiver cache, GiB: the images (and other items) whose data the frontend's processor cache "
            "strips are served from it; keep it the frontend's --mm-processor-cache-gb (vLLM's default 4), as a "
            "smaller one misses (that request ends with a retryable error; docs/multimodal.md)",
            default=4.0,
            type=float_at_least(0.0),
        ),
        Option(
            "--encoder-cache-size",
            "encoder cache, in encoder tokens: an image whose encoder output it holds costs no --encoder-ms-per-token "
            "again (0: --max-num-batched-tokens, as vLLM sizes it)",
            default=0,
            type=int_at_least(0),
        ),
        Option("--vllm-version", "reported vLLM version string (informational)", default="0.33.0"),
    ),
)

STOPPING = Group(
    "stopping",
    (
        Option(
            "--on-stop",
            "on SIGTERM/SIGINT: exit at once; abort every in-flight request (ABORT outputs, so the "
            "frontend's streams end), then exit; or finish them first (up to --drain-timeout). New requests "
            "are answered with ABORT meanwhile. A second signal exits at once",
            default="exit",
            type=choice(("exit", "abort", "finish")),
            reload=AT_ONCE,
        ),
        Option(
            "--drain-timeout",
            "seconds --on-stop finish waits before aborting the rest",
            default=30.0,
            type=float_at_least(0.0),
            reload=AT_ONCE,
        ),
        Option(
            "--send-dead-on-exit",
            "push ENGINE_CORE_DEAD on every output socket when stopping: the frontends then report the "
            "engine dead instead of waiting for it",
            default=False,
            boolean=True,
            reload=AT_ONCE,
        ),
        Option(
            "--exit-when-frontend-gone",
            "stop cleanly (exit 0, as on SIGTERM) once the frontend has been gone this many seconds: its "
            "sockets disconnected and not back; with several engines, once every joined engine's frontend "
            "is (default, and 0: off; the engine waits for its frontend to come back)",
            type=float_at_least(0.0),
            metavar="SECONDS",
        ),
    ),
)

LOGGING = Group(
    "logging",
    (
        Option("--log-level", "log level", default="INFO", type=choice(LOG_LEVELS, str.upper), reload=AT_ONCE),
        Option("--log-json", "one JSON object per log line", default=False, boolean=True, reload=AT_ONCE),
        Option(
            "--log-requests",
            "log start, finish and abort of every request (as the Rust mock does)",
            default=False,
            boolean=True,
            reload=AT_ONCE,
            setting="log_requests",
        ),
        Option(
            "--metrics-port",
            "serve the mock's own Prometheus metrics on this port (off unless given; 0 = any free port); "
            "with --processes N, worker i uses port + i",
            type=int_at_least(0),
        ),
        Option("--metrics-host", "address the metrics endpoint binds to", default="127.0.0.1"),
        Option(
            "--summary-interval",
            "log one line of every engine's books this often, seconds (0: only at shutdown and on SIGUSR1)",
            default=60.0,
            type=float_at_least(0.0),
            reload=AT_ONCE,
        ),
        Option(
            "--strict-ledger",
            "a request-ledger violation (an output after a request's end, for an unknown id, ...) stops the "
            "process with status 1 instead of only being logged",
            default=False,
            boolean=True,
            reload=AT_ONCE,
            setting="strict_ledger",
        ),
    ),
)

FAULTS = Group(
    "fault injection (off by default; value: one trigger of rate=P, every=N or at=T, "
    "optional ranks=0,2-3 and limit=N, and the kind's own keys; see docs/faults.md)",
    tuple(Option(f"--fault-{kind}", spec.help, type=fault(kind), metavar="SPEC", reload=FAULT_LAYER) for kind, spec in KINDS.items()),
)

#: Every group in the order the parser adds them (GENERAL, untitled, first).
GROUPS: Tuple[Group, ...] = (
    GENERAL,
    CONNECTION,
    GENERATION,
    LATENCY,
    ENDINGS,
    REPLAY,
    SCHEDULER,
    LORA,
    KV_EVENTS,
    DISAGGREGATION,
    READY,
    STOPPING,
    LOGGING,
    FAULTS,
)

#: Every option by dest, in declaration order.
OPTIONS = {option.dest: option for group in GROUPS for option in group.options}


def reloading(when: Optional[str] = None) -> Tuple[str, ...]:
    """The dests of the options a reload applies (`when`: only those applied so)."""
    return tuple(dest for dest, option in OPTIONS.items() if option.reload is not None and when in (None, option.reload))


#: Every option a reload applies; any other option is fixed while the process runs.
RELOADABLE: FrozenSet[str] = frozenset(reloading())

#: The EngineSettings fields a reload may change (engine.RELOADABLE_SETTINGS):
#: those the reloadable options feed, in declaration order.
RELOADABLE_SETTINGS: Tuple[str, ...] = tuple(dict.fromkeys(o.setting for o in OPTIONS.values() if o.setting is not None))
