"""The shipped GPU profiles against measurements on real GPUs (docs/gpu-profiles.md).

    .venv/bin/python benchmarks/silicon.py                 # every vLLM agg row a profile serves
    .venv/bin/python benchmarks/silicon.py --system h200_sxm --max-concurrency 16
    .venv/bin/python benchmarks/silicon.py --summary-of h100.md h200.md   # the summary of printed tables
    .venv/bin/python benchmarks/silicon.py --profiles DIR --system h100_sxm   # other profiles (a tuning sweep)

AIConfigurator's core (the gpu extra) ships `systems/silicon_sample.csv`:
benchmark runs of vLLM on real GPUs (system, model, precision, TP, ISL, OSL,
concurrency -> TTFT and TPOT). For each vLLM agg row that a profile in
conf/profiles/ serves (the profile's header names its model, system, TP and
precision), this drives the mock's engine (gmock_engine's own EngineCore,
with the profile's [gmock_engine] limits and timing) with the row's
workload: `concurrency` clients that start together, each sending its next
request when its previous one finished (ignore_eos), 10 x concurrency
requests (benchmark_serving's num_prompts), prompt and output lengths drawn
from [ratio x ISL, ISL] and [ratio x OSL, OSL] (its random dataset's
--random-range-ratio; RANGE_RATIO). The engine runs on
a virtual clock: the step times are the profile's, not this machine's, so a
row of 8 192-token prompts at concurrency 32 (minutes of GPU time) takes
seconds, and the figures do not depend on how loaded the machine is.
Printed per row: silicon's TTFT and TPOT, the mock's (means over the
requests), their errors, and AIConfigurator's own agg estimate for the same
row beside them; then per system the median |error| and on how many rows
the mock is closer.

The frontend's share (HTTP, detokenizing, a few ms per request at these
rates) is not in the figures; an e2e test (tests/e2e/test_serve_e2e.py,
solo) runs one row through a real frontend with `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import configparser
import csv
import functools
import logging
import os
import random
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import msgpack

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import read_profile
from gmock_engine.timing.trace import output_record
from gmock_engine.wire.inputs import EngineCoreRequest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.path.join(REPO, "conf", "profiles")
#: silicon's model names -> the profile's; its precision column -> the profile's
MODEL_ALIASES = {"nvidia/Llama-3.1-8B-Instruct-FP8": "meta-llama/Llama-3.1-8B"}
#: the rows the profiles' form was chosen on; every other system is held out
TUNING_SYSTEM = "h100_sxm"


def silicon_rows() -> List[dict]:
    import aiconfigurator_core

    path = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "systems", "silicon_sample.csv")
    with open(path, encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if r["backend"] == "vllm" and r["mode"] == "agg"]


def profile_index(folder: str = PROFILES) -> Dict[Tuple[str, str, int, str], str]:
    """(model, system, tp, precision) -> profile path, from each profile's first header line."""
    index = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".ini")):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        # "# MODEL on SYSTEM, TP n, PRECISION[, KV cache DTYPE]: ..."
        head = first[2:].split(":", 1)[0]
        model, rest = head.split(" on ", 1)
        system, tp, precision = [part.strip() for part in rest.split(",")[:3]]
        index[(model, system, int(tp.split()[1]), precision)] = path
    return index


def row_key(row: dict) -> Optional[Tuple[str, str, int, str]]:
    """(model, system, TP, precision) of the profile that serves the row, or None for a
    deployment no profile is: experts spread over the GPUs (expert parallel) or attention
    data parallel, where a profile's engine is one TP group."""
    if int(row["moe_ep_size"] or 1) > 1 or int(row["attention_dp_size"] or 1) > 1:
        return None
    model = MODEL_ALIASES.get(row["model_path"], row["model_path"])
    precision = row["precision"] or "bf16"
    if NATIVE_FAMILY.get(checkpoint_quant(model)) == precision:
        precision = "native"  # the checkpoint's own format: gpt-oss's MXFP4, block-scaled fp8, Kimi's int4
    return model, row["system"], int(row["tp_size"]), precision


