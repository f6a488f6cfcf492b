"""The side-by-side race behind the demo page, free of any UI code.

The same prompt is streamed through ``ar_generate`` and ``dart_generate`` on one model (and,
given an EAGLE-3 model on the same target, through EAGLE-3's drafter as a third lane). All
run in this thread, one step at a time, always advancing the one that has used *less* compute
so far: at any moment both have had the same time, so the pane that is further ahead is the
faster method, and each side's tokens/s counts its own steps only (running them in two threads
would have them fight over the same cores).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dart_client.decoding.config import GenerationConfig

if TYPE_CHECKING:
    from dart_client.dart_model import DartModel


@dataclass
class Side:
    """One method's progress: its steps' token runs, its compute time, its result."""

    name: str
    steps: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    done: bool = False
    result: Any = None
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        """Tokens per target forward after the prefill (the prefill's token excluded)."""
        spec = self.steps[1:]
        return sum(len(s) for s in spec) / len(spec) if spec else 0.0


@dataclass(frozen=True)
class RaceSettings(GenerationConfig):
    """The page's generation settings: a :class:`GenerationConfig` with the page's defaults."""

    max_new_tokens: int = 64
    tree_budget: int | str | None = "auto"
    seed: int | None = 0


def prompt_ids(model: DartModel, prompt: str) -> list[int]:
    """The user's text as a chat message when the model has a template, else raw."""
    if model.template is not None:
        return model.encode_input(messages=[{"role": "user", "content": prompt}])
    return model.encode_input(prompt=prompt)


def race(
    model: DartModel, ids: list[int], settings: RaceSettings, min_interval: float = 0.05
) -> Iterator[tuple[Side, Side]]:
    """Yields (ar, dart) after steps (at most every ``min_interval`` s), and once at the end."""
    for sides in race_lanes(model, ids, settings, min_interval=min_interval):
        yield sides["ar"], sides["dart"]


def race_lanes(
    model: DartModel,
    ids: list[int],
    settings: RaceSettings,
    eagle3: DartModel | None = None,
    min_interval: float = 0.05,
) -> Iterator[dict[str, Side]]:
    """Yields every lane's :class:`Side` by name (``ar``, ``dart``, and ``eagle3`` when an
    EAGLE-3 model on the same target is given) after steps, and once at the end. EAGLE-3
    drafts its published tree unless the budget is an int."""
    config = settings.for_prompt(len(ids))
    # Every stream is set up (the budget tuned, when "auto") before any is timed.
    streams = {
        "ar": model.generate(ids, config, mode="ar", stream=True),
        "dart": model.generate(ids, config, stream=True),
    }
    if eagle3 is not None:
        own = config.tree_budget if isinstance(config.tree_budget, int) else None
        streams["eagle3"] = eagle3.generate(ids, config.replace(tree_budget=own), stream=True)
    iters = {k: iter(s) for k, s in streams.items()}
    sides = {name: Side(name) for name in streams}
    last = 0.0
    while not all(s.done for s in sides.values()):
        side = min((s for s in sides.values() if not s.done), key=lambda s: s.seconds)
        start = time.perf_counter()
        try:
            event = next(iters[side.name])
        except StopIteration:
            side.done = True
            side.result = streams[side.name].result
        else:
            side.steps.append(list(event.tokens))
            side.tree_sizes.append(event.tree_size)
        side.seconds += time.perf_counter() - start
        now = time.perf_counter()
        if now - last >= min_interval or all(s.done for s in sides.values()):
            last = now
            yield sides


# -- rendering ---------------------------------------------------------------------------------


def step_texts(tokenizer: Any, steps: list[list[int]]) -> list[str]:
    """Each step's share of the decoded text (decoded cumulatively: a character split over
    two steps lands whole in the later one)."""
    out: list[str] = []
    done: list[int] = []
    prev = ""
    for run in steps:
        done = done + run
        text = tokenizer.decode(done, skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(prev):
            out.append(text[len(prev) :])
            prev = text
        else:
            piece = tokenizer.decode(run, skip_special_tokens=True)
            out.append(piece)
            prev += piece
    return out


def render_pane(tokenizer: Any, side: Side, highlight: bool) -> str:
    """The generated text as HTML; with ``highlight`` each step's run is a shaded span whose
    colour deepens with the number of tokens it accepted (one token: unshaded)."""
    pieces = step_texts(tokenizer, side.steps)
    spans = []
    for i, (run, text) in enumerate(zip(side.steps, pieces, strict=True)):
        if not text:
            continue
        body = html.escape(text)
        n = len(run)
        if highlight and n > 1:
            alpha = min(0.15 + 0.12 * (n - 1), 0.85)
            hue = 140 if i % 2 else 190  # neighbouring runs stay distinguishable
            spans.append(
                f'<span class="run" data-tokens="{n}" title="step {i}: {n} tokens" '
                f'style="background: hsla({hue}, 70%, 45%, {alpha:.2f})">{body}</span>'
            )
        else:
            spans.append(f'<span class="tok" data-tokens="{n}">{body}</span>')
    state = "done" if side.done else "running"
    return (
        f'<div class="pane-text" data-state="{state}" data-tokens="{side.tokens}" '
        f'style="white-space: pre-wrap; font-family: ui-monospace, monospace; '
        f'min-height: 12em">{"".join(spans)}</div>'
    )


def render_stats(side: Side, other: Side | None = None) -> str:
    """tokens, tokens/s, tau (the drafters), steps, and the speedup over ``other`` when
    given."""
    items = [
        ("tokens", f"{side.tokens}"),
        ("tok/s", f"{side.tokens_per_s:.1f}"),
        ("steps", f"{len(side.steps)}"),
    ]
    if side.name != "ar":
        items.append(("tau", f"{side.tau:.2f}"))
        sizes = side.tree_sizes[1:]
        if sizes:
            items.append(("tree", f"{max(sizes) - 1} nodes max"))
        if other is not None and other.tokens_per_s > 0 and side.tokens_per_s > 0:
            items.append(("speedup", f"{side.tokens_per_s / other.tokens_per_s:.2f}x"))
    cells = "".join(
        f'<span class="stat" data-stat="{html.escape(k)}"><b>{html.escape(v)}</b> '
        f"{html.escape(k)}</span> &nbsp; "
        for k, v in items
    )
    return f'<div class="stats" data-side="{side.name}">{cells}</div>'
