"""The demo page in a real headless Chromium (Debian's ``chromium``, driven by Playwright):
the page loads, a prompt runs, both panes fill, the figures appear. The page serves a tiny
float64 model (it takes any DartModel), so one run is fast; the race logic and the rendering
are checked directly too."""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_tiny_target, make_tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_client import DartModel, ar_generate, dart_generate
from dart_client.apps.ui.race import (
    RaceSettings,
    Side,
    race,
    race_lanes,
    render_pane,
    render_stats,
    step_texts,
)
from dart_client.models.head import DartHead

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_ngram_path: Path) -> DartModel:
    from dart_client.ngram import NGram

    target = make_tiny_target("llama", seed=4)
    head = DartHead.random_init(target.config, draft_length=3, seed=3).double()
    return DartModel(
        target, head, tokenizer=make_tiny_tokenizer(), ngram=NGram.open(str(tiny_ngram_path))
    )


def test_race_reproduces_both_methods(model: DartModel) -> None:
    ids = model.encode_input(prompt="w5 w6 w7 w8")
    race_settings = RaceSettings(max_new_tokens=20, tree_budget=6)
    states = list(race(model, ids, race_settings, min_interval=0.0))
    ar, dart = states[-1]
    assert ar.done and dart.done
    want = ar_generate(model, input_ids=ids, max_new_tokens=20)
    got = dart_generate(model, input_ids=ids, max_new_tokens=20, tree_budget=6)
    assert [t for s in ar.steps for t in s] == want.tokens
    assert [t for s in dart.steps for t in s] == got.tokens == want.tokens
    assert [len(s) for s in dart.steps] == got.accept_lengths
    assert ar.seconds > 0 and dart.seconds > 0
    # Streamed: one update per step (min_interval 0), the two sides' steps interleaved.
    assert len(states) == len(ar.steps) + len(dart.steps) + 2


def test_race_with_an_eagle3_lane(model: DartModel) -> None:
    """A third lane drafts with EAGLE-3 on the same target; greedy, all three are AR's."""
    from dart_client.apps.ui.app import build_app
    from dart_client.models.eagle3 import Eagle3Head

    head = Eagle3Head.random_init(model.target.config, seed=1, std=0.3)
    eagle3 = DartModel(model.target, tokenizer=model.tokenizer, eagle3=head)
    ids = model.encode_input(prompt="w5 w6 w7 w8")
    settings = RaceSettings(max_new_tokens=16, tree_budget=6)
    *_, final = race_lanes(model, ids, settings, eagle3, min_interval=0.0)
    assert list(final) == ["ar", "dart", "eagle3"] and all(s.done for s in final.values())
    want = [t for s in final["ar"].steps for t in s]
    for name in ("dart", "eagle3"):
        assert [t for s in final[name].steps for t in s] == want, name
    assert max(final["eagle3"].tree_sizes) == 7  # the int budget, + the root
    assert 'data-stat="tau"' in render_stats(final["eagle3"], final["ar"])
    assert build_app(model, eagle3=eagle3) is not None


def test_rendering_shades_accepted_runs(model: DartModel) -> None:
    tok = model.tokenizer
    side = Side("dart", steps=[[5], [6, 7, 8], [9], [10, 11]], seconds=0.5, done=True)
    side.tree_sizes = [0, 7, 7, 7]
    assert "".join(step_texts(tok, side.steps)) == tok.decode([5, 6, 7, 8, 9, 10, 11])
    pane = render_pane(tok, side, highlight=True)
    runs = re.findall(r'<span class="run" data-tokens="(\d)"', pane)
    assert runs == ["3", "2"]  # single-token steps are not shaded
    assert 'data-state="done"' in pane and 'data-tokens="7"' in pane
    stats = render_stats(side, Side("ar", steps=[[1]] * 7, seconds=1.0))
    assert 'data-stat="tau"><b>2.00</b>' in stats  # (3 + 1 + 2) / 3
    assert 'data-stat="tok/s"><b>14.0</b>' in stats
    assert 'data-stat="speedup"><b>2.00x</b>' in stats


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def served(model: DartModel) -> Iterator[str]:
    pytest.importorskip("gradio")
    from dart_client.apps.ui.app import build_app, free_port, launch

    app = build_app(model, max_new_tokens=16)
    port = free_port()
    launch(app, port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.close()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test)")
def test_page_in_headless_chromium(served: str, tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(served)
            prompt = page.locator("#prompt textarea")
            prompt.wait_for()
            prompt.fill("w5 w6 w7 w8 w9")
            page.locator("#budget input").fill("8")
            page.locator("#budget input").press("Enter")
            page.locator("#run").click()
            done = "#ar-pane [data-state=done], #dart-pane [data-state=done]"
            page.wait_for_function(
                f"document.querySelectorAll('{done}').length == 2", timeout=60_000
            )
            ar_text = page.locator("#ar-pane .pane-text").inner_text()
            dart_text = page.locator("#dart-pane .pane-text").inner_text()
            assert ar_text.strip() and dart_text.strip()
            assert ar_text == dart_text  # greedy: the same text
            assert re.fullmatch(r"(w\d+ ?)+", ar_text.strip())
            stats = page.locator("#dart-stats").inner_text()
            assert re.search(r"[\d.]+ tok/s", stats) and re.search(r"[\d.]+ tau", stats)
            assert re.search(r"[\d.]+x speedup", stats)
            assert re.search(r"[\d.]+ tok/s", page.locator("#ar-stats").inner_text())
            assert "tree budget 8" in page.locator("#status").inner_text()
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        finally:
            browser.close()


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_tokenizer_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_step_texts_concatenate_to_the_decoded_text(smol_tokenizer: Any, data: Any) -> None:
    """Real byte-level BPE, any split into steps (multi-byte characters cut included): the
    panes' pieces put together are exactly the decoded output."""
    ids = data.draw(st.lists(st.integers(0, len(smol_tokenizer) - 1), min_size=1, max_size=30))
    cuts = sorted(
        data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=10)) if len(ids) > 1 else []
    )
    bounds = [0, *cuts, len(ids)]
    steps = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    pieces = step_texts(smol_tokenizer, steps)
    assert len(pieces) == len(steps)
    full = smol_tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert "".join(pieces) == full
