"""Self-contained HTML reports with charts for `bench --report` and `soak --report`.

One file, no external resources: every chart is a PNG drawn with matplotlib
(Agg backend, no display) and embedded as a base64 data URI, so the report
can be mailed, attached to a CI run or opened offline.

matplotlib is an optional extra (`pip install 'gmock-engine[report]'`); this
module imports it only when a report is drawn, and `missing()` tells the
commands at start whether it is there. The serving path never imports the
tools (tests/unit/test_tools.py).
"""

from __future__ import annotations

import base64
import datetime
import html
import io
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

INSTALL_HINT = "pip install 'gmock-engine[report]' (in a checkout: .venv/bin/pip install -e '.[report]')"

#: Finish reasons of the engine's ledger (gmock_engine/runtime/metrics.py REASONS).
REASONS = ("length", "stop", "abort", "error", "repetition")
#: Engine faults (docs/faults.md): they hit every request for a while,
#: so their intervals are shaded on every time axis; request faults (one
#: request each, often every interval) only show in the faults chart.
ENGINE_FAULTS = ("crash", "hang", "stall_outputs", "slow_steps")
COLORS = {"gmock": "#1f77b4", "reference": "#ff7f0e"}


def missing() -> Optional[str]:
    """None when reports can be drawn, else what to install (checked at start,
    before any load runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--report needs matplotlib, which is not installed: {INSTALL_HINT}"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# -- HTML ------------------------------------------------------------------------------

STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.verdict { font-size: 1.4em; font-weight: bold; padding: .4em .8em; border-radius: 4px; display: inline-block; }
.PASS { background: #d4f4d4; color: #145214; } .FAIL { background: #f9d6d5; color: #7a1410; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ccc; padding: .2em .6em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.meta { color: #666; font-size: .9em; } img { max-width: 100%; border: 1px solid #eee; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value.is_integer():
            return f"{value:,.0f}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def page(title: str, intro: str, charts: Sequence[Tuple[str, bytes]], extra: str = "") -> str:
    """The whole document: intro HTML, then one <h2> + <img> per chart."""
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head><body>',
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">written {stamp} by gmock_engine/tools/report.py</p>',
        intro,
    ]
    for name, png in charts:
        parts.append(f"<h2>{html.escape(name)}</h2>")
        parts.append(f'<img alt="{html.escape(name)}" src="{data_uri(png)}">')
    parts += [extra, "</body></html>"]
    return "\n".join(parts) + "\n"


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


# -- bench -----------------------------------------------------------------------------


def _bars(results: Sequence[Mapping[str, Any]], keys: Sequence[Tuple[str, str]], ylabel: str, title: str) -> bytes:
    """Grouped bars: one group per key, one bar per target, value on top."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    targets = [r["target"] for r in results]
    width = 0.8 / max(1, len(targets))
    for i, result in enumerate(results):
        xs = [k + (i - (len(targets) - 1) / 2) * width for k in range(len(keys))]
        values = [float(result.get(key) or 0.0) for key, _ in keys]
        bars = ax.bar(xs, values, width, label=result["target"], color=COLORS.get(result["target"]))
        ax.bar_label(bars, labels=[_fmt(v) for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([label for _, label in keys])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.15)
    _thousands(ax)
    if len(targets) > 1:
        ax.legend(fontsize=8)
    return _png(fig)


def _thousands(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"))


RATIOS = [("tokens_per_s", "tokens/s"), ("cpu_us_per_token", "cpu µs/token"), ("ttft_p50_ms", "ttft p50"), ("ttft_p99_ms", "ttft p99")]


def _ratio_chart(gmock: Mapping[str, Any], reference: Mapping[str, Any]) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    labels, values = [], []
    for key, label in RATIOS:
        if gmock.get(key) and reference.get(key):
            labels.append(label)
            values.append(float(gmock[key]) / float(reference[key]))
    bars = ax.bar(labels, values, color=COLORS["gmock"])
    ax.bar_label(bars, labels=[f"{v:.2f}×" for v in values], fontsize=8, padding=2)
    ax.axhline(1.0, color="#444444", lw=1, ls="--")
    ax.set_ylabel("gmock / reference")
    ax.margins(y=0.15)
    ax.set_title("gmock as a multiple of the reference emitter (1 = the same)")
    return _png(fig)


def bench_charts(results: Sequence[Mapping[str, Any]]) -> List[Tuple[str, bytes]]:
    plt = _pyplot()
    charts = [
        ("Output tokens per second", _bars(results, [("tokens_per_s", "tokens/s")], "tokens/s", "throughput in the measured window")),
    ]
    ratio = next((r.get("ratio_vs_reference") for r in results if r.get("ratio_vs_reference")), None)
    title = "engine CPU (utime+stime) per output token" + (f"; gmock/reference = {ratio:.2f}" if ratio else "")
    charts.append(("Engine CPU per output token", _bars(results, [("cpu_us_per_token", "cpu µs/token"), ("driver_cpu_us_per_token", "driver µs/token")], "µs", title)))
    charts.append(("Time to first token", _bars(results, [("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")], "ms", "ADD sent → first output, as the driver sees it")))
    by_target = {r["target"]: r for r in results}
    if "gmock" in by_target and "reference" in by_target:
        charts.append(("gmock / reference", _ratio_chart(by_target["gmock"], by_target["reference"])))
    late = [r for r in results if r.get("lateness_p50_us") is not None]
    if late:
        charts.append(("Step lateness", _bars(late, [("lateness_p50_us", "p50"), ("lateness_p99_us", "p99")], "µs", "against the --itl-ms grid (engine's gmock_stats)")))
    series = [r for r in results if r.get("tokens_per_s_series")]
    if series:
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        for result in series:
            ts, vs = zip(*result["tokens_per_s_series"])
            ax.plot(ts, vs, marker="o", markersize=3, label=result["target"], color=COLORS.get(result["target"]))
        ax.set_xlabel("seconds into the measured window")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        _thousands(ax)
        ax.set_title("output tokens per second, per second")
        ax.legend(fontsize=8)
        charts.append(("Tokens per second over the window", _png(fig)))
    return charts


BENCH_ROWS = [
    ("tokens/s", "tokens_per_s"), ("requests/s", "requests_per_s"), ("cpu µs/token", "cpu_us_per_token"),
    ("engine cpu %", "engine_cpu_pct"), ("ttft p50 ms", "ttft_p50_ms"), ("ttft p99 ms", "ttft_p99_ms"),
    ("step lateness p50 µs", "lateness_p50_us"), ("step lateness p99 µs", "lateness_p99_us"),
    ("idle cpu %", "idle_cpu_pct"), ("driver µs/token", "driver_cpu_us_per_token"), ("peak rss MB", "rss_mb"),
    ("join s", "join_s"),
]  # fmt: skip


def bench_html(results: Sequence[Mapping[str, Any]], args: Mapping[str, Any]) -> str:
    targets = [r["target"] for r in results]
    rows = [[label, *(r.get(key) for r in results)] for label, key in BENCH_ROWS]
    intro = _table(["", *targets], rows)
    ratio = next((r.get("ratio_vs_reference") for r in results if r.get("ratio_vs_reference")), None)
    if ratio:
        intro = f"<p><b>gmock / reference CPU per token: {ratio:.2f}</b></p>" + intro
    settings = {k: v for k, v in args.items() if k not in ("report", "json") and v not in (None, [], "")}
    extra = "<h2>Settings</h2>" + _table(["option", "value"], sorted(settings.items()))
    return page("gmock-engine bench", intro, bench_charts(results), extra)


def bench_report(path: str, results: Sequence[Mapping[str, Any]], args: Mapping[str, Any]) -> None:
    _write(path, bench_html(results, args))


# -- soak ------------------------------------------------------------------------------


def _rates(samples: Sequence[Mapping[str, Any]], key: str) -> Tuple[List[float], List[float]]:
    """Per-interval rate of a cumulative counter in the samples."""
    ts, vs, last_t, last_v = [], [], 0.0, 0.0
    for s in samples:
        if key not in s:
            continue
        dt = s["t"] - last_t
        if dt > 0:
            ts.append(s["t"])
            vs.append((s[key] - last_v) / dt)
        last_t, last_v = s["t"], s[key]
    return ts, vs


def _fault_times(samples: Sequence[Mapping[str, Any]], kinds: Sequence[str]) -> List[Tuple[float, float, Dict[str, float]]]:
    """(start, end, {kind: firings}) of every sample interval with faults."""
    out, last_t, last = [], 0.0, {k: 0.0 for k in kinds}
    for s in samples:
        fired = {k: s.get(k, 0.0) - last[k] for k in kinds if s.get(k, 0.0) - last[k] > 0}
        if fired:
            out.append((last_t, s["t"], fired))
        last_t, last = s["t"], {k: s.get(k, last[k]) for k in kinds}
    return out


def _shade(ax: Any, faults: Sequence[Tuple[float, float, Dict[str, float]]], warmup: Optional[float]) -> None:
    if warmup:
        ax.axvspan(0, warmup, color="#999999", alpha=0.12, lw=0)
    for start, end, fired in faults:
        if any(kind in ENGINE_FAULTS for kind in fired):
            ax.axvspan(start, end, color="#d62728", alpha=0.15, lw=0)


def soak_charts(samples: Sequence[Mapping[str, Any]], verdict: Mapping[str, Any], warmup: Optional[float] = None) -> List[Tuple[str, bytes]]:
    plt = _pyplot()
    kinds = sorted(verdict.get("faults_injected") or {})
    faults = _fault_times(samples, kinds)
    engine_faults = any(kind in ENGINE_FAULTS for _, _, fired in faults for kind in fired)
    note = " (grey: warm-up; red: intervals with an engine fault)" if engine_faults else " (grey: warm-up)"
    t = [s["t"] for s in samples]
    charts = []

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for key, label in (("ok", "ok"), ("aborted_by_client", "closed by the client"), ("failed", "failed")):
        ts, vs = _rates(samples, key)
        ax.plot(ts, vs, marker=".", label=f"{label} req/s")
    ax.set_ylabel("requests/s")
    ax.set_xlabel("seconds")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # room for the legends on top
    ts, vs = _rates(samples, "output_tokens")
    if ts:
        ax2 = ax.twinx()
        ax2.plot(ts, vs, color="#555555", ls="--", label="engine tokens/s")
        ax2.set_ylabel("tokens/s")
        ax2.set_ylim(0, ax2.get_ylim()[1] * 1.35)
        _thousands(ax2)
        ax2.legend(loc="upper right", fontsize=8)
    _shade(ax, faults, warmup)
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax.set_title("throughput per sample interval" + note, fontsize=9)
    charts.append(("Throughput", _png(fig)))

    if any("ttft_p50_ms" in s for s in samples):
        fig, ax = plt.subplots(figsize=(7.5, 3.4))
        for key, label, style in (("ttft_p50_ms", "TTFT p50", "-"), ("ttft_p99_ms", "TTFT p99", "--"),
                                  ("itl_p50_ms", "ITL p50", "-"), ("itl_p99_ms", "ITL p99", "--")):  # fmt: skip
            pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), ls=style, marker=".", label=label)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_xlabel("seconds")
        _shade(ax, faults, warmup)
        ax.legend(fontsize=8)
        ax.set_title("client-side latency per interval: time to first token; inter-token latency (mean per request)", fontsize=9)
        charts.append(("Latency seen by the clients", _png(fig)))

    if any("late_p50_us" in s for s in samples):
        fig, ax = plt.subplots(figsize=(7.5, 3.0))
        for key, label in (("late_p50_us", "p50"), ("late_p99_us", "p99")):
            pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.set_ylabel("µs")
        ax.set_xlabel("seconds")
        ax.set_ylim(bottom=0)
        _shade(ax, faults, warmup)
        ax.legend(fontsize=8)
        ax.set_title("engine step lateness against the --itl-ms grid (recent steps, worst engine)", fontsize=9)
        charts.append(("Engine step lateness", _png(fig)))

    fig, (ax, axf) = plt.subplots(2, 1, figsize=(7.5, 4.6), sharex=True)
    ax.plot(t, [s["rss_mb"] for s in samples], marker=".", color="#2ca02c")
    ax.set_ylabel("RSS MB")
    growth = verdict.get("rss_growth_pct")
    ax.set_title("engine RSS and open fds" + (f"; RSS growth after warm-up {growth:+.2f} %" if growth is not None else ""), fontsize=9)
    axf.plot(t, [s.get("fds", 0) for s in samples], marker=".", color="#9467bd")
    axf.set_ylabel("open fds")
    from matplotlib.ticker import MaxNLocator

    axf.yaxis.set_major_locator(MaxNLocator(integer=True))
    axf.set_xlabel("seconds")
    for a in (ax, axf):
        _shade(a, faults, warmup)
    charts.append(("Memory and file descriptors", _png(fig)))

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    reasons = [r for r in REASONS if any(s.get("finished_" + r) for s in samples)]
    if reasons:
        ax.stackplot(t, *[[s.get("finished_" + r, 0) for s in samples] for r in reasons], alpha=0.8,
                     labels=[f"{r} ({samples[-1].get('finished_' + r, 0):,.0f})" for r in reasons])  # fmt: skip
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no finish reasons sampled", ha="center", transform=ax.transAxes)
    ax.set_ylabel("requests ended (cumulative)")
    ax.set_xlabel("seconds")
    _shade(ax, faults, warmup)
    ax.set_title("requests ended by the engine, by finish reason", fontsize=9)
    charts.append(("Requests by finish reason", _png(fig)))

    if faults:
        fig, ax = plt.subplots(figsize=(7.5, 3.0))
        bottom = [0.0] * len(faults)
        for kind in kinds:
            heights = [f[2].get(kind, 0.0) for f in faults]
            if any(heights):
                # each bar spans the sample interval in which the faults fired
                ax.bar([f[0] for f in faults], heights, width=[(f[1] - f[0]) * 0.9 for f in faults], align="edge",
                       bottom=bottom, label=kind.replace("_", "-"))  # fmt: skip
                bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xlim(0, t[-1] if t else 1)
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("faults injected")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8)
        ax.set_title("injected faults per sample interval (gmock_faults_injected_total)", fontsize=9)
        charts.append(("Injected faults", _png(fig)))
    return charts


