"""The mock's own observability: a Prometheus endpoint and a periodic summary.

Off unless `--metrics-port` is given; bound to 127.0.0.1 unless
`--metrics-host` says otherwise. Nothing is counted on the hot path: a
collector reads the engines' ledgers, counters and queues when Prometheus
scrapes (prometheus_client's default collectors add the process's RSS,
open file descriptors and CPU time). The HTTP server is gevent's WSGI
server, a supervised greenlet like every other.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional

import gevent
from gevent.pywsgi import WSGIServer
from loguru import logger
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

#: Finish reasons as the ledger counts them (finished_<reason>).
REASONS = ("length", "stop", "abort", "error", "repetition")


class EngineCollector(Collector):
    """gmock_* metrics of every engine of this process, labelled by rank."""

    def __init__(self, runners: List[Any]) -> None:
        self.runners = runners

    def collect(self) -> Iterable[Any]:
        running = GaugeMetricFamily("gmock_requests_running", "requests in the running batch", labels=["engine"])
        waiting = GaugeMetricFamily("gmock_requests_waiting", "requests waiting to be scheduled", labels=["engine"])
        started = CounterMetricFamily("gmock_requests_started", "requests the engine accepted", labels=["engine"])
        finished = CounterMetricFamily(
            "gmock_requests_finished", "requests ended, by finish reason", labels=["engine", "reason"]
        )
        tokens = CounterMetricFamily("gmock_output_tokens", "output tokens emitted", labels=["engine"])
        steps = CounterMetricFamily("gmock_steps", "decode steps run", labels=["engine"])
        preemptions = CounterMetricFamily("gmock_preemptions", "requests preempted for KV blocks", labels=["engine"])
        violations = CounterMetricFamily("gmock_ledger_violations", "request-ledger violations", labels=["engine"])
        bad_frames = CounterMetricFamily("gmock_bad_frames", "malformed frames dropped", labels=["engine"])
        utility = CounterMetricFamily("gmock_utility_calls", "utility calls answered", labels=["engine"])
        kv = GaugeMetricFamily("gmock_kv_cache_usage", "KV cache usage as reported to the frontend (0..1)", labels=["engine"])
        queues = GaugeMetricFamily("gmock_queue_depth", "messages queued between greenlets", labels=["engine", "queue"])
        lateness = GaugeMetricFamily(
            "gmock_step_lateness_seconds", "step lateness against the latency model, recent steps", labels=["engine", "quantile"]
        )
        faults = CounterMetricFamily("gmock_faults_injected", "faults injected (--fault-*), by kind", labels=["engine", "kind"])
        generation = GaugeMetricFamily(
            "gmock_engine_config_generation", "configuration generation the engine runs with (its stepper took it)", labels=["engine"]
        )
        # KV-cache events (kv_publisher.py): published batches and events, batches
        # dropped at a full queue, replay requests served, batches replayed,
        # malformed replay requests ignored; the kv-* faults count in gmock_faults_injected
        kv_events = CounterMetricFamily("gmock_kv_events", "KV-cache event publisher counters, by name", labels=["engine", "counter"])
        # speculative decoding (content/spec_decode.py): the drafts the engine verified, as its
        # SpecDecodingStats sum them (the frontends' vllm:spec_decode_* counters)
        spec = CounterMetricFamily("gmock_spec_decode", "speculative decoding counts, by name", labels=["engine", "counter"])
        spec_pos = CounterMetricFamily(
            "gmock_spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by position", labels=["engine", "position"]
        )
        # the frontend watch (frontend_watch.py): its sockets' monitor events by
        # kind (disconnected, connect_retried, ...) and whether every socket is connected
        link_events = CounterMetricFamily(
            "gmock_frontend_socket_events", "monitor events of the sockets toward the frontend, by kind", labels=["engine", "event"]
        )
        link_up = GaugeMetricFamily(
            "gmock_frontend_connected", "1 while every socket toward the frontend is connected, else 0", labels=["engine"]
        )
        outages = CounterMetricFamily("gmock_frontend_outages", "times the frontend went (a socket lost its connection)", labels=["engine"])
        # a connection toward the frontend whose data waits for ACKs: a link down under load
        stalls = CounterMetricFamily("gmock_frontend_link_stalls", "times a connection toward the frontend got no TCP ACKs", labels=["engine"])
        stalled = GaugeMetricFamily("gmock_frontend_link_stalled", "1 while a connection toward the frontend gets no TCP ACKs", labels=["engine"])
        for runner in self.runners:
            link = runner.watch.link
            if link is not None:
                for kind, count in sorted(link.counts.items()):
                    link_events.add_metric([str(runner.rank), kind], count)
                link_up.add_metric([str(runner.rank)], 1 if link.connected else 0)
                outages.add_metric([str(runner.rank)], link.outages)
                stalls.add_metric([str(runner.rank)], runner.watch.stalls.stalls)
                stalled.add_metric([str(runner.rank)], 1 if runner.watch.stalls.stalled else 0)
            publisher = getattr(runner, "kv_events", None)
            if publisher is not None:
                for name in ("batches", "events", "dropped_queue_full", "replay_requests", "replayed_batches", "bad_replay_requests"):
                    kv_events.add_metric([str(runner.rank), name], publisher.counters[name])
            for kind, count in runner.faults.injected.items():
                faults.add_metric([str(runner.rank), kind], count)
            generation.add_metric([str(runner.rank)], runner.generation)
            engine = runner.engine
            if engine is None:
                continue
            rank = str(runner.rank)
            ledger = engine.ledger.summary()
            running.add_metric([rank], len(engine.active))
            waiting.add_metric([rank], len(engine.waiting))
            started.add_metric([rank], ledger.get("started", 0))
            for reason in REASONS:
                finished.add_metric([rank, reason], ledger.get("finished_" + reason, 0))
            tokens.add_metric([rank], engine.counters["tokens"])
            steps.add_metric([rank], engine.counters["steps"])
            preemptions.add_metric([rank], engine.counters["preemptions"])
            violations.add_metric([rank], ledger.get("violations", 0))
            bad_frames.add_metric([rank], runner.bad_frames)
            utility.add_metric([rank], engine.counters["utility_calls"])
            kv.add_metric([rank], engine.scheduler_stats()["kv_cache_usage"])
            if engine.scheduler.spec is not None:
                totals = engine.scheduler.spec.totals()
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                    spec.add_metric([rank, name], totals[name])
                for position, count in enumerate(totals["num_accepted_tokens_per_pos"]):
                    spec_pos.add_metric([rank, str(position)], count)
            queues.add_metric([rank, "input"], runner.links.input_queue.qsize())
            queues.add_metric([rank, "output"], runner.links.output_queue.qsize())
            summary = runner.step_lateness.summary()
            lateness.add_metric([rank, "0.5"], summary["p50"])
            lateness.add_metric([rank, "0.99"], summary["p99"])
        yield from (running, waiting, started, finished, tokens, steps, preemptions, violations, bad_frames, utility, kv, queues, lateness, faults, generation, kv_events, spec, spec_pos, link_events, link_up, outages, stalls, stalled)


class ConfigCollector(Collector):
    """The process's configuration: its generation (1 as started, +1 per
    reload that took: SIGHUP), when it was read, and reloads by result."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def collect(self) -> Iterable[Any]:
        app = self.app
        yield GaugeMetricFamily(
            "gmock_config_generation", "configuration generation: 1 as started, +1 per reload that took (SIGHUP)", value=app.generation
        )
        yield GaugeMetricFamily(
            "gmock_config_last_reload_timestamp_seconds",
            "when the configuration in force was read (unix time; the start for generation 1)",
            value=app.loaded_at,
        )
        reloads = CounterMetricFamily("gmock_config_reloads", "reloads (SIGHUP) by result", labels=["result"])
        for result in ("applied", "refused"):
            reloads.add_metric([result], app.reloads[result])
        yield reloads
        # Which wire layout the engines speak (docs/protocol.md §8.2): named by
        # --protocol-version ("configured"), read off the first ADD ("detected"),
        # or still the newest one while no request came ("pending").
        wire = app.wire
        how = "configured" if wire.fixed else "detected" if wire.settled else "pending"
        layout = GaugeMetricFamily(
            "gmock_wire_layout", "the wire layout in use (1), by era, the vLLM versions it covers and how it was chosen",
            labels=["era", "versions", "how"],
        )
        layout.add_metric([wire.layout.version, wire.layout.versions, how], 1)
        yield layout


def registry(runners: List[Any], app: Optional[Any] = None) -> CollectorRegistry:
    """gmock_* metrics (with `app`, its configuration's too) plus the process
    (RSS, open fds, CPU), GC and platform ones."""
    reg = CollectorRegistry(auto_describe=True)
    reg.register(EngineCollector(runners))
    if app is not None:
        reg.register(ConfigCollector(app))
    for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
        reg.register(collector)
    return reg


def server(host: str, port: int, runners: List[Any], app: Optional[Any] = None) -> WSGIServer:
    """The /metrics endpoint (any path answers); bound now, so a port in use
    fails at start; the caller runs `serve_forever` in a supervised greenlet."""
    wsgi = WSGIServer((host, port), make_wsgi_app(registry(runners, app)), log=None, error_log=None)
    wsgi.init_socket()
    logger.info("metrics at http://{}:{}/metrics", host, wsgi.server_port)
    return wsgi
