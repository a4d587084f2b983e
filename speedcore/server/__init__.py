"""``python -m speedcore serve``: an OpenAI-compatible HTTP server on ``speedcore.LLM`` (see docs/server.md).

Layers: ``async_engine`` runs the synchronous engine in one background thread that owns the GPU and hands each
request's tokens to the asyncio handlers; ``protocol`` turns OpenAI request bodies into SamplingParams (or an
OpenAI-format error) and engine output into response bodies and stream chunks; ``app`` is the Starlette ASGI app;
``metrics`` the Prometheus counters; ``fake_engine`` a CPU stand-in (the engine's real scheduler and request loop
on a scripted runner) for tests and demos.  Importing this package imports none of them (no Starlette, no CuPy).
"""
