"""Checks of deploy/: every file is valid for its tool and names binaries, flags, images, ports,
probes and services that really exist (the ``dart-ngram`` binary's own ``--help``, the .proto,
the Dockerfile)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml
from _daemon_util import REPO, dart_ngram_binary

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "dart-ngram.service"
DAEMONSET = DEPLOY / "k8s" / "daemonset.yaml"
BUILD_JOB = DEPLOY / "k8s" / "build-job.yaml"
MERGE_JOB = DEPLOY / "k8s" / "merge-job.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
PROTO = REPO / "proto" / "dart" / "ngram" / "v1" / "ngram.proto"


@cache
def help_flags(subcommand: str) -> frozenset[str]:
    """The long flags ``dart-ngram SUBCOMMAND --help`` lists."""
    out = subprocess.run(
        [str(dart_ngram_binary()), subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", out))


def flags_of(argv: list[str]) -> set[str]:
    """Long flags used in an argument list (``--x=v`` and ``--x v`` forms)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def flag_value(argv: list[str], flag: str) -> str:
    for i, a in enumerate(argv):
        if a == flag:
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def proto_service_name() -> str:
    text = PROTO.read_text()
    package = re.search(r"^package\s+([\w.]+);", text, re.M)
    service = re.search(r"^service\s+(\w+)\s*\{", text, re.M)
    assert package and service, f"{PROTO}: no package or service"
    return f"{package.group(1)}.{service.group(1)}"


def workspace_version() -> str:
    text = (REPO / "Cargo.toml").read_text()
    m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    assert m, "Cargo.toml: no [workspace.package] version"
    return m.group(1)


def load_docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no YAML documents"
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"{path}: {d.get('kind')}"
    return docs


def of_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def dockerfile_image() -> str:
    """The image name the Dockerfile's build command tags."""
    m = re.search(r"docker build .*-t (\S+) \.", DOCKERFILE.read_text())
    assert m, f"{DOCKERFILE}: no `docker build ... -t IMAGE .` line"
    return m.group(1)


# -- systemd ----------------------------------------------------------------------------------


