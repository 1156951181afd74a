"""`blockpress serve [MODEL]`: the OpenAI-compatible HTTP server with the live web page at `/`.

Binds 127.0.0.1:8000 by default. Endpoints: GET /v1/models[/{id}], POST /v1/chat/completions,
POST /v1/completions, POST /v1/responses, GET /health, GET /metrics, GET / (web page). `--api-key`
(or the BLOCKPRESS_API_KEY environment variable; printable ASCII) requires `Authorization: Bearer KEY`
on /v1 routes. Bound to loopback, only loopback Host names are answered (`--allowed-hosts`);
browsers on other origins need `--allowed-origins`. Sampling flags set server-wide defaults;
requests may override them per call (`--max-new-tokens`: max_tokens of a request that gives none).
"""

from __future__ import annotations

import argparse
import os

from .run import (MAX_STEPS, _float_in, _int_in, _positive_int, add_model_args, add_sampling_args, load_model,
                  refuse_task_model, sampling_kwargs)


def add_parser(p) -> None:
    # CUDA graphs (on a GPU by default): the worker keeps its cache in slots that the graphs of every batch size share
    add_model_args(p, default="the shipped chat model, assistant")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("BLOCKPRESS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $BLOCKPRESS_API_KEY)")
    p.add_argument("--served-model-name", help="model id clients use (default: the folder name or Hub id; "
                   "'blockpress' always works too)")
    p.add_argument("--allowed-hosts", metavar="H1,H2",
                   help="Host header names answered, '*' for any (default: bound to loopback, the loopback names "
                        "only, against DNS rebinding; else any)")
    p.add_argument("--allowed-origins", metavar="URL1,URL2",
                   help="browser origins allowed to call the API from another page (CORS), e.g. "
                        "http://localhost:3000, or '*' (default: none)")
    p.add_argument("--max-batch", type=_positive_int, default=8,
                   help="rows denoised together: a request's n choices (and a completions batch's prompts) each "
                        "take one (default: 8)")
    p.add_argument("--queue-size", type=_positive_int, default=64,
                   help="rows allowed to wait; more get 429, and a request of more rows than this a 400 (default: 64)")
    p.add_argument("--max-tokens-limit", type=_positive_int, default=4096,
                   help="largest max_tokens a request may ask for (default: 4096)")
    p.add_argument("--max-prompt-tokens", type=_positive_int, default=32768, help="longest prompt (default: 32768)")
    p.add_argument("--max-messages", type=_positive_int, default=256,
                   help="most messages per chat request (default: 256)")
    p.add_argument("--max-choices", type=_positive_int, default=8,
                   help="most choices (n) a request may ask for; each is a row of the batch (default: 8)")
    p.add_argument("--max-steps-limit", type=_positive_int, default=MAX_STEPS,
                   help=f"most denoising steps per canvas a request may ask for (default: {MAX_STEPS})")
    p.add_argument("--max-prompts", type=_positive_int, default=32,
                   help="most prompts in one /v1/completions batch (default: 32)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20,
                   help="largest request body (default: 1 MiB)")
    p.add_argument("--body-timeout", type=_float_in(0, strict=True), default=30.0, metavar="SECONDS",
                   help="time a client has to send its whole request body; slower ones get 408 (default: 30)")
    p.add_argument("--prefix-cache-gb", type=_float_in(0, strict=False), default=1.0, metavar="GB",
                   help="keep the K/V of prompts that ran alone, up to this many GiB on the model's device, for later "
                        "prompts that start the same way (a chat's next turn encodes only its new tokens; 0: off; "
                        "default: 1)")
    p.add_argument("--shutdown-timeout", type=_float_in(0, strict=False), default=8.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM: waiting requests get a 503 at once, running ones this long to finish "
                        "before they end with a shutdown error (a stream's error event) at the next denoising step; "
                        "a second signal ends them at once; default 8, within docker stop's 10 s")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server log's level (default: info)")
    add_sampling_args(p, seed=False, server=True)


def _bind(host: str, port: int):
    """The server's socket, bound before the model loads (minutes for a big one): an address that cannot be bound
    fails at once in one line, and no other process can take the port meanwhile (it is held, not checked and let
    go); uvicorn listens on it. Port 0 binds a free port, which the banner then names."""
    import socket

    from ..errors import InputError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InputError(f"cannot resolve --host {host!r} ({e.strerror}); use an address such as 127.0.0.1 "
                         "or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, or stop the "
                         "process using it") from None
    return s


