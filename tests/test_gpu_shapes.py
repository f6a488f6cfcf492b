"""``python -m dart_client.apps.bench.gpu_shapes``: the static path's per-step costs on a
random-weight target; here its tiny shape on the CPU (eager), end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dart_client.apps.bench import gpu_shapes


@pytest.mark.usefixtures("one_thread")
def test_gpu_shapes_reports_every_figure(tmp_path: Path, tiny_ngram_path: Any, capsys: Any) -> None:
    pytest.importorskip("dart_client.ngram.pruner")
    out = tmp_path / "shapes.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--context", "20"]
    argv += ["--tree", "9", "--steps", "2", "--ngram", str(tiny_ngram_path), "--json", str(out)]
    argv += ["--batch", "3"]
    assert gpu_shapes.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["bucket"] == 16 and report["gpu"] is None and report["ar_kernel_ms"] is None
    for key in ("ar_step_ms", "tree_step_ms", "tree_step_without_head_ms", "load_ms"):
        assert report[key] > 0, key
    assert report["prune_ms"] > 0
    assert report["draft_ms"] == pytest.approx(
        report["tree_step_ms"] - report["tree_step_without_head_ms"]
    )
    assert report["tree_vs_one_token"] == pytest.approx(
        report["tree_step_without_head_ms"] / report["ar_step_ms"]
    )
    # The batch program over 3 rows of the same context.
    assert report["batch"] == 3 and report["batch_ar_kernel_ms"] is None
    for key in ("batch_ar_step_ms", "batch_tree_step_ms", "batch_tree_step_without_head_ms"):
        assert report[key] > 0, key
    assert report["batch_draft_ms"] == pytest.approx(
        report["batch_tree_step_ms"] - report["batch_tree_step_without_head_ms"]
    )
    printed = capsys.readouterr().out
    assert "| the draft |" in printed and "| 3 rows: the drafts |" in printed


def test_gpu_shapes_rejects_bad_arguments(capsys: Any) -> None:
    with pytest.raises(SystemExit) as err:
        gpu_shapes.main(["--shape", "tiny", "--device", "cpu", "--tree", "0"])
    assert err.value.code == 2 and "--tree must be >= 1" in capsys.readouterr().err