def unit_entries() -> dict[str, dict[str, list[str]]]:
    """The unit file as section -> key -> values (continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in UNIT.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{UNIT}: {line!r} outside a section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_runs_serve_with_real_flags_and_hardening() -> None:
    unit = unit_entries()
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"][0])
    assert Path(argv[0]).name == "dart-ngram" and argv[1] == "serve"
    assert flags_of(argv[2:]) <= help_flags("serve"), flags_of(argv[2:]) - help_flags("serve")
    listen = flag_value(argv, "--listen")
    assert listen.startswith("127.0.0.1:"), "the unit keeps the daemon on loopback"
    assert "--numa-node" in argv
    model = Path(flag_value(argv, "--model"))
    assert any(model.is_relative_to(p) for p in service["ReadOnlyPaths"][0].split())
    assert unit["Unit"]["ConditionPathExists"] == [str(model)]
    assert service["Restart"] == ["on-failure"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["DynamicUser"] == ["yes"] or "User" in service
    if "--lock" in argv:
        assert service["LimitMEMLOCK"] == ["infinity"]
    assert service["KillSignal"] == ["SIGTERM"]
    # SIGHUP reloads the model (the daemon watches it; by default it would kill the process).
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`)")
    # verify checks that ExecStart's binary exists and is executable: point it at the real
    # build of dart-ngram instead of the install path.
    text = UNIT.read_text().replace("/usr/local/bin/dart-ngram", str(dart_ngram_binary()))
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only warnings (exit status 0): refuse those too.
    complaints = [line for line in res.stderr.splitlines() if copy.name in line]
    assert res.returncode == 0 and not complaints, res.stderr


# -- Kubernetes -------------------------------------------------------------------------------


def test_daemonset_service_ports_probes_and_image_exist() -> None:
    docs = load_docs(DAEMONSET)
    ds = of_kind(docs, "DaemonSet")
    svc = of_kind(docs, "Service")
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert ds["metadata"]["namespace"] == svc["metadata"]["namespace"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == dockerfile_image()
    assert container["image"].endswith(":" + workspace_version())

    args = container["args"]
    assert args[0] == "serve"
    assert flags_of(args) <= help_flags("serve"), flags_of(args) - help_flags("serve")
    grpc_port = int(flag_value(args, "--listen").rsplit(":", 1)[1])
    metrics_port = int(flag_value(args, "--metrics-listen").rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}

    service_name = proto_service_name()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = container[probe]["grpc"]
        assert grpc_probe["port"] == grpc_port, probe
        # The health service answers for "" (the server) and the n-gram service's name.
        assert grpc_probe.get("service", "") in ("", service_name), probe
    assert container["readinessProbe"]["grpc"]["service"] == service_name

    # The model the daemon opens lies in a mounted volume.
    model = Path(flag_value(args, "--model"))
    mounts = {m["name"]: Path(m["mountPath"]) for m in container["volumeMounts"]}
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert any(model.is_relative_to(p) and n in volumes for n, p in mounts.items())

    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["grpc"]["targetPort"] in ports
    assert svc_ports["grpc"]["port"] == grpc_port
    assert svc_ports["metrics"]["targetPort"] in ports
    annotations = pod["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port
    # SIGTERM drains within the daemon's grace; the pod's must be longer.
    grace = float(flag_value(args, "--shutdown-grace")) if "--shutdown-grace" in args else 30
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace


def job_command(path: Path) -> tuple[dict, list[str]]:
    job = of_kind(load_docs(path), "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == dockerfile_image()
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    argv = shlex.split(script)
    if argv[0] == "exec":
        argv = argv[1:]
    assert argv[0] == "dart-ngram"
    return job, argv


def test_build_job_is_indexed_and_uses_real_build_flags() -> None:
    job, argv = job_command(BUILD_JOB)
    assert argv[1] == "build"
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] >= 2
    assert flags_of(argv[2:]) <= help_flags("build"), flags_of(argv[2:]) - help_flags("build")
    # The shard index selects the input and names the output.
    assert "${JOB_COMPLETION_INDEX}" in flag_value(argv, "--input")
    assert "${JOB_COMPLETION_INDEX}" in flag_value(argv, "--output")


def test_merge_job_merges_every_shard_the_build_job_writes() -> None:
    build, build_argv = job_command(BUILD_JOB)
    _, argv = job_command(MERGE_JOB)
    assert argv[1] == "merge"
    assert flags_of(argv[2:]) <= help_flags("merge"), flags_of(argv[2:]) - help_flags("merge")
    output = flag_value(argv, "--output")
    inputs = [a for a in argv[2:] if not a.startswith("--") and a not in (output, "1")]
    pattern = flag_value(build_argv, "--output")
    expected = [
        pattern.replace("${JOB_COMPLETION_INDEX}", str(i))
        for i in range(build["spec"]["completions"])
    ]
    assert inputs == expected
    # Pruned shards do not add up: the build must not prune (merge may).
    assert "--min-count" not in build_argv or flag_value(build_argv, "--min-count") == "1"


# -- Docker -----------------------------------------------------------------------------------


def test_dockerfile_builds_the_binary_the_manifests_run() -> None:
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    froms = [line for line in lines if line.startswith("FROM ")]
    assert len(froms) == 2, "a build stage and a runtime stage"
    # Every COPY from the build context names a path that exists in the repository.
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (REPO / src).exists(), f"{DOCKERFILE}: COPY {src}: no such path"
    assert "cargo build --release --locked -p dart-ngram-cli" in text
    cli = (REPO / "rust" / "cli" / "Cargo.toml").read_text()
    assert re.search(r'^name = "dart-ngram-cli"$', cli, re.M)
    assert re.search(r'\[\[bin\]\]\s*name = "dart-ngram"', cli)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT"))
    assert entry.endswith('["/usr/local/bin/dart-ngram"]')
    exposed = {int(p) for line in lines if line.startswith("EXPOSE ") for p in line.split()[1:]}
    ds = of_kind(load_docs(DAEMONSET), "DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in container["ports"]} <= exposed
    user = next(line for line in lines if line.startswith("USER "))
    uid = int(user.split()[1].split(":")[0])
    assert ds["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
