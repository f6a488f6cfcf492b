"""The production n-gram pipeline at small scale, run as deploy/ runs it: the Kubernetes build
Job's own command builds each corpus shard within a small memory budget (so counts spill), the
merge Job's own command joins the shards, and a daemon serves the result. The merged model must
equal a build over the whole corpus, and every prune through the daemon must equal the same
prune in-process."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from _daemon_util import REPO, Daemon, dart_ngram_binary
from conftest import sharegpt_texts

from dart_client.ngram import NGram, connect

SHARDS = 3
K8S = REPO / "deploy" / "k8s"


def job_script(name: str) -> list[str]:
    """The container's shell script of a deploy/k8s Job, as argv."""
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (script,) = container["args"]
    return shlex.split(script)


def run_job(name: str, data: Path, scratch: Path, index: int | None = None) -> dict:
    """Runs a Job's command here: /data and /scratch become directories of the test, and the
    resources shrink to what a CI machine has (a 2 MiB budget makes the shards spill). Returns
    a build's JSON report."""
    argv = job_script(name)
    if argv[0] == "exec":
        argv = argv[1:]
    assert argv[0] == "dart-ngram"
    scaled = {"--memory": "2M", "--threads": "1"}
    out = [str(dart_ngram_binary())]
    for i, arg in enumerate(argv[1:], start=1):
        prev = argv[i - 1]
        arg = scaled.get(prev, arg)
        arg = arg.replace("/data", str(data)).replace("/scratch", str(scratch))
        if index is not None:
            arg = arg.replace("${JOB_COMPLETION_INDEX}", str(index))
        out.append(arg)
    if name == "merge-job.yaml":
        # The manifest merges the 8 shards its build Job writes; this corpus has SHARDS.
        shard_outputs = [a for a in out if a.endswith(".ngram") and "/shards/shard-" in a]
        keep = {str(data / "shards" / f"shard-{i}.ngram") for i in range(SHARDS)}
        out = [a for a in out if a not in shard_outputs or a in keep]
    build = argv[1] == "build"
    if build:
        out.append("--json")
    done = subprocess.run(out, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(out)}\n{done.stderr}"
    return json.loads(done.stdout) if build else {}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> dict:
    data = tmp_path_factory.mktemp("data")
    scratch = tmp_path_factory.mktemp("scratch")
    (data / "tokenizer").symlink_to(smollm2_tokenizer_dir, target_is_directory=True)
    (data / "shards").mkdir()
    spills = 0
    texts = sharegpt_texts(600)
    whole = data / "whole.jsonl"
    with whole.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    for i in range(SHARDS):
        shard = data / "corpus" / f"shard-{i}"
        shard.mkdir(parents=True)
        with (shard / "part.jsonl").open("w", encoding="utf-8") as f:
            for text in texts[i::SHARDS]:
                f.write(json.dumps({"text": text}) + "\n")
        spills += run_job("build-job.yaml", data, scratch, index=i)["spilled_runs"]
    run_job("merge-job.yaml", data, scratch)
    (merged,) = [p for p in data.rglob("*.ngram") if "shards" not in p.parts]
    reference = data / "reference.ngram"
    done = subprocess.run(
        [
            str(dart_ngram_binary()),
            "build",
            "-i",
            str(whole),
            "-o",
            str(reference),
            "--tokenizer",
            str(smollm2_tokenizer_dir),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return {"merged": merged, "reference": reference, "scratch": scratch, "spills": spills}


def test_the_build_jobs_spill_and_leave_no_scratch(pipeline: dict) -> None:
    assert pipeline["spills"] > 0, "the budget is too large to exercise spilling"
    # Whatever the shards spilled to --tmp-dir is gone when the Jobs end.
    assert list(pipeline["scratch"].iterdir()) == []


def test_sharded_build_and_merge_equal_one_whole_build(pipeline: dict) -> None:
    merged, whole = NGram.open(pipeline["merged"], verify=True), NGram.open(pipeline["reference"])
    a, b = merged.info(), whole.info()
    for field in ("order", "vocab_size", "total_tokens", "documents", "ngrams_per_order"):
        assert a[field] == b[field], field
    assert merged.fingerprint == whole.fingerprint
    rng = np.random.default_rng(0)
    candidates = np.arange(whole.vocab_size)
    for _ in range(40):
        # Contexts the corpus has (walked through its continuations) and random ones.
        ctx = [int(rng.integers(whole.vocab_size))]
        for _ in range(int(rng.integers(0, 3))):
            ids, _ = whole.top_k(ctx, 3)
            ctx.append(int(rng.choice(ids)) if len(ids) else int(rng.integers(whole.vocab_size)))
        pa, ma = merged.prob(ctx, candidates)
        pb, mb = whole.prob(ctx, candidates)
        np.testing.assert_array_equal(pa, pb, err_msg=f"after {ctx}")
        np.testing.assert_array_equal(ma, mb, err_msg=f"after {ctx}")


def test_the_daemon_serving_the_merged_model_prunes_as_in_process(pipeline: dict) -> None:
    from dart_client.ngram import Pruner, PrunerConfig

    local = NGram.open(pipeline["merged"])
    rng = np.random.default_rng(1)
    config = PrunerConfig()
    with (
        Daemon(pipeline["merged"], "--threads", "1") as daemon,
        connect(daemon.url, timeout=30, expected_fingerprint=local.fingerprint) as remote,
    ):
        remote_pruner, local_pruner = remote.pruner(config), Pruner(local, config)
        for _ in range(25):
            ctx = rng.integers(0, local.vocab_size, size=int(rng.integers(1, 6)))
            levels, k = int(rng.integers(1, 9)), int(rng.integers(2, 26))
            ids = np.stack(
                [rng.choice(local.vocab_size, size=k, replace=False) for _ in range(levels)]
            )
            # Plant the corpus' continuation at every level, so the n-gram guides the beam.
            walk = list(ctx)
            for level in range(levels):
                top, _ = local.top_k(walk, 1)
                if len(top) and int(top[0]) not in ids[level]:
                    ids[level, 0] = int(top[0])
                walk.append(int(ids[level, 0]))
            logits = rng.normal(size=(levels, k))
            probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            a = remote_pruner.prune(ctx, ids, probs.astype(np.float32))
            b = local_pruner.prune(ctx, ids, probs.astype(np.float32))
            for name in ("tokens", "parents", "depths", "attention_mask", "scores"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert daemon.alive()