#: a checkpoint's own quantization (AIConfigurator's `quant_algo` of its config) -> the
#: precision a silicon row names it by (the rows say fp4 for MXFP4 too, fp8 for block-scaled fp8)
NATIVE_FAMILY = {"mxfp4": "fp4", "fp8_block": "fp8", "fp8": "fp8", "compressed-tensors": "int4"}


@functools.lru_cache(maxsize=None)
def checkpoint_quant(model: str) -> Optional[str]:
    """The quantization a model's checkpoint ships in (None: unquantized, or a model the library does not list)."""
    from aiconfigurator_core.sdk.utils import get_model_config_from_model_path

    from gmock_engine.tools.gpu_profile import ProfileToolError, resolve_model

    try:
        return get_model_config_from_model_path(resolve_model(model, "/nonexistent"))["raw_config"].get("quant_algo")
    except ProfileToolError:
        return None


#: The random dataset's --random-range-ratio the rows' runs drew lengths with, chosen on the
#: H100 rows (the silicon file does not say): [0.8 x L, L] put the mock's TTFT closer to
#: silicon's than fixed lengths, with which clients that start together stay in lockstep and
#: every wave's prompts share one step, on both sources of rows.
RANGE_RATIO = 0.8


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def engine_limits(path: str) -> dict:
    ini = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"))
    ini.read(path, encoding="utf-8")
    section = ini["gmock_engine"]
    return dict(
        block_size=int(section["block-size"]),
        kv_blocks=int(section["num-gpu-blocks"]),
        num_gpu_blocks=int(section["num-gpu-blocks"]),
        max_num_seqs=int(section["max-num-seqs"]),
        max_num_batched_tokens=int(section["max-num-batched-tokens"]),
        async_scheduling=section.getboolean("async-scheduling"),
    )


def simulate(path: str, isl: int, osl: int, concurrency: int, requests: int, range_ratio: float, seed: int = 0) -> Dict[str, float]:
    """The mock engine's TTFT and TPOT, ms (mean and median over the
    requests), for the closed loop of the row: `concurrency` clients that
    start together, each request's prompt and output lengths drawn
    uniformly from [range_ratio x ISL, ISL] and [range_ratio x OSL, OSL]
    (vLLM's benchmark_serving random dataset with --random-range-ratio)."""
    rng = random.Random(seed)
    clock = _Clock()
    settings = EngineSettings(rank=0, num_clients=1, seed=seed, latency=LatencyModel(profile=read_profile(path)),
                              max_model_len=isl + osl + 16, **engine_limits(path))  # fmt: skip
    engine = EngineCore(settings, clock=clock)
    added: Dict[str, float] = {}
    first: Dict[str, float] = {}
    done: Dict[str, float] = {}
    lengths: Dict[str, int] = {}
    issued = 0

    def send() -> None:
        nonlocal issued
        rid = f"r{issued}"
        issued += 1
        prompt = rng.randint(max(1, int(isl * range_ratio)), isl)
        lengths[rid] = rng.randint(max(1, int(osl * range_ratio)), osl)
        ids = [rng.randrange(32000) for _ in range(prompt)]
        engine.apply(EngineCoreRequest(rid, prompt, lengths[rid], True, prompt_token_ids=ids, ignore_eos=True))
        added[rid] = clock.now

    for _ in range(min(concurrency, requests)):
        send()
    due: Optional[float] = 0.0
    while engine.has_work:
        clock.now = max(clock.now, due or 0.0)
        started = clock.now
        finished = 0
        for client, message in engine.step():
            record = output_record(clock.now, 0, client, [msgpack.packb(message, use_bin_type=True)])
            for item in record.get("requests") or ():
                first.setdefault(item["id"], clock.now)
                if item.get("finish_reason") is not None:
                    done[item["id"]] = clock.now
                    finished += 1
        # the clients of the finished requests send their next ones at once
        for _ in range(finished):
            if issued < requests:
                send()
        due = engine.next_step_time(started) if engine.has_work else None
    ttft = [(first[r] - added[r]) * 1000.0 for r in done]
    tpot = [(done[r] - first[r]) * 1000.0 / (lengths[r] - 1) for r in done if lengths[r] > 1]
    return {"ttft_mean": statistics.mean(ttft), "ttft_median": statistics.median(ttft),
            "tpot_mean": statistics.mean(tpot), "tpot_median": statistics.median(tpot)}  # fmt: skip


