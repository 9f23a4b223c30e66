"""The deployment files (deploy/k8s/, Dockerfile, .dockerignore), checked without
a cluster or a docker daemon: every YAML document parses, the fields that tie
the frontend and the engine pods together agree, the engine pods' start ranks
come out of their ordinals as intended (the manifest's own shell command, run
with a stub gmock-engine, then the real config parser), and the Dockerfile
builds the package from the files it copies."""

from __future__ import annotations

import configparser
import json
import re
import shlex
import subprocess
from pathlib import Path

import yaml

from gmock_engine.config.loader import build_parser, env_name, parse_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append(doc)
    return docs


def one(kind: str, name: str) -> dict:
    found = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def flags(args: list[str]) -> dict[str, str]:
    """--name=value arguments as a dict."""
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


FRONTEND = ("Deployment", "gmock-frontend")
ENGINES = ("StatefulSet", "gmock-engine")


def test_every_document_parses_and_names_itself():
    docs = documents()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("Deployment", "gmock-frontend"),
        ("NetworkPolicy", "gmock-frontend"),
        ("Service", "gmock-engine"),
        ("Service", "gmock-frontend"),
        ("Service", "gmock-frontend-handshake"),
        ("StatefulSet", "gmock-engine"),
    ], kinds
    for d in docs:
        assert d["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1"), d["apiVersion"]


