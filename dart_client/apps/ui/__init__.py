"""The side-by-side demo page (``dart demo --ui``): autoregressive decoding and DART racing
on one prompt. Needs the ``ui`` extra (Gradio)."""

from dart_client.apps.ui.race import RaceSettings, Side, race

__all__ = ["RaceSettings", "Side", "build_app", "race"]


def build_app(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`dart_client.apps.ui.app.build_app` (imported lazily: Gradio is heavy)."""
    from dart_client.apps.ui.app import build_app as _build

    return _build(*args, **kwargs)
