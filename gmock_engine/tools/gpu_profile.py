"""`./run.sh profile --system h100_sxm --model meta-llama/Llama-3.1-70B --tp 4 -o P.ini`:
a latency profile of a GPU deployment, from AIConfigurator's public step estimates.

AIConfigurator's core (the `gpu` extra: `pip install 'gmock-engine[gpu]'`)
ships per-operation timings measured on real GPUs (GEMM, attention,
communication; per system, framework and version) and an engine that
predicts a step from its composition. This tool asks it for the steps the
mock's engine runs (decode steps of 1 to max_num_seqs requests holding
short and long contexts; prefill chunks of 16 to max_num_batched_tokens
tokens from position 0 to deep into the context) and fits the latency
profile's terms (timing/profile.py) to its answers:

* `context_ms_per_ktoken`: the slope of the decode step against the tokens
  the batch holds, pooled over the batch sizes (the median of per-batch
  slopes: attention reads every held token, so the step grows with their sum);
* `step_ms(batch)`: the decode step at each batch size with that context
  taken out, at 1, 2, 4, ... max_num_seqs;
* `prefill_attention_ms`: how a chunk's estimate grows with the position
  it starts at (the median over chunk sizes);
* `prefill_tokens` / `prefill_ms`: a table of what a chunk of 16 to
  max_num_batched_tokens tokens adds to a step beyond its batch, context and
  attention, from steps that decode beside it (8 and 64 requests; chunked
  prefill under load) and, at a quarter of their weight, steps that only
  prefill. A table and not a price per token: a chunk of a few hundred
  tokens costs little beyond the decode step (both read every weight once),
  a long one is bound by its arithmetic.

Beside the timing, a [gmock_engine] section with what the engine needs to
behave like that deployment: `num-gpu-blocks` from the GPU's memory as
vLLM sizes its KV cache (gpu_memory_utilization 0.9 of the memory, less
the weights of one TP rank, the activations of a step of
max_num_batched_tokens and the communication buffers; divided by the KV
bytes per token per rank times the block size), `max-num-seqs` and
`max-num-batched-tokens` as vLLM's OpenAI server defaults them on that GPU
(8192 and 1024 on a GPU of 70 GiB or more other than an A100, else 2048 and
256), `block-size` 16, `async-scheduling` (vLLM's default on GPUs) and the
profile itself, so `./run.sh serve --config P.ini` serves as that
deployment and `--latency-profile P.ini` times steps like it.

The fit's error against the estimates it was fitted to, and against mixed
steps it was not, goes into the file's header, with the tables' version
and every table AIConfigurator filled from another system's or framework's
data. The engine reads the file without the library.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gmock_engine.config.loader import ENV_PREFIX, PROFILE_SECTION, ConfigError, ini_reader, new_parser, parse_tool_config
from gmock_engine.timing.profile import StepProfile, format_profile
from gmock_engine.tools.gpu_deployment import (
    BLOCK_SIZE, GIB, GPU_MEMORY_UTILIZATION, KV_CACHE_DTYPES, PRECISIONS, checkpoint_modes, engine_section, gpu_memory, kv_bytes,
    memory_budget, quant_modes, vllm_limits,
)  # fmt: skip
from gmock_engine.config.option import Group, Option, add_groups
from gmock_engine.config.validators import choice, float_in, int_at_least, nonempty

#: Where the tables stop asking: a context (per request) past the longest
#: the fit uses for the decode slope, and the prefill positions.
CONTEXTS = (128, 4096)
PREFILL_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFILL_POSITIONS = (0, 2048, 8192)
#: Mixed steps fitted beside the prefill chunks: decoding requests beside a
#: chunk of PREFILL_TOKENS, one prompt from position 0. AIConfigurator's
#: mixed step (`mixed_step_latency(ctx_tokens, gen, isl, osl)`) takes the
#: chunk as ctx_tokens / isl prompts of isl tokens, and its decodes as
#: holding isl tokens each: asked with isl = the chunk, the chunk is one
#: prompt, whose attention the profile's `prefill_attention_ms` prices (a
#: shorter isl would price a long chunk's attention as that of several
#: short prompts: at 8 192 tokens a quarter of it or less).
MIXED_DECODES = (8, 64)
PREFILL_ONLY_WEIGHT = 0.25
#: Mixed steps (decoding requests, prompt tokens: one prompt, the decodes
#: holding as many each) the profile is checked against in its header, not fitted to.
MIXED_CHECKS = ((8, 512), (32, 2048), (64, 1024), (128, 4096))


#: --block-fp8-gemms: what prices the dense layers' GEMMs of a block-scaled fp8
#: checkpoint (block_fp8_note says why there is a choice).
BLOCK_FP8_GEMMS = ("tables", "per-tensor")


class ProfileToolError(Exception):
    """What the tables cannot serve, or a missing library; the message says what they can."""


def _aic():
    """AIConfigurator's engine module, or ProfileToolError saying how to install it."""
    try:
        from aiconfigurator_core.sdk import engine  # noqa: F401
    except ImportError:
        raise ProfileToolError(
            "AIConfigurator's core is not installed: pip install 'gmock-engine[gpu]' (or aiconfigurator-core==0.12.0)"
        ) from None
    return engine


