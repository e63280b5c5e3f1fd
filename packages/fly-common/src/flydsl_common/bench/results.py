"""Benchmark results: rows, per-bench groups, and their renderings (JSON, markdown, table, PNG).

Split from :mod:`flydsl_common.bench.harness`, which produces them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flydsl.autotune.store import atomic_write_json

SCHEMA_VERSION = 1

# Keys of the ceilings dict; families may add their own measured ceilings
# (say an fp8 matmul peak) and point Bench.flops_ceiling at them.
COPY_GBPS = "copy_gbps"
MATMUL_BF16_TFLOPS = "matmul_bf16_tflops"

OK, SKIPPED, FAILED, ERROR = "ok", "skipped", "failed", "error"



@dataclass
class Row:
    """One (case, provider) measurement. ``status`` is ok, skipped, failed (wrong output) or error (raised)."""

    case: str
    params: dict
    provider: str
    is_ours: bool
    checked: bool
    status: str
    reason: str = ""
    rel_error: float | None = None
    tolerance: float | None = None
    time_us: float | None = None
    windows_us: list[float] = field(default_factory=list)
    calls_per_window: int | None = None
    spread: float | None = None  # (max - min) / median over windows: differences below it are noise
    bytes: int | None = None
    flops: int | None = None
    gbps: float | None = None
    tflops: float | None = None
    bw_fraction: float | None = None
    flops_fraction: float | None = None
    speedup: float | None = None  # best peer time / our time (ours only)
    best_peer: str | None = None


@dataclass
class BenchResult:
    """The rows of one benchmark, with what the reports need to draw them."""

    name: str
    x_param: str | None
    metric: str
    group_by: list[str]
    description: str
    rows: list[Row]


def _finite(v: Any) -> Any:
    """JSON has no NaN/inf: write them as null (the row's reason says what happened)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    return v


def _fmt(v: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _rate(v: float | None) -> str:
    """Rates keep three significant figures at most; tiny CPU rates still show."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _speedup(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _shown_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "quick"}


@dataclass
class Results:
    """Everything one run measured: environment identity, ceilings and per-bench rows."""

    env: dict
    ceilings: dict
    benches: list[BenchResult]

    # ---- queries

    def rows(self) -> list[Row]:
        return [r for b in self.benches for r in b.rows]

    def failures(self) -> list[Row]:
        """Rows whose provider produced a wrong result or raised."""
        return [r for r in self.rows() if r.status in (FAILED, ERROR)]

    def bench(self, name: str) -> BenchResult:
        for b in self.benches:
            if b.name == name:
                return b
        raise KeyError(f"no bench named {name!r} in these results")

    # ---- JSON

    def to_dict(self) -> dict:
        return _finite(
            {
                "schema": SCHEMA_VERSION,
                "env": self.env,
                "ceilings": self.ceilings,
                "benches": [asdict(b) for b in self.benches],
            }
        )

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write_json(path, self.to_dict(), indent=1)
        return path

    @classmethod
    def from_dict(cls, data: dict) -> Results:
        benches = []
        for b in data["benches"]:
            rows = [Row(**r) for r in b["rows"]]
            benches.append(BenchResult(**{**b, "rows": rows}))
        return cls(env=data["env"], ceilings=data.get("ceilings") or {}, benches=benches)

    @classmethod
    def load(cls, path: str | Path) -> Results:
        """Read a results JSON written by :meth:`to_json` (e.g. to re-plot it)."""
        import json

        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    # ---- text

    def _ceiling_lines(self) -> list[str]:
        c = self.ceilings or {}
        if not c:
            return ["ceilings: not measured (fractions of ceiling omitted)"]
        parts = []
        if c.get(COPY_GBPS) is not None:
            parts.append(f"device copy {c[COPY_GBPS]:.0f} GB/s (read + write)")
        if c.get(MATMUL_BF16_TFLOPS) is not None:
            shape = "x".join(str(s) for s in c.get("matmul_shape", []))
            parts.append(f"torch.matmul bf16 {shape} {c[MATMUL_BF16_TFLOPS]:.1f} TFLOP/s")
        lines = ["ceilings (measured in this run): " + "; ".join(parts)]
        if c.get("note"):
            lines.append(f"note: {c['note']}")
        return lines

    def _header_lines(self) -> list[str]:
        e = self.env
        versions = ", ".join(f"{k} {v}" for k, v in e.get("versions", {}).items())
        return [
            f"device: {e.get('device_name')} ({e.get('arch')}, backend {e.get('backend')})",
            f"versions: {versions}",
            f"date: {e.get('date')}",
            *self._ceiling_lines(),
        ]

    @staticmethod
    def _columns(b: BenchResult) -> tuple[bool, bool]:
        has_bw = any(r.gbps is not None for r in b.rows)
        has_fl = any(r.tflops is not None for r in b.rows)
        return has_bw, has_fl

    @staticmethod
    def _fraction(r: Row) -> str:
        parts = []
        if r.bw_fraction is not None:
            parts.append(_pct(r.bw_fraction) + (" bw" if r.flops_fraction is not None else ""))
        if r.flops_fraction is not None:
            parts.append(_pct(r.flops_fraction) + (" fl" if r.bw_fraction is not None else ""))
        return " / ".join(parts) or "-"

    @staticmethod
    def _status(r: Row) -> str:
        if r.status == OK:
            return "ok" if not r.checked else f"ok ({_fmt(r.rel_error, '.1e')})"
        label = {FAILED: "FAILED", ERROR: "ERROR", SKIPPED: "skipped"}.get(r.status, r.status)
        return f"{label}: {r.reason}" if r.reason else label

    def to_markdown(self, path: str | Path | None = None) -> str:
        """A table per bench (case, provider, time, rate, % of ceiling, speedup vs best peer); written when ``path``."""
        out = ["# Benchmark results", ""]
        out += [f"- {line}" for line in self._header_lines()]
        out.append("")
        out.append(
            "Time: median over timed windows. % of ceiling: achieved rate over the ceiling measured in this run "
            "(bw: device copy bandwidth, fl: matmul peak); an op that reads more than it writes can pass 100% "
            "of a copy's 1:1 mix. vs best peer: the fastest peer's time over ours "
            "(> 1: ours is faster). Check: relative error to the reference, checked before timing."
        )
        for b in self.benches:
            has_bw, has_fl = self._columns(b)
            out += ["", f"## {b.name}", ""]
            if b.description:
                out += [b.description, ""]
            head = ["case", "provider", "time (us)"]
            head += ["GB/s"] if has_bw else []
            head += ["TFLOP/s"] if has_fl else []
            head += ["% of ceiling", "vs best peer", "check"]
            out.append("| " + " | ".join(head) + " |")
            out.append(
                "|" + "|".join(" --- " if i < 2 or i == len(head) - 1 else " ---: " for i in range(len(head))) + "|"
            )
            for r in b.rows:
                name = f"**{r.provider}**" if r.is_ours else r.provider
                cells = [r.case, name, _fmt(r.time_us, ".2f")]
                cells += [_rate(r.gbps)] if has_bw else []
                cells += [_rate(r.tflops)] if has_fl else []
                cells += [self._fraction(r), _speedup(r.speedup), self._status(r).replace("|", "/")]
                out.append("| " + " | ".join(cells) + " |")
        text = "\n".join(out) + "\n"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
        return text

    def print_table(self, file=None) -> None:
        """A compact table on stdout (or ``file``)."""
        file = file or sys.stdout
        for line in self._header_lines():
            print(line, file=file)
        for b in self.benches:
            has_bw, has_fl = self._columns(b)
            width = max([len(r.case) for r in b.rows] + [4])
            pwidth = max([len(r.provider) for r in b.rows] + [8])
            head = f"{'case':<{width}}  {'provider':<{pwidth}} {'us':>10}"
            head += f" {'GB/s':>8}" if has_bw else ""
            head += f" {'TFLOP/s':>8}" if has_fl else ""
            head += f" {'%ceil':>11} {'speedup':>8}  status"
            print(f"\n[{b.name}]", file=file)
            print(head, file=file)
            print("-" * len(head), file=file)
            for r in b.rows:
                line = f"{r.case:<{width}}  {r.provider:<{pwidth}} {_fmt(r.time_us, '.2f'):>10}"
                line += f" {_rate(r.gbps):>8}" if has_bw else ""
                line += f" {_rate(r.tflops):>8}" if has_fl else ""
                line += f" {self._fraction(r):>11} {_speedup(r.speedup):>8}  {self._status(r)}"
                print(line, file=file)
        file.flush()

    # ---- plot

    def plot(self, path: str | Path) -> Path:
        """One panel per (bench, group): rate vs ``x_param`` per provider, dashed line at the ceiling."""
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt

        panels = []
        for b in self.benches:
            groups: dict[tuple, list[Row]] = {}
            for r in b.rows:
                groups.setdefault(tuple((k, r.params.get(k)) for k in b.group_by), []).append(r)
            for key, rows in groups.items():
                panels.append((b, key, rows))
        if not panels:
            raise ValueError("no results to plot")
        ncols = min(3, len(panels))
        nrows = math.ceil(len(panels) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        for ax, (b, key, rows) in zip(axes.flat, panels, strict=False):
            self._plot_panel(ax, b, key, rows)
        fig.suptitle(f"{self.env.get('device_name')} ({self.env.get('arch')}), {self.env.get('date', '')[:10]}")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _plot_panel(self, ax, b: BenchResult, key: tuple, rows: list[Row]) -> None:
        attr = {"GB/s": "gbps", "TFLOP/s": "tflops"}.get(b.metric, "time_us")
        xs_all = [r.params.get(b.x_param) if b.x_param else r.case for r in rows]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in xs_all)
        categories = list(dict.fromkeys(str(x) for x in xs_all))
        for provider in dict.fromkeys(r.provider for r in rows):
            pts = []
            for r in rows:
                y = getattr(r, attr)
                if r.provider != provider or r.status != OK or y is None:
                    continue
                x = r.params.get(b.x_param) if b.x_param else r.case
                pts.append((x if numeric else categories.index(str(x)), y))
            if not pts:
                continue
            pts.sort()
            ours = any(r.is_ours for r in rows if r.provider == provider)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linewidth=2.2 if ours else 1.4,
                linestyle="-" if ours else "--",
                label=provider,
            )
        ceiling = None
        if b.metric == "GB/s":
            ceiling, label = self.ceilings.get(COPY_GBPS), "device copy"
        elif b.metric == "TFLOP/s":
            ceiling, label = self.ceilings.get(MATMUL_BF16_TFLOPS), "matmul bf16 peak"
        if ceiling:
            ax.axhline(ceiling, color="gray", linestyle=":", linewidth=1.5, label=f"{label} ({ceiling:.0f})")
        if numeric:
            ax.set_xscale("log", base=2)
        else:
            ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
        ax.set_xlabel(b.x_param or "case")
        ax.set_ylabel(b.metric)
        ax.set_ylim(bottom=0)
        group = ", ".join(f"{v}" for _, v in key)
        ax.set_title(f"{b.name}" + (f" [{group}]" if group else ""), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
