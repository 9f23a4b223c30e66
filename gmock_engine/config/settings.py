"""The typed path from flag to part: the parsed configuration as one frozen
dataclass per part of the engine, built in one place.

The second stage of start-up (argv -> parsed options -> settings -> app,
runtime/cli.py): `from_config(c)` reads the parsed options (parsed.py: of
config.parse_config at start, of a reload's reading, reload.py) once and
returns `Settings`: the latency model, generation, the
scheduler's limits, the KV cache, LoRA, P/D, faults, logging and the
process around the engines, each typed. runtime/cli.py makes them at start
and hands them to the App; the App makes them anew for each reload.
`engine_settings` gives one engine its EngineSettings from those parts (at
the handshake and for a reload: runner.EngineRunner.engine_settings). This
module never calls the loader.

A limit is in effect only when configured: `--max-num-seqs`,
`--max-num-batched-tokens` and `--num-gpu-blocks` from their default are
only reported in READY, so their enforced value here is None (unlimited).

Pure: neither gevent nor zmq.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.content import lengths, pooling, spec_decode, tokens
from gmock_engine.config import options
from gmock_engine.timing import replay
from gmock_engine.content.answer import ContentSettings
from gmock_engine.content.structured_output import GrammarLimits
from gmock_engine.faults.specs import FaultSpec
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.config.parsed import effective
from gmock_engine.content.lengths import OutputLengths
from gmock_engine.content.tokens import TokenSource
from gmock_engine.wire.eras import Wire


@dataclass
class EngineSettings:
    """What one engine needs to know; built by the entry point from the config."""

    rank: int
    num_clients: int
    output_token_chunk_size: int = 1
    vocab_size: int = 32000
    seed: int = 0
    log_requests: bool = False
    supported_tasks: Tuple[str, ...] = ("generate",)
    num_gpu_blocks: int = 65536
    block_size: int = 16
    #: INIT named a DP coordinator: stats also go to it (client index -1, §6.2).
    has_coordinator: bool = False
    #: Running-batch limit; None: unlimited (the default unless configured).
    max_num_seqs: Optional[int] = None
    #: "fcfs", or "priority": lower `priority` first, then arrival (as vLLM).
    scheduling_policy: str = "fcfs"
    #: Admissions decided a step ahead, as vLLM's async scheduling (scheduler.py).
    async_scheduling: bool = False
    latency: LatencyModel = field(default_factory=LatencyModel)
    #: Tokens until EOS (content/lengths.py); None: requests end by max_tokens only.
    output_lengths: Optional[OutputLengths] = None
    #: prompt + output never beyond this (then LENGTH), as a real engine.
    max_model_len: int = 1 << 20
    #: content/tokens.py source; None: random ids from [0, vocab_size).
    token_source: Optional[TokenSource] = None
    #: KV blocks enforced (None: only reported): a running request holds
    #: ceil(tokens / block_size); when they run out the newest is preempted.
    kv_blocks: Optional[int] = None
    #: Per-step token budget enforced (None: unlimited): decodes first, then
    #: prefill in chunks of what is left.
    max_num_batched_tokens: Optional[int] = None
    #: Prefix caching: prompt blocks seen before are not prefilled again.
    prefix_caching: bool = False
    #: KV events (--kv-events-config): the prefix cache records what it
    #: stores, evicts and clears, for `take_kv_events` (runtime/kv_publisher.py publishes).
    kv_events: bool = False
    #: Synthetic logprobs (content/logprobs.py): the top-1 token's mean probability,
    #: and how often the sampled token is the top-1.
    logprobs_top1: float = 0.6
    logprobs_sampled_top1: float = 0.75
    #: A ledger violation raises LedgerViolation (the process stops) instead of only being logged.
    strict_ledger: bool = False
    #: LoRA (core/lora.py): adapters per batch (GPU slots) and registered (CPU
    #: cache; None: = max_loras, as vLLM), the largest rank accepted, and
    #: whether an adapter's directory is checked as vLLM's worker reads it.
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: Optional[int] = None
    max_lora_rank: int = 16
    lora_check_adapter_dir: bool = True
    #: The wire layout of the frontend (fixed by --protocol-version or
    #: detected from the first ADD; shared by the process's engines, §8.2).
    wire: Wire = field(default_factory=Wire)
    #: P/D disaggregation (--kv-role / --kv-transfer-config, kv/transfer.py); None: off.
    kv_transfer: Optional[kv_transfer.KVTransferSettings] = None
    #: The steady state's outputs are lists reused from step to step
    #: (OutputProcessor.reuse_outputs): a message `step` returns is only valid
    #: until the next step. The runtime encodes each message as it is made;
    #: off for callers that keep what `step` returned.
    reuse_outputs: bool = False
    #: --replay (timing/replay.py): the trace requests follow and how ADDs are matched to it; None: off.
    replay: Optional[replay.ReplaySettings] = None
    #: --tokenizer: the served model's tokenizer (a model dir or tokenizer.json), None: not known.
    tokenizer: Optional[str] = None
    #: Tool calls and reasoning spans (content/answer.py): their shares and lengths.
    content: ContentSettings = field(default_factory=ContentSettings)
    #: --grammar-timeout-ms in seconds: the most a request waits for its structured answer (core/grammar_wait.py); 0: no limit
    grammar_timeout_s: float = 30.0
    #: speculative decoding (content/spec_decode.py): the K per-position acceptance rates; (): off
    spec_acceptance: Tuple[float, ...] = ()
    #: pooling requests (content/pooling.py): the sizes of their tensors
    pooling: pooling.PoolingSettings = field(default_factory=pooling.PoolingSettings)
    #: multimodal caches (core/mm_cache.py): the receiver cache in bytes, the encoder cache in tokens
    mm_processor_cache_bytes: int = 4 << 30
    encoder_cache_tokens: int = 8192


#: The EngineSettings a reload (SIGHUP, reload.py) may change while requests
#: run (`EngineCore.reconfigure`); every other one is fixed at start. The
#: options declare which field they feed (options.py, Option.setting).
RELOADABLE_SETTINGS = options.RELOADABLE_SETTINGS


@dataclass(frozen=True)
class GenerationSettings:
    """Which tokens a request gets and how it ends (--vocab-size ... --logprobs-*, --output-len-dist)."""

    output_token_chunk_size: int
    vocab_size: int
    seed: int
    supported_tasks: Tuple[str, ...]
    max_model_len: int
    #: --token-source as given (random | echo | text | file:PATH); the source is made per rank
    token_source: str
    #: [low, high) of random ids; None: [0, vocab_size)
    token_id_range: Optional[Tuple[int, int]]
    #: --tokenizer: the served model's tokenizer (tokenizer.load_tokenizer), None: not known
    tokenizer: Optional[str]
    #: --tool-call-rate, --reasoning-rate, --reasoning-tokens
    content: ContentSettings
    #: --grammar-timeout-ms, in seconds (0: no limit)
    grammar_timeout_s: float
    #: tokens until EOS; None: requests end by max_tokens only
    output_lengths: Optional[lengths.OutputLengths]
    logprobs_top1: float
    logprobs_sampled_top1: float
    #: --spec-tokens / --spec-acceptance: K per-position acceptance rates; (): no speculative decoding
    spec_acceptance: Tuple[float, ...] = ()
    #: --embedding-dim / --num-labels (content/pooling.py)
    pooling: pooling.PoolingSettings = field(default_factory=pooling.PoolingSettings)


@dataclass(frozen=True)
class SchedulerSettings:
    """The waiting queue's order and the limits enforced (None: only reported)."""

    scheduling_policy: str
    max_num_seqs: Optional[int]
    max_num_batched_tokens: Optional[int]
    #: --async-scheduling: admissions decided a step ahead (core/scheduler.py)
    async_scheduling: bool = False


