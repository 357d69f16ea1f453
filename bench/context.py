"""What a benchmark gets to work with (`Ctx`) and what it hands back (`Results`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any


class Skip(Exception):
    """Raised by a benchmark that cannot run here; the message says why (and what to install)."""


@dataclasses.dataclass
class Metric:
    key: str  # "<bench>.<name>", e.g. "flight_raw.narrow_rows_per_s"
    value: float
    unit: str
    label: str


class Results:
    """Figures, skips and plot series of one run; serialisable to JSON."""

    def __init__(self) -> None:
        self.metrics: dict[str, Metric] = {}
        self.skipped: dict[str, str] = {}
        self.series: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}

    def get(self, key: str) -> float | None:
        m = self.metrics.get(key)
        return None if m is None else m.value

    def to_json(self) -> dict[str, Any]:
        return {
            "metrics": {k: dataclasses.asdict(m) for k, m in self.metrics.items()},
            "skipped": self.skipped,
            "series": self.series,
            "seconds": self.seconds,
        }


@dataclasses.dataclass
class Ctx:
    """Run settings plus the recorder handed to each benchmark's ``run(ctx)``."""

    bench: str
    results: Results
    out_dir: Path
    quick: bool = False
    full: bool = False
    store_uri: str | None = None  # an already running expstore server to use instead of starting one
    cleanup: list[Any] = dataclasses.field(default_factory=list)

    def record(self, name: str, value: float, unit: str, label: str) -> None:
        key = f"{self.bench}.{name}"
        self.results.metrics[key] = Metric(key, float(value), unit, label)
        print(f"  {label:<58} {fmt(value, unit)}", flush=True)

    def series(self, name: str, data: Any) -> None:
        self.results.series[f"{self.bench}.{name}"] = data

    def pick(self, quick: Any, normal: Any, full: Any = None) -> Any:
        """A size or duration for the current mode."""
        if self.full and full is not None:
            return full
        return quick if self.quick else normal


def fmt(value: float | None, unit: str) -> str:
    """A figure with its unit, in a width that lines up in tables."""
    if value is None:
        return "—"
    if unit in ("rows/s", "calls/s", "puts/s", "samples/s", "claims/s", "tokens/s"):
        if value >= 1e6:
            return f"{value / 1e6:.2f} M {unit}"
        if value >= 1e3:
            return f"{value / 1e3:.1f} k {unit}"
        return f"{value:.0f} {unit}"
    if unit == "ms":
        return f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"
    if unit in ("MB/s", "MB", "s"):
        return f"{value:.1f} {unit}" if value >= 10 else f"{value:.2f} {unit}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:.1f}%"
    return f"{value:g} {unit}"


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
