"""An evaluation harness nobody here wrote: EleutherAI's lm-eval runs a
loglikelihood (multiple-choice) task offline through the real frontends,
with a custom task YAML over a local JSON dataset (no hub). Loglikelihood
tasks send completions with `echo` + `logprobs` and read the prompt's and
continuation's token logprobs back: they need prompt logprobs and echo.

lm-eval is installed by this module into its own venv in the frontends'
cache ($GMOCK_FRONTENDS_HOME/lmeval-venv, ~1 min and ~0.9 GB the first time;
no torch: the API model only needs a tokenizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import e2e_harness as h
from test_frontends import DP1_TOPOLOGIES

#: The Python frontend only: vllm-rs 0.33 answers lm-eval's batched token-id
#: prompts (`"prompt": [[ids]]`) with 400 "data did not match any variant of
#: untagged enum Prompt" (docs/logprobs.md).
pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES[:1], indirect=True, ids=lambda t: t.id)]

LM_EVAL = "lm-eval[api]==0.4.13"

DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " square", " late"], "answer": 0},
]


@pytest.fixture(scope="session")
def lm_eval_bin() -> Path:
    """lm_eval's CLI from its own venv (installed once, then reused)."""
    venv = h.frontends_home() / "lmeval-venv"
    stamp = venv / ".gmock-installed"
    if not stamp.exists() or stamp.read_text() != LM_EVAL:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        proc = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", LM_EVAL, "transformers"],
            capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            pytest.fail(f"installing {LM_EVAL} failed (rc={proc.returncode}); retry, or remove {venv}:\n{proc.stderr[-2000:]}")
        stamp.write_text(LM_EVAL)
    return venv / "bin" / "lm_eval"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "gmock_mc.yaml").write_text(
        textwrap.dedent(
            f"""\
            task: gmock_mc
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            output_type: multiple_choice
            doc_to_text: "{{{{question}}}}"
            doc_to_choice: "{{{{choices}}}}"
            doc_to_target: "{{{{answer}}}}"
            metric_list:
              - metric: acc
                aggregation: mean
                higher_is_better: true
            """
        )
    )
    return folder


def test_lm_eval_loglikelihood_task_runs_offline(stack, lm_eval_bin, task_dir, model_dir, tmp_path):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    model_args = (
        f"model={h.MODEL_NAME},base_url={stack.base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=2,max_retries=1"
    )
    proc = subprocess.run(
        [str(lm_eval_bin), "--model", "local-completions", "--model_args", model_args, "--tasks", "gmock_mc",
         "--include_path", str(task_dir), "--output_path", str(tmp_path / "out"), "--log_samples"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, f"lm_eval rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    [samples_file] = list((tmp_path / "out").rglob("samples_gmock_mc_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for sample, doc in zip(sorted(samples, key=lambda s: s["doc_id"]), DOCS):
        # one (loglikelihood, is_greedy) per choice: a real number <= 0 for each continuation
        scores = [float(ll) for ll, _greedy in sample["filtered_resps"]]
        assert len(scores) == len(doc["choices"]) and all(s <= 0 and s > -1e4 for s in scores), sample["filtered_resps"]
        assert sample["acc"] in (0.0, 1.0)
    [results_file] = list((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(results_file.read_text())["results"]["gmock_mc"]["acc,none"]
    print(f"lm-eval gmock_mc through {stack.topology.id}: acc {acc:.3f} over {len(DOCS)} docs")
    assert 0.0 <= acc <= 1.0