@dataclass(frozen=True)
class KVSettings:
    """The KV cache: blocks reported and enforced, prefix caching, its events."""

    num_gpu_blocks: int
    block_size: int
    #: blocks enforced; None: only reported
    kv_blocks: Optional[int]
    prefix_caching: bool
    #: --kv-events-config enables them: the prefix cache records its events
    kv_events: bool
    #: multimodal caches (core/mm_cache.py): the receiver cache in bytes, the encoder cache in tokens
    mm_processor_cache_bytes: int = 4 << 30
    encoder_cache_tokens: int = 8192


@dataclass(frozen=True)
class LoRASettings:
    """vLLM's LoRAConfig flags (lora.py)."""

    enable_lora: bool
    max_loras: int
    #: None: = max_loras, as vLLM
    max_cpu_loras: Optional[int]
    max_lora_rank: int
    lora_check_adapter_dir: bool


@dataclass(frozen=True)
class LoggingSettings:
    """Logging and the books."""

    log_level: str
    log_json: bool
    log_requests: bool
    summary_interval: float
    strict_ledger: bool


@dataclass(frozen=True)
class ProcessSettings:
    """The process around the engines (runtime/app.py, runtime/runner.py):
    which ranks it serves and where, the frontend watch, the metrics
    endpoint, how it stops."""

    handshake_address: str
    #: the first DP rank of this process and how many engines it runs
    first_rank: int
    engine_count: int
    data_parallel_size: int
    #: --protocol-version as given: the wire layout, or auto (detected from the first ADD)
    protocol_version: Any
    frontend_heartbeat: float
    #: seconds; None: never
    exit_when_frontend_gone: Optional[float]
    #: --kv-events-config (kv_publisher.py); None: off
    kv_events_config: Any
    #: None: no metrics endpoint
    metrics_port: Optional[int]
    metrics_host: str
    #: --on-stop: exit | abort | finish
    on_stop: str
    drain_timeout: float
    send_dead_on_exit: bool

    @property
    def ranks(self) -> range:
        """The DP ranks of this process's engines."""
        return range(self.first_rank, self.first_rank + self.engine_count)


