"""``trtbuild serve``: an OpenAI-compatible HTTP server on the runner (Starlette + uvicorn).

Modules: ``config`` (ServeConfig, the CLI flags), ``protocol`` (request bodies -> ``SamplingParams``),
``engine`` (the one background loop owning the ``LLM``), ``responses`` (OpenAI response/stream objects),
``metrics`` (Prometheus text), ``errors`` (OpenAI error JSON), ``app`` (routes) and ``server`` (uvicorn, signals).
"""