def test_selectors_pick_their_pods_and_services_name_real_ports():
    workloads = {name: one(kind, name) for kind, name in (FRONTEND, ENGINES)}
    for w in workloads.values():
        assert labels_match(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
    pod_labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads.items()}
    expected_target = {"gmock-frontend": "gmock-frontend", "gmock-frontend-handshake": "gmock-frontend",
                       "gmock-engine": "gmock-engine"}
    for service, target in expected_target.items():
        svc = one("Service", service)
        assert labels_match(svc["spec"]["selector"], pod_labels[target]), service
        others = [n for n in pod_labels if n != target]
        assert not any(labels_match(svc["spec"]["selector"], pod_labels[n]) for n in others), service
        port_names = {p["name"] for p in container(workloads[target])["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service, port)
    # The StatefulSet's governing Service is headless; the handshake one publishes
    # the frontend before it is ready (its /health waits for the engines).
    assert workloads["gmock-engine"]["spec"]["serviceName"] == "gmock-engine"
    assert one("Service", "gmock-engine")["spec"]["clusterIP"] == "None"
    assert one("Service", "gmock-frontend-handshake")["spec"]["publishNotReadyAddresses"] is True
    # Engines may reach the frontend on any port (INIT names ephemeral ones); clients on HTTP.
    policy = one("NetworkPolicy", "gmock-frontend")["spec"]
    assert labels_match(policy["podSelector"]["matchLabels"], pod_labels["gmock-frontend"])
    engines_rule, clients_rule = policy["ingress"]
    assert labels_match(engines_rule["from"][0]["podSelector"]["matchLabels"], pod_labels["gmock-engine"])
    assert (engines_rule["ports"][0]["port"], engines_rule["ports"][0]["endPort"]) == (1, 65535)
    assert clients_rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_the_engines_join_the_frontend_it_advertises():
    fe = container(one(*FRONTEND))
    fe_flags = flags(fe["args"])
    fe_ports = {p["name"]: p["containerPort"] for p in fe["ports"]}
    # Binds and advertises its own pod IP (never 0.0.0.0), all engines remote.
    assert fe_flags["data-parallel-address"] == "$(POD_IP)"
    pod_ip = next(e for e in fe["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert fe_flags["data-parallel-size-local"] == "0"
    assert int(fe_flags["data-parallel-rpc-port"]) == fe_ports["handshake"]
    assert int(fe_flags["port"]) == fe_ports["http"] and fe_flags["host"] == "0.0.0.0"
    assert int(fe_flags["api-server-count"]) >= 1

    engines = one(*ENGINES)
    env = env_of(container(engines))
    m = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", env["GMOCK_HANDSHAKE_ADDRESS"])
    assert m, env["GMOCK_HANDSHAKE_ADDRESS"]
    handshake_svc = one("Service", m.group(1))
    (svc_port,) = handshake_svc["spec"]["ports"]
    assert int(m.group(2)) == svc_port["port"] == fe_ports[svc_port["targetPort"]]
    # One DP size everywhere: frontend = engines' DP = pods x engines per pod.
    dp = int(fe_flags["data-parallel-size"])
    assert dp == int(env["GMOCK_DATA_PARALLEL_SIZE"]) == engines["spec"]["replicas"] * int(env["GMOCK_ENGINE_COUNT"])
    assert engines["spec"]["podManagementPolicy"] == "Parallel"


def test_every_gmock_variable_of_the_manifest_is_an_option():
    known = {env_name(a) for a in build_parser()._actions if a.option_strings}
    env = env_of(container(one(*ENGINES)))
    unknown = {k for k in env if k.startswith("GMOCK_")} - known
    assert not unknown, unknown


def _engine_argv(tmp_path: Path, hostname: str) -> list[str]:
    """Run the StatefulSet's command as its pod would (HOSTNAME = pod name), with a
    stub gmock-engine that prints the arguments it was given."""
    c = container(one(*ENGINES))
    stub = tmp_path / "gmock-engine"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": hostname, **env_of(c)}
    proc = subprocess.run([*c["command"], *c["args"]], env=env, capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_each_pod_gets_its_slice_of_ranks_from_its_ordinal(tmp_path):
    engines = one(*ENGINES)
    env = env_of(container(engines))
    ranks = []
    for ordinal in range(engines["spec"]["replicas"]):
        argv = _engine_argv(tmp_path, f"{engines['metadata']['name']}-{ordinal}")
        config = parse_config(argv, env=env)  # the real parser: flags, variables, checks
        assert config.handshake_address == env["GMOCK_HANDSHAKE_ADDRESS"]
        assert config.send_dead_on_exit is True
        assert config.data_parallel_start_rank == ordinal * config.engine_count
        ranks.extend(range(config.data_parallel_start_rank, config.data_parallel_start_rank + config.engine_count))
        assert config.data_parallel_size == int(env["GMOCK_DATA_PARALLEL_SIZE"])
    assert ranks == list(range(int(env["GMOCK_DATA_PARALLEL_SIZE"]))), ranks
    # A StatefulSet name with dashes of its own still yields the ordinal.
    assert _engine_argv(tmp_path, "my-mock-engines-12")[:2] == ["--data-parallel-start-rank", "48"]


# --------------------------------------------------------------------------- image


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_installs_the_package_from_what_it_copies():
    steps = dockerfile()
    assert steps[0][0] == "FROM" and re.fullmatch(r"python:3\.\d+-slim", steps[0][1]), steps[0]
    copied = set()
    for word, rest in steps:
        if word == "COPY":
            *sources, _dest = shlex.split(rest)
            copied.update(sources)
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    readme = setup["metadata"]["long_description"].removeprefix("file:").strip()
    assert {"setup.cfg", "setup.py", "gmock_engine", readme} <= copied, copied
    for source in copied:
        assert (REPO / source).exists(), source
    runs = " && ".join(rest for word, rest in steps if word == "RUN")
    assert re.search(r"pip install\b[^&]* \.(\s|$)", runs), runs
    (entrypoint,) = [rest for word, rest in steps if word == "ENTRYPOINT"]
    script = json.loads(entrypoint)  # exec form: signals reach the engine itself
    assert script == ["gmock-engine"]
    assert "gmock-engine = gmock_engine.__main__:main" in setup["options.entry_points"]["console_scripts"]
    # The engine pods run this image.
    assert container(one(*ENGINES))["image"].split(":")[0] == "gmock-engine"


def _ignored(patterns: list[str], path: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/"))
               or path.split("/")[0] == p for p in patterns)


def test_dockerignore_keeps_the_context_small_but_not_what_is_copied():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for unwanted in (".venv", ".git", "tests", "gmock_engine/__pycache__", "gmock_engine/tools/x.pyc", ".pytest_cache"):
        assert _ignored(patterns, unwanted), unwanted
    for needed in ("setup.cfg", "setup.py", "README.md", "gmock_engine", "gmock_engine/runtime/cli.py"):
        assert not _ignored(patterns, needed), needed
