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
WORKER_UNIT = DEPLOY / "systemd" / "dart-worker@.service"
WORKERS = DEPLOY / "k8s" / "workers.yaml"
WORKER_DOCKERFILE = DEPLOY / "docker" / "Dockerfile.worker"
PROTO = REPO / "proto" / "dart" / "ngram" / "v1" / "ngram.proto"


@cache
def help_text(subcommand: str) -> str:
    """What ``dart-ngram SUBCOMMAND --help`` prints."""
    return subprocess.run(
        [str(dart_ngram_binary()), subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout


def help_flags(subcommand: str) -> frozenset[str]:
    """The long flags ``dart-ngram SUBCOMMAND --help`` lists."""
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", help_text(subcommand)))


def positionals(argv: list[str], subcommand: str) -> list[str]:
    """The arguments that are neither flags nor the values of flags taking one (those
    ``--help`` shows with a ``<VALUE>``)."""
    valued = set(re.findall(r"(--[a-z][a-z0-9-]*)[ =]<", help_text(subcommand)))
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("--"):
            skip = a in valued
        else:
            kept.append(a)
    return kept


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


def dockerfile_image(dockerfile: Path = DOCKERFILE) -> str:
    """The image name the Dockerfile's build command tags."""
    m = re.search(r"docker build .*-t (\S+) \.", dockerfile.read_text())
    assert m, f"{dockerfile}: no `docker build ... -t IMAGE .` line"
    return m.group(1)


@cache
def serve_flags() -> frozenset[str]:
    """The long flags of ``dart serve`` (its real argument parser)."""
    app = pytest.importorskip("dart_client.apps.serve.app", reason="needs the `serve` extra")
    parser = app.build_parser()
    return frozenset(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


# -- systemd ----------------------------------------------------------------------------------


def unit_entries(unit: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """The unit file as section -> key -> values (continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in unit.read_text().splitlines():
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
        assert current is not None, f"{unit}: {line!r} outside a section"
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
    inputs = positionals(argv[2:], "merge")
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


# -- the GPU workers (dart serve) -----------------------------------------------------------------


def test_worker_unit_runs_dart_serve_against_the_daemon_unit() -> None:
    unit = unit_entries(WORKER_UNIT)
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"][0])
    assert Path(argv[0]).name == "dart" and argv[1] == "serve"
    assert flags_of(argv[2:]) <= serve_flags(), flags_of(argv[2:]) - serve_flags()
    # The worker reaches the daemon where the daemon's unit listens, and starts after it.
    daemon = shlex.split(unit_entries(UNIT)["Service"]["ExecStart"][0])
    assert flag_value(argv, "--ngram-server") == flag_value(daemon, "--listen")
    assert unit["Unit"]["Requires"] == [UNIT.name]
    assert UNIT.name in unit["Unit"]["After"][0].split()
    # One instance per GPU: %i picks the device and the port.
    assert "CUDA_VISIBLE_DEVICES=%i" in service["Environment"][0].split()
    assert flag_value(argv, "--port") == "800%i"
    assert flag_value(argv, "--host") == "127.0.0.1"
    for path in ("--base", "--head"):
        assert Path(flag_value(argv, path)).is_relative_to(service["ReadOnlyPaths"][0])
    grace = float(flag_value(argv, "--shutdown-grace"))
    assert float(service["TimeoutStopSec"][0]) > grace
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["DynamicUser"] == ["yes"] and service["NoNewPrivileges"] == ["yes"]


def test_worker_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`)")
    dart = shutil.which("dart") or shutil.which("python3")
    assert dart is not None
    # An instance of the template; ExecStart pointed at an existing executable, the daemon
    # unit it requires beside it.
    text = WORKER_UNIT.read_text().replace("/opt/dart/bin/dart", dart)
    copy = tmp_path / "dart-worker@0.service"
    copy.write_text(text)
    daemon = UNIT.read_text().replace("/usr/local/bin/dart-ngram", str(dart_ngram_binary()))
    (tmp_path / UNIT.name).write_text(daemon)
    res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in res.stderr.splitlines() if "dart-worker" in line]
    assert res.returncode == 0 and not complaints, res.stderr


def test_worker_deployment_requests_gpus_probes_health_and_uses_the_daemon() -> None:
    docs = load_docs(WORKERS)
    deployment = of_kind(docs, "Deployment")
    svc = of_kind(docs, "Service")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    daemonset = of_kind(load_docs(DAEMONSET), "DaemonSet")
    assert deployment["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == dockerfile_image(WORKER_DOCKERFILE)
    assert container["image"].endswith(":" + workspace_version())
    args = container["args"]
    assert args[0] == "serve"
    assert flags_of(args) <= serve_flags(), flags_of(args) - serve_flags()
    # The daemon's Service, in the daemon's namespace, on its gRPC port.
    daemon_svc = of_kind(load_docs(DAEMONSET), "Service")
    host, port = flag_value(args, "--ngram-server").rsplit(":", 1)
    ns = daemon_svc["metadata"]["namespace"]
    assert host == f"{daemon_svc['metadata']['name']}.{ns}.svc"
    assert int(port) in {p["port"] for p in daemon_svc["spec"]["ports"] if p["name"] == "grpc"}
    http = int(flag_value(args, "--port"))
    assert flag_value(args, "--host") == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": http}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": http}, probe
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == http
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    for part in ("requests", "limits"):
        assert int(container["resources"][part]["nvidia.com/gpu"]) >= 1, part
    assert flag_value(args, "--device").startswith("cuda")
    # The API key comes from a Secret through the variable `dart serve` reads.
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["DART_API_KEY"]["valueFrom"]
    mounts = {m["name"]: Path(m["mountPath"]) for m in container["volumeMounts"]}
    for flag in ("--base", "--head"):
        assert any(Path(flag_value(args, flag)).is_relative_to(p) for p in mounts.values())
    grace = float(flag_value(args, "--shutdown-grace"))
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == "http" and svc_port["port"] == http


def test_worker_dockerfile_builds_the_package_the_deployment_runs() -> None:
    text = WORKER_DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert len([line for line in lines if line.startswith("FROM ")]) == 2
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _dest = line.split()[1:]
            for src in sources:
                assert (REPO / src).exists(), f"{WORKER_DOCKERFILE}: COPY {src}: no such path"
    assert "maturin build --release --locked" in text
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^name = "dart-client"$', pyproject, re.M)
    assert re.search(r"^serve = \[", pyproject, re.M), "the `serve` extra the image installs"
    assert "[serve,gguf]" in text
    assert re.search(r'^dart = "dart_client\.apps\.cli:main"$', pyproject, re.M)
    entry = next(line for line in lines if line.startswith("ENTRYPOINT"))
    assert entry.endswith('["dart"]')
    exposed = {int(p) for line in lines if line.startswith("EXPOSE ") for p in line.split()[1:]}
    deployment = of_kind(load_docs(WORKERS), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in container["ports"]} <= exposed
    user = next(line for line in lines if line.startswith("USER "))
    uid = int(user.split()[1].split(":")[0])
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