def systems() -> List[str]:
    """The systems AIConfigurator has vLLM tables for."""
    import aiconfigurator_core

    root = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "systems", "data")
    return sorted(s for s in os.listdir(root) if os.path.isdir(os.path.join(root, s, "gemm", "vllm")))


def table_versions(system: str) -> List[str]:
    """The vLLM versions of `system`'s GEMM tables."""
    import aiconfigurator_core

    root = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "systems", "data", system, "gemm", "vllm")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def known_models() -> List[str]:
    """The model names AIConfigurator has a config of (no download)."""
    from aiconfigurator_core.sdk.common import DefaultHFModels

    return sorted(DefaultHFModels)


def resolve_model(name: str, scratch: str) -> str:
    """The model path AIConfigurator reads: a listed name (also the
    Hugging Face name without its `Meta-` prefix, as vLLM's benchmarks
    spell Llama 3.1), or a directory holding a copy of the given
    config.json. ProfileToolError lists the names it knows."""
    if os.path.isfile(name):
        os.makedirs(scratch, exist_ok=True)
        shutil.copyfile(name, os.path.join(scratch, "config.json"))
        return scratch
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
        return name
    models = known_models()
    for candidate in (name, name.replace("/Llama-", "/Meta-Llama-")):
        if candidate in models:
            return candidate
    raise ProfileToolError(
        f"--model {name}: AIConfigurator has no config of it (it does not download); give its Hugging Face "
        f"config.json as --model PATH, or one of: {', '.join(models)}"
    )


@dataclass
class Deployment:
    """What was asked and what the tables made of it."""

    system: str
    model: str
    tp: int
    precision: str
    backend_version: str
    fallbacks: List[str] = field(default_factory=list)
    #: the dense layers' GEMMs as the checkpoint runs them (AIConfigurator's gemm quant mode)
    dense_gemms: str = ""
    #: how the block-scaled fp8 ones are priced (BLOCK_FP8_GEMMS)
    block_fp8_gemms: str = "tables"


