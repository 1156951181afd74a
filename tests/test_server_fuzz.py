"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI schema (valid and
invalid), sends them to a real `blockpress serve` process, and every answer must conform to that
schema: no 5xx, a documented status code and content type, a body valid against the documented
response schema (errors included), and schema-invalid requests rejected. The process must stay up
and the server's own request counter must show no 5xx at all.

The default run sends ~280 requests (derandomized: the same ones every run) against a server capped
at 16 tokens and 4 steps per canvas, so generation is fast. `--runslow` adds a run of more than
2,000 requests; BLOCKPRESS_FUZZ_EXAMPLES=N (with a fresh random seed) sets N examples per operation
and mode for either.
"""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("openai")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import checks  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402

from test_server import ServerProcess, build_tiny_model  # noqa: E402

OPT_IN = int(os.environ.get("BLOCKPRESS_FUZZ_EXAMPLES", "0"))
# examples per (path, mode) in the default run; chat bodies are slow to generate (nested messages and tools),
# completions are cheap, so most of the volume goes to completions
DEFAULT = {("/v1/chat/completions", "positive"): 40, ("/v1/chat/completions", "negative"): 20,
           ("/v1/completions", "positive"): 80, ("/v1/completions", "negative"): 60,
           ("/v1/responses", "positive"): 40, ("/v1/responses", "negative"): 20,
           ("/v1/models/{model}", "positive"): 10, ("/v1/models/{model}", "negative"): 0}
SLOW = {k: 8 * v for k, v in DEFAULT.items()}  # (--runslow: four times the default of 2026-11-29, twice this one's)
# what "conforms to the schema" means here; positive_data_acceptance is left out on purpose: some valid-looking
# requests are refused by rules a JSON Schema cannot state (t_max >= t_min, tool_choice naming an offered tool,
# the prompt's length in tokens)
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny_fuzz"))
    s = ServerProcess(model_dir, "--max-tokens-limit", "16", "--max-steps-limit", "4", "--steps", "2",
                      "--max-prompt-tokens", "256", "--max-batch", "8", "--max-prompts", "4")
    yield s
    s.stop()


def fuzz(server, examples: dict) -> None:
    # a body over the size limit is rejected with 413: a rejection too
    config = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {
        "expected-statuses": ["400", "401", "404", "405", "413", "429"]}}})
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)
    sent = {"n": 0}
    failures: list[str] = []
    before = server.metrics()
    for result in schema.get_all_operations():
        op = result.ok()
        post = op.method.upper() == "POST"
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        for mode in modes:
            n = examples.get((op.path, mode.value), 1 if mode.value == "positive" else 0)
            if OPT_IN and n and (post or op.path.endswith("}")):  # not where the default generates nothing: a
                n = OPT_IN  # model name has no invalid form, and hypothesis would find no case to send
            if not n:
                continue  # GET routes without parameters take no input: nothing invalid to generate

            @settings(max_examples=n, deadline=None, derandomize=not OPT_IN, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                      report_multiple_bugs=False)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(timeout=60)
                sent["n"] += 1
                try:
                    case.validate_response(response, checks=CHECKS)
                except Exception as e:  # one line per failing request: the check, the request, the answer
                    failures.append(f"{case.method} {case.path} -> {response.status_code} {response.text[:300]!r}: "
                                    f"{str(e).strip()[:600]}\n  body: {case.body!r:.300}")
                    raise

            run()
    assert server.proc.poll() is None, "server crashed: " + server.read_log()
    assert not failures, "\n".join(failures)
    after = server.metrics()
    counts = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("blockpress_requests_total")}
    assert not [k for k, v in counts.items() if 'status="5' in k and v], counts
    assert sum(counts.values()) >= sent["n"]
    generated = sum(v for k, v in counts.items() if ("completions" in k or "responses" in k) and 'status="200"' in k)
    # which bodies hypothesis draws depends on the constants it collects from every local module loaded (the
    # whole suite's, at collection), so any code change shifts the mix: the same 543 requests have made 49 to 85
    # generations. The floors are loose for that reason; each generating endpoint must run the engine at least once.
    for endpoint in ("/v1/completions", "/v1/responses"):
        key = f'blockpress_requests_total{{endpoint="{endpoint}",status="200"}}'
        assert counts.get(key, 0) >= 1, (endpoint, counts)
    print(f"fuzz: {sent['n']} requests, {generated:.0f} generations", counts)
    return sent["n"], generated


def test_fuzz_responses_conform_to_the_schema(server):
    n, generated = fuzz(server, DEFAULT)
    assert n >= (250 if not OPT_IN else OPT_IN), n
    assert generated >= 20, generated  # valid requests really ran the engine (see fuzz for why 20)


@pytest.mark.slow
def test_fuzz_responses_conform_to_the_schema_2000(server):
    n, generated = fuzz(server, SLOW)
    assert n >= 2000 and generated >= 80, (n, generated)
