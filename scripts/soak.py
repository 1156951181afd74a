"""Soak test of `blockpress serve` (opt-in; not part of pytest).

N concurrent streaming clients hammer a server on loopback for D seconds. Each client loops:
a chat completion with a random prompt, max_tokens and step count, streamed to the end (one in
ten also asks for draft frames, one in ten hangs up mid-stream to exercise slot release). Reports
completed / failed / rejected (429) / abandoned requests, tokens/s, latency percentiles and the
server's RSS before (after a warm-up) and after, and ends with one JSON line.

    python scripts/soak.py                      # tiny random model in a temp dir, 64 clients, 60 s
    python scripts/soak.py --model DIR --clients 64 --duration 60
    python scripts/soak.py --url http://127.0.0.1:8000   # an already running server (RSS via --pid)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = "the sky is blue because air scatters light more than red sea water reflects color model answer".split()


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def tiny_model(folder: Path) -> Path:
    import blockpress
    from blockpress.testing import build_tiny_gemma_tokenizer

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                             "sliding_attention", "full_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, num_experts=8, top_k_experts=3, moe_intermediate_size=24,
                sliding_window=8, max_position_embeddings=4096)
    blockpress.from_config({"model_type": "diffusion_gemma", "canvas_length": 16, "text_config": text},
                           seed=0).save(folder)
    build_tiny_gemma_tokenizer(folder)
    return folder


def start_server(model: str, max_batch: int, queue_size: int, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "blockpress", "serve", model, "--port", str(port),
                             "--threads", str(threads), "--max-batch", str(max_batch), "--queue-size",
                             str(queue_size), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server did not start")


class Stats:
    def __init__(self):
        self.completed = self.failed = self.rejected = self.abandoned = self.tokens = 0
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}

    def error(self, what: str) -> None:
        self.failed += 1
        self.errors[what] = self.errors.get(what, 0) + 1


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, stats: Stats) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(8, 64),
            "steps": rng.randint(2, 8), "seed": rng.randrange(1 << 31), "stream": True,
            "stream_options": {"include_usage": True, "include_drafts": rng.random() < 0.1}}
    hang_up = rng.random() < 0.1
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code == 429:
                stats.rejected += 1
                await asyncio.sleep(0.2)
                return
            if r.status_code != 200:
                stats.error(f"http {r.status_code}")
                return
            finish, usage, chunks = None, None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.error("stream error: " + chunk["error"]["message"][:60])
                    return
                chunks += 1
                for c in chunk.get("choices", []):
                    finish = c.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
                if hang_up and chunks >= 3:
                    stats.abandoned += 1
                    return
            if finish is None or usage is None:
                stats.error("stream ended without finish_reason/usage")
                return
            stats.completed += 1
            stats.tokens += usage["completion_tokens"]
            stats.latencies.append(time.perf_counter() - t0)
    except httpx.HTTPError as e:
        stats.error(type(e).__name__)


async def soak(url: str, clients: int, duration: float, seed: int) -> Stats:
    stats = Stats()
    deadline = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as client:
        async def worker(i: int):
            rng = random.Random(seed * 1000 + i)
            while time.perf_counter() < deadline:
                await one_request(client, url, rng, stats)

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return stats


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: a tiny random model in a temp dir)")
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--queue-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    proc = None
    tmp = tempfile.TemporaryDirectory(prefix="blockpress-soak-")
    try:
        if args.url:
            url, pid = args.url.rstrip("/"), args.pid
        else:
            model = args.model or str(tiny_model(Path(tmp.name) / "tiny"))
            proc, url = start_server(model, args.max_batch, args.queue_size, args.threads)
            pid = proc.pid
        asyncio.run(soak(url, min(args.clients, 4), 3.0, args.seed + 1))  # warm-up
        rss_before = rss_mb(pid)
        t0 = time.perf_counter()
        stats = asyncio.run(soak(url, args.clients, args.duration, args.seed))
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        health = httpx.get(url + "/health", timeout=10).json()
        rss_after = rss_mb(pid)
        alive = proc is None or proc.poll() is None
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    result = {
        "clients": args.clients, "duration_s": round(wall, 1), "completed": stats.completed, "failed": stats.failed,
        "rejected_429": stats.rejected, "abandoned": stats.abandoned, "errors": stats.errors,
        "completion_tokens": stats.tokens, "requests_per_s": round(stats.completed / wall, 2),
        "tokens_per_s": round(stats.tokens / wall, 1), "latency_p50_s": pct(stats.latencies, 0.5),
        "latency_p95_s": pct(stats.latencies, 0.95), "rss_before_mb": rss_before and round(rss_before, 1),
        "rss_after_mb": rss_after and round(rss_after, 1), "server_alive": alive,
        "active_after": health.get("active"), "queue_after": health.get("queue_depth"),
    }
    print(f"{stats.completed} completed, {stats.failed} failed, {stats.rejected} rejected (429), "
          f"{stats.abandoned} abandoned in {wall:.0f}s with {args.clients} clients; "
          f"{result['tokens_per_s']} tokens/s; p50 {result['latency_p50_s']}s p95 {result['latency_p95_s']}s; "
          f"server RSS {result['rss_before_mb']} -> {result['rss_after_mb']} MB")
    print(json.dumps(result))
    return 0 if alive and stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
