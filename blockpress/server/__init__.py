"""The OpenAI-compatible server (`blockpress serve`).

Layout: `protocol.py` (pydantic request/response models, limits, the one request -> engine
parameters step), `scheduler.py` (the thread that owns the model and batches requests at canvas
granularity), `serving.py` (requests -> jobs -> OpenAI responses and SSE chunks, no HTTP),
`app.py` (thin FastAPI routes, errors, auth, body limit), `metrics.py` (Prometheus text),
`static/` (the live web page). Nothing here is imported by `import blockpress`.
"""