def soak_html(samples: Sequence[Mapping[str, Any]], verdict: Mapping[str, Any], meta: Mapping[str, Any], warmup: Optional[float] = None) -> str:
    result = str(verdict.get("verdict", "NO VERDICT"))
    parts = [f'<p><span class="verdict {html.escape(result)}">{html.escape(result)}</span></p>']
    problems = verdict.get("problems") or []
    if problems:
        parts.append("<ul>" + "".join(f"<li>{html.escape(str(p))}</li>" for p in problems) + "</ul>")
    requests = verdict.get("requests") or {}
    rows = [[k, v] for k, v in requests.items()]
    rows += [
        ["ledger: started", verdict.get("ledger_started")],
        ["ledger: violations", verdict.get("ledger_violations")],
        ["ledger: aborted", verdict.get("ledger_aborted")],
        ["RSS after warm-up MB", verdict.get("rss_warm_mb")],
        ["RSS at the end MB", verdict.get("rss_end_mb")],
        ["RSS growth %", verdict.get("rss_growth_pct")],
    ]
    rows += [[f"fault {k.replace('_', '-')}", v] for k, v in sorted((verdict.get("faults_injected") or {}).items())]
    parts.append(_table(["", "value"], rows))
    failures = verdict.get("failures") or []
    if failures:
        parts.append("<h2>First failures</h2><ul>" + "".join(f"<li><code>{html.escape(str(f))}</code></li>" for f in failures) + "</ul>")
    extra = "<h2>Settings</h2>" + _table(["option", "value"], sorted((k, v) for k, v in meta.items() if v not in (None, [], "")))
    return page("gmock-engine soak", "\n".join(parts), soak_charts(samples, verdict, warmup), extra)


def soak_report(path: str, samples: Sequence[Mapping[str, Any]], verdict: Mapping[str, Any], meta: Mapping[str, Any], warmup: Optional[float] = None) -> None:
    _write(path, soak_html(samples, verdict, meta, warmup))
