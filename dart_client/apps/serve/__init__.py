"""``dart serve``: an OpenAI-compatible HTTP server in front of one DART model.

* :mod:`.generation` -- the only module that loads the model and calls generation;
* :mod:`.scheduler`  -- one worker thread owns the model, a bounded first-come-first-served
  queue feeds it, timeouts / cancellation / graceful shutdown;
* :mod:`.protocol`   -- OpenAI request validation, response and stream-chunk shapes;
* :mod:`.metrics`    -- the Prometheus metrics;
* :mod:`.app`        -- the FastAPI app and ``dart serve``'s command line;
* :mod:`.bench`      -- a load generator: requests/s, time to first token, tokens/s.
"""
