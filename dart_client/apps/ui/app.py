"""``dart demo --ui``: a Gradio page racing autoregressive decoding and DART side by side.

    dart demo --ui [--port 7860] [--host 127.0.0.1] [--base MODEL] [--head DIR|random]
        [--ngram PATH|embedded] [--dtype bf16] [--threads N]

Loads the embedded default (SmolLM2-135M-Instruct bf16 on CPU, the head shipped for it in
``dart_client/heads/smollm2-135m-dart``, else a random one, the ShareGPT 3-gram) unless other
models are given. The page streams one prompt through both methods (see
:mod:`dart_client.apps.ui.race`), shows tokens/s, tau and the speedup, and shades each DART step's
accepted run; temperature, top-p, top-k, the token limit, the tree budget and the seed are
adjustable. :func:`build_app` takes any loaded :class:`DartModel` (the tests pass a tiny one).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dart_client.apps.options import DTYPE_CHOICES
from dart_client.apps.ui.race import (
    RaceSettings,
    prompt_ids,
    race_lanes,
    render_pane,
    render_stats,
)
from dart_client.errors import DartError

if TYPE_CHECKING:
    from dart_client.dart_model import DartModel

BUDGET_CHOICES = ["auto", "4", "8", "16", "24", "32", "48", "60", "80"]
EXAMPLES = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what speculative decoding is in three sentences.",
    "List five tips for staying focused while studying.",
]
# System fonts only: the page must not fetch anything from the network (none here).
CSS = """
.pane-text { font-size: 0.95em; line-height: 1.5; }
.stats { font-size: 0.95em; }
"""


def build_app(
    model: DartModel,
    *,
    max_new_tokens: int = 64,
    title: str | None = None,
    eagle3: DartModel | None = None,
) -> Any:
    """The Blocks page over ``model`` (which needs a head and a pruner for the DART side);
    ``eagle3``, a DartModel with an EAGLE-3 head on the same target, adds a third lane."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    if model.head is None or model.tree_builder is None:
        from dart_client.errors import InvalidArgumentError

        raise InvalidArgumentError("the demo page needs a DartModel with a head and a pruner")
    tokenizer = model.tokenizer
    if tokenizer is None:
        from dart_client.errors import InvalidArgumentError

        raise InvalidArgumentError("the demo page needs a tokenizer to show text")
    name = type(model.target.model).__name__
    title = title or "DART speculative decoding vs autoregressive"

    def run(
        prompt: str,
        temperature: float,
        top_p: float,
        top_k: float,
        max_new: float,
        budget: str,
        seed: float,
    ) -> Iterator[tuple[str, ...]]:
        if not prompt or not prompt.strip():
            raise gr.Error("Type a prompt first.")
        try:
            tree_budget: int | str = "auto" if budget == "auto" else int(budget)
        except ValueError:
            raise gr.Error(f"Tree budget {budget!r}: expected 'auto' or an integer.") from None
        try:
            settings = RaceSettings(
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                max_new_tokens=max(1, int(max_new)),
                tree_budget=tree_budget,
                seed=int(seed),
            )
        except DartError as err:  # a setting out of range: the user's to fix
            raise gr.Error(str(err)) from None
        if tree_budget == "auto" and model.tree_tuning is None:
            blank = ("",) * (len(outputs) - 1)
            yield (*blank, "Measuring the best tree budget on this machine (once)...")
        try:
            ids = prompt_ids(model, prompt)
        except Exception as err:  # a bad prompt is the user's to fix: show it
            raise gr.Error(str(err)) from None
        for sides in race_lanes(model, ids, settings, eagle3):
            ar = sides["ar"]
            status = _status(model, settings, all(s.done for s in sides.values()))
            panes: list[str] = []
            for name, side in sides.items():
                panes.append(render_pane(tokenizer, side, highlight=name != "ar"))
                panes.append(render_stats(side, None if name == "ar" else ar))
            yield (*panes, status)

    with gr.Blocks(title=title, analytics_enabled=False) as app:
        gr.Markdown(
            f"## {title}\n{name} ({str(model.target.dtype).replace('torch.', '')}, "
            f"{model.target.device}). Both methods share the model and get the same compute "
            "time in turn, so the pane that runs ahead is the faster one. In the DART pane each "
            "shaded run is one target forward's accepted tokens (darker = more tokens); greedy "
            "output is identical to autoregressive decoding."
        )
        with gr.Row():
            prompt = gr.Textbox(
                label="Prompt", lines=3, value=EXAMPLES[0], elem_id="prompt", scale=4
            )
            go = gr.Button("Run", variant="primary", elem_id="run", scale=1)
        with gr.Row():
            temperature = gr.Slider(
                0.0, 1.5, value=0.0, step=0.05, label="Temperature (0 = greedy)"
            )
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p")
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
        with gr.Row():
            max_new = gr.Slider(1, 512, value=max_new_tokens, step=1, label="Max new tokens")
            budget = gr.Dropdown(
                BUDGET_CHOICES,
                value="auto",
                label="Tree budget (draft nodes)",
                allow_custom_value=True,
                elem_id="budget",
            )
            seed = gr.Number(value=0, precision=0, label="Seed")
        status = gr.Markdown("", elem_id="status")
        with gr.Row(equal_height=True):
            with gr.Column():
                gr.Markdown("### Autoregressive")
                ar_stats = gr.HTML(elem_id="ar-stats")
                ar_text = gr.HTML(elem_id="ar-pane")
            with gr.Column():
                gr.Markdown("### DART")
                dart_stats = gr.HTML(elem_id="dart-stats")
                dart_text = gr.HTML(elem_id="dart-pane")
            lanes = [ar_text, ar_stats, dart_text, dart_stats]
            if eagle3 is not None:
                with gr.Column():
                    gr.Markdown("### EAGLE-3")
                    eagle3_stats = gr.HTML(elem_id="eagle3-stats")
                    eagle3_text = gr.HTML(elem_id="eagle3-pane")
                lanes += [eagle3_text, eagle3_stats]
        gr.Examples(EXAMPLES, inputs=[prompt])
        inputs = [prompt, temperature, top_p, top_k, max_new, budget, seed]
        outputs = [*lanes, status]
        # One race at a time, whichever way it is started: both share the model's caches and
        # taps, and two at once would halve each other's speed.
        for trigger in (go.click, prompt.submit):
            trigger(run, inputs, outputs, concurrency_limit=1, concurrency_id="race")
    return app