class _Fallbacks(logging.Handler):
    """Collects AIConfigurator's notes of tables filled from another
    system's, framework's or version's data (its perf database logs them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.notes: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "fallback" in text.lower() or "backward fill" in text.lower() or "not found" in text.lower():
            self.notes.append(text)


def _short_fallback(note: str) -> str:
    """`Loading low-fidelity fallback rows for X.parquet from .../data/h100_sxm/mla/trtllm/1.3.0rc20/X.parquet. ...`
    -> `X from h100_sxm trtllm 1.3.0rc20`."""
    if "systems/data/" in note:
        path = note.split("systems/data/", 1)[1].split(" ", 1)[0].rstrip(".")
        parts = path.split("/")
        if len(parts) >= 5:
            return f"{parts[-1].replace('.parquet', '')}: from {parts[0]} {parts[2]} {parts[3]}"
    return note.split(". ")[0]


def compile_engine(system: str, model: str, tp: int, precision: str, backend_version: Optional[str], scratch: str,
                   kv_cache_dtype: str = "auto", block_fp8_gemms: str = "tables"):
    """AIConfigurator's compiled engine for the deployment, and the Deployment;
    `block_fp8_gemms` (BLOCK_FP8_GEMMS): which tables price dense GEMMs in
    block-scaled fp8."""
    engine = _aic()
    known = systems()
    if system not in known:
        raise ProfileToolError(f"--system {system}: no vLLM tables for it; the tables serve: {', '.join(known)}")
    versions = table_versions(system)
    if backend_version is not None and backend_version not in versions:
        raise ProfileToolError(
            f"--backend-version {backend_version}: {system} has vLLM tables of {', '.join(versions)} only"
        )
    if precision not in PRECISIONS:
        raise ProfileToolError(f"--precision {precision}: one of {', '.join(PRECISIONS)}")
    path = resolve_model(model, scratch)
    if block_fp8_gemms not in BLOCK_FP8_GEMMS:
        raise ProfileToolError(f"--block-fp8-gemms {block_fp8_gemms}: one of {', '.join(BLOCK_FP8_GEMMS)}")
    gemm, kv = quant_modes(precision, kv_cache_dtype)
    version = backend_version or (versions[-1] if versions else "?")
    # the library loads a system's tables once per process and says which it filled from other
    # data only then, and which it fills depends on the model that loaded them: a fresh load per
    # profile, so that its header is the same whatever the process compiled before
    from aiconfigurator_core.sdk import perf_database

    perf_database.unload_database(system, "vllm", version)
    notes = _Fallbacks()
    root = logging.getLogger("aiconfigurator_core")
    root.addHandler(notes)
    try:
        # the model's own check comes first (e.g. block-fp8 experts that TP splits off their 128-wide blocks)
        modes = checkpoint_modes(path, tp, precision, kv_cache_dtype)
        moe = gemm
        if block_fp8_gemms == "per-tensor":
            if modes["gemm"] != "fp8_block":
                raise ProfileToolError(f"--block-fp8-gemms per-tensor: {model} at --precision {precision} runs its dense "
                                       f"layers in {modes['gemm']}, not block-scaled fp8 (fp8_block)")  # fmt: skip
            # the dense layers from the per-tensor fp8 tables, the experts as the checkpoint runs them
            gemm, moe = "fp8", modes["moe"]
        handle = engine.EngineHandle.compile(
            path, system, "vllm", backend_version=backend_version, tp_size=tp, moe_tp_size=tp, gemm_quant_mode=gemm,
            kvcache_quant_mode=kv, moe_quant_mode=moe,
        )  # fmt: skip
        handle.predict_decode_latency(1, 128)
    except (ValueError, KeyError, AssertionError, RuntimeError) as exc:
        raise ProfileToolError(
            f"the tables cannot serve {model} on {system} at TP {tp}, {precision}: {exc} "
            f"(systems: {', '.join(known)}; precisions: {', '.join(PRECISIONS)}; TP: 1, 2, 4, 8 within a node)"
        ) from None
    finally:
        root.removeHandler(notes)
    fallbacks = sorted({_short_fallback(n) for n in notes.notes})
    return handle, Deployment(system, model, tp, precision, version, fallbacks, modes["gemm"], block_fp8_gemms)


def dense_gemm_ms(handle, decodes: int = 1, context: int = 128) -> Tuple[float, float]:
    """The dense layers' GEMMs (AIConfigurator's `*_gemm` ops but the MoE
    router's) in a decode step of `decodes` requests holding `context`
    tokens each, and the whole step, ms."""
    return ops_ms(handle, 0, decodes, context, lambda name: name.endswith("_gemm") and "router" not in name)


def block_fp8_note(handle, dep: Deployment) -> List[str]:
    """The header's lines on dense GEMMs in block-scaled fp8, which
    AIConfigurator's vLLM collector times without CUDA graphs (its
    collect_gemm.py: `use_cuda_graph=gemm_type != "fp8_block"`), so that
    each entry holds its call's host time, flat over small shapes, while
    every other table, and a GPU's decode step, runs under CUDA graphs."""
    if dep.dense_gemms != "fp8_block" and dep.block_fp8_gemms == "tables":
        return []
    gemms, step = dense_gemm_ms(handle)
    if dep.block_fp8_gemms == "per-tensor":
        return [f"dense GEMMs (block-scaled fp8) priced with the per-tensor fp8 tables, timed under CUDA graphs "
                f"(--block-fp8-gemms per-tensor): {gemms:.2f} ms of a decode step of 1 request ({step:.2f} ms)"]  # fmt: skip
    return [
        f"dense GEMMs in block-scaled fp8: {gemms:.2f} ms of a decode step of 1 request ({step:.2f} ms); AIConfigurator "
        "times them without CUDA graphs,",
        "  each with its call's host time, which a GPU's graphed decode step does not pay; --block-fp8-gemms per-tensor "
        "prices them as per-tensor fp8 (docs/gpu-profiles.md)",
    ]


