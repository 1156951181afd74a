"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI schema (valid and
invalid), sends them to a real `blockpress serve` process, and every answer must be < 500 (4xx with
an OpenAI-style error body) while the process stays up; the server's own request counter must show
no 5xx at all.

CI runs 500+ requests (derandomized: the same ones every run) against a server capped at 16 tokens
and 4 steps per canvas, so generation is fast. Opt-in larger run with a fresh random seed:
BLOCKPRESS_FUZZ_EXAMPLES=N python -m pytest tests/test_server_fuzz.py  (N examples per operation
and mode).
"""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("openai")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from test_server import ServerProcess, build_tiny_model  # noqa: E402

OPT_IN = int(os.environ.get("BLOCKPRESS_FUZZ_EXAMPLES", "0"))
# examples per (path, mode) in CI, 500 requests in all; chat bodies are slow to generate (nested
# messages and tools), completions are cheap, so most of the volume goes to completions
CI_EXAMPLES = {("/v1/chat/completions", "positive"): 100, ("/v1/chat/completions", "negative"): 50,
               ("/v1/completions", "positive"): 200, ("/v1/completions", "negative"): 150}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny_fuzz"))
    s = ServerProcess(model_dir, "--max-tokens-limit", "16", "--max-steps-limit", "4", "--steps", "2",
                      "--max-prompt-tokens", "256", "--max-batch", "8")
    yield s
    s.stop()


def test_fuzz_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    sent = {"n": 0}
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        post = op.method.upper() == "POST"
        modes = [schemathesis.GenerationMode.POSITIVE] + ([schemathesis.GenerationMode.NEGATIVE] if post else [])
        for mode in modes:  # GET routes take no input: nothing invalid to generate
            examples = (OPT_IN or CI_EXAMPLES[(op.path, mode.value)]) if post else 1

            @settings(max_examples=examples, deadline=None, derandomize=not OPT_IN, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                      report_multiple_bugs=False)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(timeout=60)
                sent["n"] += 1
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {response.status_code}: {case.body!r:.300}")
                assert response.status_code < 500, response.text
                if response.status_code >= 400:
                    err = response.json()["error"]
                    assert err["message"] and {"type", "param", "code"} <= set(err)

            run()
    assert server.proc.poll() is None, "server crashed: " + server.read_log()
    assert not failures
    counts = {k: v for k, v in server.metrics().items() if k.startswith("blockpress_requests_total")}
    assert not [k for k in counts if 'status="5' in k], counts
    assert sent["n"] >= (500 if not OPT_IN else 4 * OPT_IN), sent
    assert sum(counts.values()) >= sent["n"]
    generated = sum(v for k, v in counts.items() if "completions" in k and 'status="200"' in k)
    print(f"fuzz: {sent['n']} requests, {generated:.0f} generations", counts)
    assert generated >= 50  # valid requests really ran the engine
