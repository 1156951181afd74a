"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters, gauges and histograms are thread-safe (the scheduler thread and the event loop both
update them). `Metrics.render()` returns the `/metrics` body. Label values are escaped; callers
keep label cardinality bounded (the HTTP middleware maps unknown paths to "other").
"""

from __future__ import annotations

import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    esc = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, esc)) + "}"


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) > 2**53 else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help_text, labels
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help_text, labels=()):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *label_values: str) -> None:
        with self._lock:
            self._values[label_values] = self._values.get(label_values, 0.0) + amount

    def value(self, *label_values: str) -> float:
        return self._values.get(label_values, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, help_text):
        super().__init__(name, help_text)
        self._value = 0.0

    def set(self, value: float) -> None:
        self._value = float(value)

    def value(self) -> float:
        return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_num(self._value)}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help_text, buckets: tuple[float, ...]):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            self._count += 1
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self._counts[i] += 1

    @property
    def count(self) -> int:
        return self._count

    @property
    def total(self) -> float:
        """The sum of the observed values."""
        return self._sum

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines = self.header()
        for b, c in zip(self.buckets, counts):
            lines.append(f'{self.name}_bucket{{le="{_num(b)}"}} {c}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {n}', f"{self.name}_sum {_num(total)}", f"{self.name}_count {n}"]
        return lines


_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every metric the server exposes."""

    def __init__(self):
        p = "blockpress_"
        self.requests = Counter(p + "requests_total", "HTTP requests by endpoint and status code (499: the client "
                                "hung up before its reply was complete).", ("endpoint", "status"))
        self.cancelled = Counter(p + "requests_cancelled_total",
                                 "Generation rows (a request's n choices and prompts each count) abandoned because "
                                 "the client went away.")
        self.generated_tokens = Counter(p + "generated_tokens_total", "Completion tokens returned to clients.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens received.")
        self.prefix_hits = Counter(p + "prefix_cache_hits_total", "Prompts that reused a kept prefix's K/V.")
        self.prefix_tokens = Counter(p + "prefix_cache_tokens_total", "Prompt tokens whose K/V came from the prefix "
                                     "cache instead of the encoder.")
        self.forward_passes = Counter(p + "forward_passes_total",
                                      "Decoder passes spent on finished requests (per request row).")
        self.tokens_per_forward = Histogram(p + "tokens_per_forward", "Completion tokens per decoder pass, "
                                            "per request.", (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.step_seconds = Histogram(p + "step_seconds", "Latency of one batched denoising step.", _LATENCY)
        self.batch_rows = Histogram(p + "batch_rows", "Rows denoised together, per denoising step.",
                                    (1, 2, 4, 8, 16, 32, 64, 128))
        self.canvas_seconds = Histogram(p + "canvas_seconds", "Latency of one batched canvas.", _LATENCY)
        self.queue_seconds = Histogram(p + "queue_seconds", "Time a request waited before joining a batch.",
                                       _LATENCY)
        self.queue_depth = Gauge(p + "queue_depth", "Rows waiting to join a batch (a request's n choices and "
                                 "prompts each count).")
        self.active_requests = Gauge(p + "active_requests", "Rows being denoised (a request's n choices and prompts "
                                     "each count).")

    def render(self) -> str:
        lines: list[str] = []
        for m in vars(self).values():
            if isinstance(m, _Metric):
                lines += m.render()
        return "\n".join(lines) + "\n"
