"""The OpenAI-compatible server (`blockpress serve`).

Layout: `protocol.py` (pydantic request/response models, limits, the one request -> engine
parameters step), `worker.py` (the thread that runs the engine's canvas loop for every request and
hands each its events), `serving.py` (requests -> jobs -> OpenAI responses and SSE chunks, no HTTP),
`app.py` (thin FastAPI routes, errors, auth, body limit), `metrics.py` (Prometheus text),
`static/` (the live web page). Nothing here is imported by `import blockpress`.
"""