def monotone(step_ms: Sequence[float]) -> Tuple[float, ...]:
    """The decode steps at 1, 2, 4, ... requests made non-decreasing: each
    the least of it and those of the larger batches. A step of more
    requests does the work of a smaller one and more; where the tables put
    a small batch above a larger one (a GEMM tactic measured slow at that
    size: B200's fp8 steps of 1-4 requests are 15-50 % above that of 8) a
    real engine's step is not, and the profile does not make the step of a
    request more costly than that of several."""
    out = list(step_ms)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(round(v, 4) for v in out)


def ops_ms(handle, prompt_tokens: int, decodes: int, isl: int, keep) -> Tuple[float, float]:
    """The ops of a step (AIConfigurator's per-op breakdown of `prompt_tokens`
    beside `decodes` requests, its prompts of `isl` tokens) whose name `keep`
    accepts, and the whole step, ms."""
    shared = handle.mixed_step_breakdown_per_op(prompt_tokens, decodes, isl, 2)[0]
    return sum(op[1] for op in shared if keep(op[0])), sum(op[1] for op in shared)


def moe_prefill_ms(handle, tokens: int) -> float:
    """The MoE layers' experts (AIConfigurator's `context_moe` op) in a
    prompt of `tokens`, ms; 0 for a model without them."""
    return ops_ms(handle, tokens, 0, tokens, lambda name: name == "context_moe")[0]


def comm_ms(handle, prompt_tokens: int, decodes: int) -> float:
    """A step's tensor-parallel communication, ms: AIConfigurator's
    all-reduces (`*_ar`, `*_ar_N`) and a MoE layer's dispatch (`*_dispatch`),
    in a step of `prompt_tokens` and `decodes`; 0 at TP 1."""
    return ops_ms(handle, prompt_tokens, decodes, max(prompt_tokens, 1024),
                  lambda name: re.search(r"_ar(_\d+)?$|_dispatch$", name) is not None)[0]


