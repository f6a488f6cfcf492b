"""The applications: the ``dart`` CLI, the demo, training CLIs, the bench and the web UI. The
top layer: nothing else in ``dart_client`` imports from here."""