@dataclass(frozen=True)
class Settings:
    """Every part's settings, from one parsed configuration."""

    latency: LatencyModel
    generation: GenerationSettings
    scheduler: SchedulerSettings
    kv: KVSettings
    lora: LoRASettings
    #: P/D disaggregation; None: off
    pd: Optional[kv_transfer.KVTransferSettings]
    #: every configured --fault-*, in faults.KINDS order
    faults: Tuple[FaultSpec, ...]
    logging: LoggingSettings
    #: the process around the engines
    process: ProcessSettings
    #: --replay, --replay-match; None: off
    replay: Optional[replay.ReplaySettings] = None


def from_config(c: Any) -> Settings:
    """The parts' settings from a parsed configuration (config.parse_config's
    Namespace, with `sources` and `faults`)."""

    events = getattr(c, "kv_events_config", None)
    # the limits in effect (None: only reported)
    max_num_seqs = effective(c, "max_num_seqs")
    max_num_batched_tokens = effective(c, "max_num_batched_tokens")
    kv_blocks = effective(c, "num_gpu_blocks")
    return Settings(
        latency=LatencyModel(
            itl_ms=c.itl_ms,
            itl_ms_per_request=c.itl_ms_per_request,
            ttft_ms=c.ttft_ms,
            prefill_ms_per_token=c.prefill_ms_per_token,
            encoder_ms_per_token=c.encoder_ms_per_token,
            jitter=c.jitter,
            time_scale=c.time_scale,
            lora_load_ms=c.lora_load_ms,
            profile=c.latency_profile.profile if c.latency_profile else None,
        ),
        generation=GenerationSettings(
            output_token_chunk_size=c.output_token_chunk_size,
            vocab_size=c.vocab_size,
            seed=c.seed,
            supported_tasks=tuple(c.supported_tasks),
            max_model_len=c.max_model_len,
            token_source=c.token_source,
            token_id_range=(c.token_id_range.low, c.token_id_range.high) if c.token_id_range else None,
            tokenizer=getattr(c, "tokenizer", None),
            content=ContentSettings(c.tool_call_rate, c.reasoning_rate, c.reasoning_tokens,
                                    GrammarLimits(c.grammar_max_tokens, c.grammar_max_rules, c.grammar_max_items, c.grammar_max_depth)),
            grammar_timeout_s=c.grammar_timeout_ms / 1000.0,
            output_lengths=lengths.from_config(c.output_len_dist, c.eos_probability),
            logprobs_top1=c.logprobs_top1,
            logprobs_sampled_top1=c.logprobs_sampled_top1,
            spec_acceptance=spec_decode.acceptance_rates(getattr(c, "spec_tokens", 0), getattr(c, "spec_acceptance", (0.0,))),
            pooling=pooling.settings_from(getattr(c, "embedding_dim", 0), getattr(c, "num_labels", 2), getattr(c, "tokenizer", None)),
        ),
        scheduler=SchedulerSettings(
            scheduling_policy=c.scheduling_policy,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            async_scheduling=c.async_scheduling,
        ),
        kv=KVSettings(
            num_gpu_blocks=c.num_gpu_blocks,
            block_size=c.block_size,
            kv_blocks=kv_blocks,
            prefix_caching=c.prefix_caching,
            kv_events=events is not None and events.enabled,
            mm_processor_cache_bytes=int(c.mm_processor_cache_gb * (1 << 30)),
            encoder_cache_tokens=c.encoder_cache_size or c.max_num_batched_tokens,
        ),
        lora=LoRASettings(
            enable_lora=c.enable_lora,
            max_loras=c.max_loras,
            max_cpu_loras=c.max_cpu_loras,
            max_lora_rank=c.max_lora_rank,
            lora_check_adapter_dir=c.lora_check_adapter_dir,
        ),
        pd=kv_transfer.settings_from(
            c.kv_role, c.kv_transfer_config, c.kv_transfer_ms_per_token, c.kv_transfer_ms_per_block, c.data_parallel_size
        ),
        faults=tuple(getattr(c, "faults", ())),
        logging=LoggingSettings(
            log_level=c.log_level,
            log_json=c.log_json,
            log_requests=c.log_requests,
            summary_interval=c.summary_interval,
            strict_ledger=c.strict_ledger,
        ),
        replay=replay.settings_from(
            c.replay,
            c.replay_match,
            range(c.data_parallel_start_rank, c.data_parallel_start_rank + c.engine_count),
            c.data_parallel_size or c.data_parallel_start_rank + c.engine_count,
        ),
        process=ProcessSettings(
            handshake_address=c.handshake_address,
            first_rank=c.data_parallel_start_rank,
            engine_count=c.engine_count,
            data_parallel_size=c.data_parallel_size,
            protocol_version=c.protocol_version,
            frontend_heartbeat=c.frontend_heartbeat,
            exit_when_frontend_gone=c.exit_when_frontend_gone,
            kv_events_config=events,
            metrics_port=c.metrics_port,
            metrics_host=c.metrics_host,
            on_stop=c.on_stop,
            drain_timeout=c.drain_timeout,
            send_dead_on_exit=c.send_dead_on_exit,
        ),
    )