def tabulate(handle, max_num_seqs: int, max_num_batched_tokens: int, moe_prefill_scale: float = 1.0,
             decode_comm_scale: float = 1.0) -> Tuple[StepProfile, List[str]]:
    """The profile fitted to the engine's estimates, and the header lines
    with its error against them and against mixed steps; with a
    `moe_prefill_scale` other than 1, the prompt chunks' MoE experts times
    it, with a `decode_comm_scale`, the decode steps' communication (after
    the errors are taken: they are the fit's)."""
    lo, hi = CONTEXTS
    batches = [1]
    while batches[-1] * 2 <= max_num_seqs:
        batches.append(batches[-1] * 2)
    if batches[-1] != max_num_seqs:
        batches.append(max_num_seqs)
    short = {b: handle.predict_decode_latency(b, lo) for b in batches}
    long_ = {b: handle.predict_decode_latency(b, hi) for b in batches}
    slopes = sorted((long_[b] - short[b]) / (b * (hi - lo)) * 1000.0 for b in batches)
    context = max(0.0, slopes[len(slopes) // 2])
    step_ms = monotone([max(0.0, short[b] - context * b * lo / 1000.0) for b in batches])
    base = StepProfile(tuple(batches), step_ms, context_ms_per_ktoken=context)
    # the prompt's attention: how a chunk's estimate grows with the position it starts at
    points = []
    slopes = []
    for n in PREFILL_TOKENS:
        if n > max_num_batched_tokens:
            continue
        at_start = handle.predict_prefill_latency(1, n, 0)
        for p in PREFILL_POSITIONS:
            measured = at_start if p == 0 else handle.predict_prefill_latency(1, p + n, p)
            points.append((n, p, n * (p + n / 2.0), measured))
            if p:
                slopes.append((measured - at_start - context * p / 1000.0) / (n * p / 1000.0))
    slopes.sort()
    attention = max(0.0, slopes[len(slopes) // 2]) if slopes else 0.0
    # the chunk's tokens: what a step that computes them costs beyond its batch, its context and
    # their attention; mostly from steps that decode beside the chunk (chunked prefill under load),
    # a step that only prefills (an idle engine's) weighing PREFILL_ONLY_WEIGHT of one of those
    table_tokens, table_ms = [], []
    for n in PREFILL_TOKENS:
        if n > max_num_batched_tokens:
            continue
        samples = [(PREFILL_ONLY_WEIGHT, handle.predict_prefill_latency(1, n, 0) - base.predict_ms(1, context_tokens=n))]
        for gen in MIXED_DECODES:
            if gen + 1 <= max_num_seqs:
                measured = handle.mixed_step_latency(n, gen, n, 2)  # the chunk: one prompt (MIXED_DECODES)
                samples.append((1.0, measured - base.predict_ms(gen + 1, context_tokens=gen * n + n)))
        rest = sum(w * v for w, v in samples) / sum(w for w, _ in samples) - attention * n * n / 2.0 / 1000.0
        table_tokens.append(n)
        table_ms.append(round(max(0.0, rest), 4))
    profile = StepProfile(
        tuple(batches), step_ms, prefill_tokens=tuple(table_tokens), prefill_ms=tuple(table_ms),
        prefill_attention_ms=round(attention, 9), context_ms_per_ktoken=round(context, 6),
    )  # fmt: skip

    def err(predicted: float, measured: float) -> float:
        return abs(predicted / measured - 1.0) * 100.0

    decode_err = [err(profile.predict_ms(b, context_tokens=b * c), handle.predict_decode_latency(b, c)) for b in batches for c in (lo, 1024, hi)]
    prefill_err = [err(profile.predict_ms(1, n, a, p + n, 1), m) for n, p, a, m in points]
    mixed_err = []
    for gen, ctx in MIXED_CHECKS:
        if gen + 1 > max_num_seqs or ctx > max_num_batched_tokens:
            continue
        measured = handle.mixed_step_latency(ctx, gen, ctx, 2)
        predicted = profile.predict_ms(gen + 1, ctx, ctx * ctx / 2.0, gen * ctx + ctx, 1)
        mixed_err.append(err(predicted, measured))

    def summary(values: List[float]) -> str:
        values = sorted(values)
        return f"median {values[len(values) // 2]:.1f} %, max {values[-1]:.1f} % over {len(values)}" if values else "none"

    lines = [
        f"fit error against the estimates: decode steps (batch 1-{max_num_seqs} x context {lo}/1024/{hi}) {summary(decode_err)};",
        f"  prefill chunks (16-{max_num_batched_tokens} tokens from position 0/2048/8192) {summary(prefill_err)};",
        f"  mixed steps (decodes + a prompt chunk, at other sizes than fitted) {summary(mixed_err)}",
    ]
    if moe_prefill_scale != 1.0:
        moe = [moe_prefill_ms(handle, n) for n in table_tokens]
        if not any(moe):
            raise ProfileToolError("--moe-prefill-scale: the model has no MoE layers")
        scaled = tuple(round(ms + (moe_prefill_scale - 1.0) * m, 4) for ms, m in zip(table_ms, moe))
        profile = dataclasses.replace(profile, prefill_ms=scaled)
        added = dict(zip(table_tokens, (scaled[i] - table_ms[i] for i in range(len(scaled)))))
        lines.append(f"prompt chunks' MoE experts (context_moe) x {moe_prefill_scale:g} (--moe-prefill-scale): "
                     + ", ".join(f"{added[n]:+.1f} ms at {n}" for n in (1024, 8192) if n in added) + " tokens")  # fmt: skip
    if decode_comm_scale != 1.0:
        added = [(decode_comm_scale - 1.0) * comm_ms(handle, 0, b) for b in batches]
        profile = dataclasses.replace(profile, step_ms=tuple(round(ms + a, 4) for ms, a in zip(profile.step_ms, added)))
        lines.append(f"decode steps' tensor-parallel communication x {decode_comm_scale:g} (--decode-comm-scale): "
                     f"{added[0]:+.2f} ms a step of 1, {added[-1]:+.2f} of {batches[-1]}")  # fmt: skip
    return profile, lines


def build(system: str, model: str, tp: int, precision: str, backend_version: Optional[str], path: str,
          moe_prefill_scale: float = 1.0, kv_cache_dtype: str = "auto", decode_comm_scale: float = 1.0,
          block_fp8_gemms: str = "tables") -> str:
    """The profile file's text for the deployment (ProfileToolError: what the tables cannot serve)."""
    if tp not in (1, 2, 4, 8):
        raise ProfileToolError(f"--tp {tp}: the tables serve TP 1, 2, 4 or 8 (one node)")
    scratch = tempfile.mkdtemp(prefix="gmock-profile-")
    try:
        handle, dep = compile_engine(system, model, tp, precision, backend_version, scratch, kv_cache_dtype, block_fp8_gemms)
        limits = vllm_limits(system)
        profile, fit_lines = tabulate(handle, limits[1], limits[0], moe_prefill_scale, decode_comm_scale)
        fit_lines += block_fp8_note(handle, dep)
        budget = memory_budget(system, resolve_model(model, scratch), tp, precision, limits[0], kv_cache_dtype)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if budget["kv_cache"] <= budget["kv_per_token"] * BLOCK_SIZE:
        raise ProfileToolError(
            f"{model} at TP {tp} ({precision}) does not fit {system}: weights {budget['weights'] / GIB:.1f} GiB per rank "
            f"of {GPU_MEMORY_UTILIZATION * gpu_memory(system) / GIB:.1f}; try a larger --tp"
        )
    import aiconfigurator_core

    version = getattr(aiconfigurator_core, "__version__", None) or _dist_version()
    model_name = os.path.basename(model) if os.path.isfile(model) else model
    header = [
        f"{model_name} on {dep.system}, TP {tp}, {precision}"
        + (f", KV cache {kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + f": vLLM {dep.backend_version} tables of AIConfigurator core {version}",
        f"written by: ./run.sh profile --system {system} --model {model} --tp {tp} --precision {precision}"
        + (f" --backend-version {backend_version}" if backend_version else "")
        + (f" --moe-prefill-scale {moe_prefill_scale:g}" if moe_prefill_scale != 1.0 else "")
        + (f" --kv-cache-dtype {kv_cache_dtype}" if kv_cache_dtype != "auto" else "")
        + (f" --decode-comm-scale {decode_comm_scale:g}" if decode_comm_scale != 1.0 else "")
        + (f" --block-fp8-gemms {block_fp8_gemms}" if block_fp8_gemms != "tables" else "") + f" -o {path}",
        "Serve as that deployment: ./run.sh serve --config THIS_FILE (docs/gpu-profiles.md)",
        *fit_lines,
    ]
    if dep.fallbacks:
        header.append("tables estimated from another system's, framework's or version's data:")
        header += [f"  {note}" for note in dep.fallbacks]
    else:
        header.append("every table from this system's vLLM data")
    return format_profile(profile, header) + "\n" + "\n".join(engine_section(dep, budget, limits, path)) + "\n"


def build_from(args: Any) -> str:
    """The profile file's text for the parsed options of `./run.sh profile`."""
    return build(args.system, args.model, args.tp, args.precision, args.backend_version, args.output, args.moe_prefill_scale,
                 args.kv_cache_dtype, args.decode_comm_scale, args.block_fp8_gemms)


def _dist_version() -> str:
    try:
        from importlib.metadata import version

        return version("aiconfigurator-core")
    except Exception:  # noqa: BLE001 - only for the header
        return "?"


PROFILE_ENV_PREFIX = ENV_PREFIX + "PROFILE_"
GROUPS = (
    Group(
        None,
        (
            Option("--system", "AIConfigurator's system name: h100_sxm, h200_sxm, a100_sxm, b200_sxm, ... (an unknown one lists them)",
                   type=nonempty),  # fmt: skip
            Option("--model", "a model AIConfigurator lists (e.g. meta-llama/Llama-3.1-70B), or the path of its Hugging Face config.json",
                   type=nonempty),  # fmt: skip
            Option("--tp", "tensor-parallel size: the GPUs of one engine", default=1, type=int_at_least(1, 64)),
            Option("--precision", "the weights' precision (fp8, fp4: KV cache in fp8; native: the checkpoint's own, as its config says)",
                   default="bf16", type=choice(tuple(PRECISIONS))),  # fmt: skip
            Option("--backend-version", "vLLM version of the tables (default: the newest the system has)"),
            Option("--moe-prefill-scale", "the MoE experts' time in prompt chunks times this (1: the tables' kernel; "
                   "docs/gpu-profiles.md: Hopper's Marlin MXFP4 experts, which the tables do not measure)",
                   default=1.0, type=float_in(0.1, 10.0)),  # fmt: skip
            Option("--kv-cache-dtype", "the KV cache's element type, as vLLM's --kv-cache-dtype (auto: the precision's: "
                   "fp8 with fp8 and fp4 weights, else bf16): the attention's tables and the KV blocks' bytes",
                   default="auto", type=choice(("auto", *KV_CACHE_DTYPES))),  # fmt: skip
            Option("--decode-comm-scale", "the decode steps' tensor-parallel communication (all-reduces, MoE dispatch) "
                   "times this (1: the tables', as in every shipped profile; docs/gpu-profiles.md: why 2, chosen on H100, is not shipped)",
                   default=1.0, type=float_in(0.1, 10.0)),  # fmt: skip
            Option("--block-fp8-gemms", "which tables price dense GEMMs in block-scaled fp8 (tables: their own, timed "
                   "without CUDA graphs, as in every shipped profile; per-tensor: the per-tensor fp8 ones, timed under "
                   "CUDA graphs; docs/gpu-profiles.md)", default="tables", type=choice(BLOCK_FP8_GEMMS)),  # fmt: skip
            Option("--output", "the profile file to write", default="profile.ini", type=nonempty, aliases=("-o",)),
        ),
    ),
)


def build_profile_parser() -> Any:
    """The parser of `./run.sh profile`'s options."""
    parser = new_parser(
        "gmock-engine profile",
        "A latency profile of a GPU deployment from AIConfigurator's step estimates, with its vLLM limits "
        "(docs/gpu-profiles.md).",
        "Each option can also be set as environment variable GMOCK_PROFILE_<FLAG> or as key <flag> in section "
        f"[{PROFILE_SECTION}] of the --config file. Precedence: command line > environment > config file > default.",
        ini_reader(PROFILE_SECTION),
        PROFILE_ENV_PREFIX,
        f"INI config file with a [{PROFILE_SECTION}] section (keys = long flag names)",
    )
    add_groups(parser, GROUPS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gmock-engine profile`: 0, or 2 with a message saying what the tables can serve."""
    try:
        args = parse_tool_config(build_profile_parser(), PROFILE_SECTION, sys.argv[1:] if argv is None else argv)
        for name in ("system", "model"):
            if not getattr(args, name):
                raise ConfigError(f"argument --{name}: required (./run.sh profile --help)")
    except ConfigError as exc:
        print(f"gmock-engine profile: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("aiconfigurator_core").setLevel(logging.WARNING)
    logging.getLogger("aiconfigurator_core").propagate = False
    try:
        text = build_from(args)
    except ProfileToolError as exc:
        print(f"gmock-engine profile: {exc}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"gmock-engine profile: wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