def _status(model: DartModel, settings: RaceSettings, done: bool) -> str:
    tuning = model.tree_tuning
    budget = settings.tree_budget
    text = f"tree budget {budget}"
    if budget == "auto" and tuning is not None:
        text = f"tree budget auto -> {tuning.best_budget} (measured on this machine)"
    mode = "greedy" if settings.temperature == 0 else f"sampling at T={settings.temperature}"
    return f"{'Done' if done else 'Running'}: {mode}, {text}."


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch(app: Any, *, host: str = "127.0.0.1", port: int | None = None, block: bool = True):
    """Serve ``app``; with ``block=False`` returns at once (the caller closes the app)."""
    import gradio as gr

    theme = gr.themes.Default(
        font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )
    return app.launch(
        server_name=host,
        server_port=port if port is not None else free_port(host),
        prevent_thread_lock=not block,
        quiet=not block,
        ssr_mode=False,
        theme=theme,
        css=CSS,
        footer_links=[],
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dart demo --ui", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--base", help="target model (default: the embedded SmolLM2)")
    p.add_argument("--head", default="auto", help="head directory, 'random' or 'auto'")
    p.add_argument("--ngram", default="embedded", help="n-gram model or 'embedded'")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128, help="the slider's start value")
    p.add_argument(
        "--eagle3-head",
        help="add an EAGLE-3 lane with this checkpoint (directory, hub id, or 'auto': the one "
        "shipped for the embedded SmolLM2)",
    )
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    from dart_client.dart_model import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    # Tuned (or read from the tuning cache) at start, not inside the first request.
    model = build_model(args.base, args.head, args.ngram, dtype=args.dtype, tree_budget="auto")
    eagle3 = None
    if args.eagle3_head:
        from dart_client.dart_model import DartModel
        from dart_client.loading import load_eagle3_head

        head = load_eagle3_head(
            args.eagle3_head, model.target.config, embedded_target=args.base is None
        )
        eagle3 = DartModel(model.target, tokenizer=model.tokenizer, eagle3=head)
    app = build_app(model, max_new_tokens=args.max_new_tokens, eagle3=eagle3)
    print(f"dart demo: serving on http://{args.host}:{args.port}", file=sys.stderr)
    launch(app, host=args.host, port=args.port, block=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