def engine_settings(
    parts: Settings,
    rank: int,
    num_clients: int,
    has_coordinator: bool,
    wire: Wire,
    token_source: Optional[tokens.TokenSource] = None,
) -> EngineSettings:
    """One engine's EngineSettings from the parts; `token_source` given: that
    one, else made for this rank (a token file is read here: OSError or
    ValueError if it cannot be)."""
    gen, sched, kv, lora = parts.generation, parts.scheduler, parts.kv, parts.lora
    if token_source is None:
        token_source = tokens.make_source(gen.token_source, gen.vocab_size, gen.seed, rank, gen.token_id_range, gen.tokenizer)
    return EngineSettings(
        rank=rank,
        num_clients=num_clients,
        output_token_chunk_size=gen.output_token_chunk_size,
        vocab_size=gen.vocab_size,
        seed=gen.seed,
        log_requests=parts.logging.log_requests,
        supported_tasks=gen.supported_tasks,
        num_gpu_blocks=kv.num_gpu_blocks,
        block_size=kv.block_size,
        has_coordinator=has_coordinator,
        max_num_seqs=sched.max_num_seqs,
        kv_blocks=kv.kv_blocks,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        scheduling_policy=sched.scheduling_policy,
        async_scheduling=sched.async_scheduling,
        prefix_caching=kv.prefix_caching,
        kv_events=kv.kv_events,
        mm_processor_cache_bytes=kv.mm_processor_cache_bytes,
        encoder_cache_tokens=kv.encoder_cache_tokens,
        reuse_outputs=True,  # the runtime encodes each message as it is made
        kv_transfer=parts.pd,
        strict_ledger=parts.logging.strict_ledger,
        output_lengths=gen.output_lengths,
        logprobs_top1=gen.logprobs_top1,
        logprobs_sampled_top1=gen.logprobs_sampled_top1,
        token_source=token_source,
        max_model_len=gen.max_model_len,
        latency=parts.latency,
        enable_lora=lora.enable_lora,
        max_loras=lora.max_loras,
        max_cpu_loras=lora.max_cpu_loras,
        max_lora_rank=lora.max_lora_rank,
        lora_check_adapter_dir=lora.lora_check_adapter_dir,
        wire=wire,
        replay=parts.replay,
        tokenizer=gen.tokenizer,
        content=gen.content,
        grammar_timeout_s=gen.grammar_timeout_s,
        spec_acceptance=gen.spec_acceptance,
        pooling=gen.pooling,
    )