def aic_agg(row: dict, key: Tuple[str, str, int, str]) -> Optional[Tuple[float, float]]:
    """AIConfigurator's own agg estimate (TTFT, TPOT ms) of the row, or None where it gives none."""
    try:
        from aiconfigurator_core.sdk import perf_database
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.config import RuntimeConfig
        from aiconfigurator_core.sdk.config_builders import build_model_config
        from aiconfigurator_core.sdk.models import get_model

        from gmock_engine.tools.gpu_profile import quant_modes, resolve_model, table_versions

        model, system, tp, precision = key
        gemm, kv = quant_modes(precision)
        config = build_model_config(tp, 1, 1, tp, 1, gemm_quant_mode=gemm, kvcache_quant_mode=kv, moe_quant_mode=gemm)
        aic_model = get_model(resolve_model(model, "/nonexistent"), config, "vllm")
        database = perf_database.get_database(system, "vllm", table_versions(system)[-1])
        summary = get_backend("vllm").run_agg(aic_model, database, RuntimeConfig(batch_size=int(row["batch_size"]),
                                              isl=int(row["isl"]), osl=int(row["osl"])), ctx_tokens=8192)  # fmt: skip
        result = summary.get_result_dict()
        return float(result["ttft"]), float(result["tpot"])
    except Exception:  # noqa: BLE001 - a column beside the mock's, absent where the library gives none
        return None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", help="only this system's rows")
    parser.add_argument("--max-concurrency", type=int, default=10 ** 6, help="skip rows above this concurrency")
    parser.add_argument("--requests-per-client", type=int, default=10, help="requests per client (benchmark_serving: num_prompts = 10 x concurrency)")
    parser.add_argument("--range-ratio", type=float, help="lengths drawn from [ratio x ISL, ISL] and [ratio x OSL, OSL] "
                        f"(default {RANGE_RATIO}, chosen on the H100 rows)")
    parser.add_argument("--model", help="only this model's rows (silicon's name)")
    parser.add_argument("--statistic", choices=("mean", "median"), default="mean", help="of TTFT and TPOT over the requests")
    parser.add_argument("--markdown", action="store_true", help="the table as docs/gpu-profiles.md shows it")
    parser.add_argument("--profiles", default=PROFILES, help="the folder of profiles to check (default: conf/profiles)")
    parser.add_argument("--summary-of", nargs="+", metavar="TABLE", help="only summarize tables this script printed")
    args = parser.parse_args(argv)
    if args.summary_of:
        print(summary_of(args.summary_of))
        return 0
    logging.disable(logging.WARNING)
    index = profile_index(args.profiles)
    rows = []
    seen = set()
    for row in silicon_rows():
        key = row_key(row)
        # the silicon file repeats some runs under two sources (the same figures, to the last digit or two): each once
        measured = (key, row["isl"], row["osl"], row["batch_size"], round(float(row["silicon_ttft_ms"]), 6),
                    round(float(row["silicon_tpot_ms"]), 6))  # fmt: skip
        if (key is not None and key in index and (args.system is None or row["system"] == args.system) and int(row["batch_size"]) <= args.max_concurrency
                and (args.model is None or row["model_path"] == args.model) and measured not in seen):
            seen.add(measured)
            rows.append((key, row))
    rows.sort(key=lambda kr: (kr[1]["system"] != TUNING_SYSTEM, kr[0], int(kr[1]["isl"]), int(kr[1]["osl"]), int(kr[1]["batch_size"])))
    header = "| profile | ISL/OSL | conc. | silicon TTFT / TPOT | mock TTFT / TPOT | error | AIC agg TTFT / TPOT | AIC error | tuning |"
    print(header)
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    errors: Dict[str, List[Tuple[float, float, Optional[float], Optional[float]]]] = {}
    for key, row in rows:
        isl, osl, conc = int(row["isl"]), int(row["osl"]), int(row["batch_size"])
        s_ttft, s_tpot = float(row["silicon_ttft_ms"]), float(row["silicon_tpot_ms"])
        ratio = args.range_ratio if args.range_ratio is not None else RANGE_RATIO
        found = simulate(index[key], isl, osl, conc, args.requests_per_client * conc, ratio)
        m_ttft, m_tpot = found[f"ttft_{args.statistic}"], found[f"tpot_{args.statistic}"]
        aic = aic_agg(row, key)
        e_ttft, e_tpot = (m_ttft / s_ttft - 1) * 100, (m_tpot / s_tpot - 1) * 100
        a_ttft = (aic[0] / s_ttft - 1) * 100 if aic else None
        a_tpot = (aic[1] / s_tpot - 1) * 100 if aic else None
        errors.setdefault(row["system"], []).append((e_ttft, e_tpot, a_ttft, a_tpot))
        aic_text = f"{aic[0]:.0f} / {aic[1]:.2f}" if aic else "-"
        aic_err = f"{a_ttft:+.0f} % / {a_tpot:+.0f} %" if aic else "-"
        print(f"| {os.path.basename(index[key])} | {isl}/{osl} | {conc} | {s_ttft:.0f} / {s_tpot:.2f} | {m_ttft:.0f} / {m_tpot:.2f} "
              f"| {e_ttft:+.0f} % / {e_tpot:+.0f} % | {aic_text} | {aic_err} | {'yes' if row['system'] == TUNING_SYSTEM else ''} |",
              flush=True)  # fmt: skip
    print()
    print(summary(errors))
    return 0