def _check_api_key(key: str | None) -> None:
    """HTTP clients send header values in ASCII (httpx, and so the openai client, refuse anything else):
    a key they cannot send is refused here, not met later as a 401 nobody can fix."""
    if key is not None and not (key.isascii() and key.isprintable() and key.strip() == key and key):
        from ..errors import InputError

        raise InputError("--api-key (or $BLOCKPRESS_API_KEY) must be printable ASCII without surrounding spaces: "
                         "HTTP clients cannot send other characters in a header; pick another key")


def _allowed_hosts(arg: str | None, host: str) -> list[str] | None:
    """--allowed-hosts, else the loopback names when bound to loopback (a DNS-rebinding page then cannot
    reach the server through a name of its own), else None (any)."""
    from ..server.middleware import LOOPBACK_HOSTS

    if arg:
        return [h.strip() for h in arg.split(",") if h.strip()]
    return LOOPBACK_HOSTS if host in LOOPBACK_HOSTS or host.startswith("127.") else None


def main(args) -> int:
    _check_api_key(args.api_key)
    if args.max_new_tokens is not None and args.max_new_tokens > args.max_tokens_limit:
        from ..errors import InputError

        raise InputError(f"--max-new-tokens {args.max_new_tokens} exceeds --max-tokens-limit {args.max_tokens_limit}; "
                         "lower it, raise the limit, or give -1 (the limit)")
    sock = _bind(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args, sock) -> int:
    import uvicorn

    from ..server.app import create_app
    from ..server.metrics import Metrics
    from ..server.protocol import Limits
    from ..server.worker import Worker
    from ..server.serving import OpenAIServing
    from ..loading import DEFAULT_CHAT_MODEL

    args.model = args.model or DEFAULT_CHAT_MODEL  # chat is what these commands are for: the shipped chat model
    lm = load_model(args)
    refuse_task_model(lm, "serve")
    name = args.served_model_name or (args.model.rstrip("/") if args.model and "/" in args.model.strip("/")
                                      and not os.path.isdir(args.model) else os.path.basename(str(lm.path).rstrip("/")))
    limits = Limits(max_tokens=args.max_tokens_limit, max_messages=args.max_messages,
                    max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
                    max_steps=args.max_steps_limit, max_choices=args.max_choices, max_prompts=args.max_prompts,
                    body_timeout=args.body_timeout,
                    default_max_tokens=args.max_tokens_limit if args.max_new_tokens == -1 else args.max_new_tokens)
    metrics = Metrics()
    worker = Worker(lm, max_batch=args.max_batch, queue_size=args.queue_size, metrics=metrics,
                    prefix_cache=int(args.prefix_cache_gb * 2**30))
    defaults = sampling_kwargs(args)
    defaults.pop("max_new_tokens", None)  # per request: max_tokens (the flag is Limits.default_max_tokens)
    serving = OpenAIServing(lm, worker, name, limits, defaults=defaults, metrics=metrics)
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    app = create_app(serving, metrics, api_key=args.api_key, allowed_origins=origins,
                     allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host))
    if lm.module.device.type == "cuda":  # kernel compiles and graph captures before the first client, not in it
        from ..errors import BlockpressError

        print("blockpress: warming up (Triton compiles, first-use checks, CUDA graphs)...", end=" ", flush=True)
        try:
            print(f"{worker.warm_up():.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one line for the user, not a traceback from inside a kernel
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BlockpressError(f"a first short generation failed on {lm.module.device} ({type(e).__name__}: {why}); "
                                  "with less GPU memory than the model needs, try --precision int4 --linears int8, "
                                  "or without CUDA graphs: --no-cuda-graphs") from None
    worker.start()
    port = sock.getsockname()[1]  # (--port 0: the one bound)
    print(f"blockpress: serving '{name}' on http://{args.host}:{port} (web page at /, API at /v1)", flush=True)

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame):
            """The first signal starts the drain, then uvicorn's graceful shutdown; a second ends the running
            requests at once, each with its shutdown error (uvicorn's own second Ctrl-C cancelled them mid-reply: a
            plain-text 500, streams cut, tracebacks); a third is uvicorn's: quit without waiting."""
            self.signals += 1
            if self.signals == 1:
                print(f"blockpress: shutting down: {worker.active} running request(s) get up to "
                      f"{args.shutdown_timeout:g} s to finish, {worker.queue_depth} waiting and new ones a 503",
                      flush=True)
                worker.drain(args.shutdown_timeout)
            elif self.signals == 2:
                print("blockpress: ending the running requests now (once more to quit without waiting)", flush=True)
                worker.drain(0)
                return
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)  # (a backstop: the drain ends rows)
    try:
        Server(config).run(sockets=[sock])
    finally:
        worker.stop()
    return 0
