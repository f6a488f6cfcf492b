"""The step profile benchmark's accounting, on a tiny float64 target (real pruner)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import make_tiny_target, make_tiny_tokenizer

from dart_client import DartModel
from dart_client.apps.bench import step_profile
from dart_client.models.head import DartHead


@pytest.mark.usefixtures("one_thread")
def test_profile_books_the_overhead_against_ar_forwards(tiny_ngram_path: Any) -> None:
    pytest.importorskip("dart_client.ngram.pruner")
    from dart_client.ngram import NGram

    model = make_tiny_target("llama", seed=2)
    head = DartHead.random_init(model.config, draft_length=3, seed=1).double()
    dm = DartModel(
        model, head, tokenizer=make_tiny_tokenizer(), ngram=NGram.open(str(tiny_ngram_path))
    )
    prompts = ["w5 w17 w200", "w9 w9 w31 w40 w7", "w300"]
    report = step_profile.profile(dm, prompts, max_new=12)

    assert report["prompts"] == 3 and report["steps"] > 0
    assert report["greedy_identical"] == 3  # float64: DART is AR token for token
    assert set(report["ms_per_step"]) == set(step_profile.STEP_STAGES)
    stages = report["ms_per_step"]
    assert all(v["median"] >= 0 and v["mean"] >= 0 for v in stages.values())
    assert stages["verify"]["mean"] > 0 and stages["draft"]["mean"] > 0
    # Means are linear: step = sum of stages, overhead = step - verify.
    step, over = report["step_ms"]["mean"], report["overhead_ms"]["mean"]
    assert step == pytest.approx(sum(v["mean"] for v in stages.values()))
    assert over == pytest.approx(step - stages["verify"]["mean"])
    ratio = report["overhead_vs_ar_forward"]
    assert ratio["mean"] == pytest.approx(over / report["ar_forward_ms"]["mean"])
    assert ratio["median"] == pytest.approx(
        report["overhead_ms"]["median"] / report["ar_forward_ms"]["median"]
    )
    own = report["overhead_vs_own_forward"]
    assert own["mean"] == pytest.approx(over / stages["verify"]["mean"])
    assert report["unbooked_ms_per_step"] >= 0
    text = step_profile.markdown(report)
    rows = (
        "| draft |",
        "| emit |",
        "| one AR target forward |",
        "of one AR forward",
        "own forward",
    )
    for row in rows:
        assert row in text


@pytest.mark.usefixtures("one_thread")
def test_profile_on_the_static_path(tiny_ngram_path: Any) -> None:
    """``--static on`` (what ``--device cuda`` takes by default) runs the same profile, every
    stage booked, outputs still AR's."""
    pytest.importorskip("dart_client.ngram.pruner")
    from dart_client.ngram import NGram

    model = make_tiny_target("llama", seed=2)
    head = DartHead.random_init(model.config, draft_length=3, seed=1).double()
    dm = DartModel(
        model, head, tokenizer=make_tiny_tokenizer(), ngram=NGram.open(str(tiny_ngram_path))
    )
    report = step_profile.profile(dm, ["w5 w17 w200", "w300"], max_new=12, static=True)
    assert report["greedy_identical"] == 2 and report["steps"] > 0
    stages = report["ms_per_step"]
    assert stages["inputs"]["mean"] > 0 and stages["verify"]["mean"] > 0
    assert stages["accept"]["mean"] > 0 and stages["compact"]["mean"] == 0  # in the replay