def summary(errors: Dict[str, List[Tuple[float, float, Optional[float], Optional[float]]]]) -> str:
    """Per system (and the held-out rows together): the median |error| of TTFT and TPOT, the
    mock's and AIConfigurator's agg estimate's, and on how many rows the mock is closer."""
    lines = ["| rows | n | median abs. error TTFT / TPOT, mock | AIC agg | mock closer: TTFT / TPOT / both errors' sum |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    groups = dict(errors)
    held = [v for system, values in errors.items() if system != TUNING_SYSTEM for v in values]
    if held and len(groups) > 1:
        groups["held out (not h100_sxm)"] = held

    def med(xs: List[float]) -> float:
        return statistics.median(abs(x) for x in xs) if xs else float("nan")

    for name, values in groups.items():
        rated = [v for v in values if v[2] is not None]
        closer_t = sum(1 for v in rated if abs(v[0]) < abs(v[2]))
        closer_p = sum(1 for v in rated if abs(v[1]) < abs(v[3]))
        closer_sum = sum(1 for v in rated if abs(v[0]) + abs(v[1]) < abs(v[2]) + abs(v[3]))
        lines.append(f"| {name} | {len(values)} | {med([v[0] for v in values]):.0f} % / {med([v[1] for v in values]):.0f} % "
                     f"| {med([v[2] for v in rated]):.0f} % / {med([v[3] for v in rated]):.0f} % "
                     f"| {closer_t} / {closer_p} / {closer_sum} of {len(rated)} |")  # fmt: skip
    return "\n".join(lines)


def summary_of(paths: Sequence[str]) -> str:
    """The summary of tables this script printed (the rows of several runs together)."""
    errors: Dict[str, List[Tuple[float, float, Optional[float], Optional[float]]]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) != 9 or not cells[0].endswith(".ini"):
                    continue
                system = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm", "b300": "b300_sxm", "a100": "a100_sxm"}[cells[0].split("-")[0]]
                mock = [float(x.strip(" %")) for x in cells[5].split("/")]
                aic = [float(x.strip(" %")) for x in cells[7].split("/")] if cells[7] != "-" else [None, None]
                errors.setdefault(system, []).append((mock[0], mock[1], aic[0], aic[1]))
    return summary(errors)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
