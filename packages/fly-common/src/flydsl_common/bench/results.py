"""Benchmark results: rows, per-bench groups, the ratio summary and their renderings (JSON, markdown, table, PNG).

Split from :mod:`flydsl_common.bench.harness`, which produces them.

Each (case, provider) row carries up to four timings (see :data:`TIMINGS`):
``gpu_us`` (GPU time, host hidden), ``call_us`` (one public call at a time,
host included), ``step_us`` (forward + backward on a fresh graph) and
``host_us`` (per-call host cost). For each timing an ours row gets the ratio
``best peer's time / ours`` (> 1: ours is faster). The summary condenses those
ratios per bench and over all benches into n, min, p10 and geometric mean.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flydsl.autotune.store import atomic_write_json
from flydsl.errors import ArgumentError

# 2: three timings a row (gpu_us, call_us, step_us; host_us), speedups / best_peers per timing,
#    per-bench timings, the ratio summary and the sweep's seed (1: one time_us, one speedup).
SCHEMA_VERSION = 2

# Keys of the ceilings dict; families may add their own measured ceilings
# (say an fp8 matmul peak) and point Bench.flops_ceiling at them.
COPY_GBPS = "copy_gbps"
MATMUL_BF16_TFLOPS = "matmul_bf16_tflops"

OK, SKIPPED, FAILED, ERROR = "ok", "skipped", "failed", "error"

# The timings a bench can measure, in the order tables show them: what a user's loop sees (call) and a
# training step (step) first, then the GPU time (gpu) the rates come from, then the host cost (host).
TIMINGS = ("call", "step", "gpu", "host")
_LABEL = {"call": "call", "step": "step", "gpu": "gpu", "host": "host"}


@dataclass
class Row:
    """One (case, provider) measurement. ``status`` is ok, skipped, failed (wrong output) or error (raised).

    ``gpu_us`` / ``call_us`` / ``step_us`` / ``host_us``: the median time a call of each timing the bench
    measures (None when not measured: a timing the bench does not take, a provider without a step, a
    failed check). ``speedups`` / ``best_peers`` (ours only): per timing key ("gpu", "call", "step",
    "host"), the fastest peer's time over ours and that peer's name. ``windows_us``,
    ``calls_per_window`` and ``spread`` ((max - min) / median over windows: differences below it are
    noise) are per timing key too. Rates and fractions come from ``gpu_us``.
    """

    case: str
    params: dict
    provider: str
    is_ours: bool
    checked: bool
    status: str
    reason: str = ""
    rel_error: float | None = None
    tolerance: float | None = None
    gpu_us: float | None = None
    call_us: float | None = None
    step_us: float | None = None
    host_us: float | None = None
    windows_us: dict[str, list[float]] = field(default_factory=dict)
    calls_per_window: dict[str, int] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)
    bytes: int | None = None
    flops: int | None = None
    gbps: float | None = None
    tflops: float | None = None
    bw_fraction: float | None = None
    flops_fraction: float | None = None
    speedups: dict[str, float] = field(default_factory=dict)
    best_peers: dict[str, str] = field(default_factory=dict)

    def us(self, timing: str) -> float | None:
        """The time of ``timing`` ("gpu", "call", "step" or "host")."""
        if timing not in TIMINGS:
            raise ArgumentError(f"Row.us: timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
        return getattr(self, f"{timing}_us")


@dataclass
class BenchResult:
    """The rows of one benchmark, with what the reports need to draw them (``timings``: those it measures)."""

    name: str
    x_param: str | None
    metric: str
    group_by: list[str]
    description: str
    rows: list[Row]
    timings: list[str] = field(default_factory=lambda: ["gpu", "call", "step"])
    date: str = ""  # when the bench finished (UTC, ISO): benches merged from several runs keep their own
    # Timed with the CLI's --profile on: cProfile was active, which inflates every host-side timing (call,
    # step, host) by the profiler's per-call overhead; the report says so beside the bench.
    profiled: bool = False

    def shown_timings(self) -> list[str]:
        """The measured timings in table order (:data:`TIMINGS`), those with no value in any row left out."""
        return [t for t in TIMINGS if t in self.timings and any(r.us(t) is not None for r in self.rows)]


# ------------------------------------------------------------------ summary


def ratio_stats(values: list[float]) -> dict | None:
    """n, min, p10 and geometric mean of positive ratios (None when there are none).

    p10 interpolates linearly between the order statistics at rank ``0.1 * (n - 1)``
    (numpy's default percentile), so with n < 11 it lies between the smallest two.
    """
    vals = sorted(float(v) for v in values if v is not None and math.isfinite(v) and v > 0)
    if not vals:
        return None
    pos = 0.1 * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    p10 = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    geomean = math.exp(sum(math.log(v) for v in vals) / len(vals))
    return {"n": len(vals), "min": vals[0], "p10": p10, "geomean": geomean}


def summarize(benches: list[BenchResult]) -> dict:
    """The ratio summary: per (bench, our provider) and over every bench, per timing, :func:`ratio_stats`
    of ``speedups[timing]`` (best peer / ours). A timing with no ratio is None."""
    entries = []
    pooled: dict[str, list[float]] = {t: [] for t in TIMINGS}
    for b in benches:
        for provider in dict.fromkeys(r.provider for r in b.rows if r.is_ours):
            mine = [r for r in b.rows if r.is_ours and r.provider == provider]
            entry: dict[str, Any] = {"bench": b.name, "provider": provider}
            for t in TIMINGS:
                vals = [r.speedups[t] for r in mine if t in r.speedups]
                pooled[t] += vals
                entry[t] = ratio_stats(vals)
            entries.append(entry)
    return {"timings": list(TIMINGS), "benches": entries, "family": {t: ratio_stats(pooled[t]) for t in TIMINGS}}


# ------------------------------------------------------------------ formats


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


def _us(v: float | None) -> str:
    """Times keep about three significant figures; sub-microsecond ones still show."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _rate(v: float | None) -> str:
    """Rates keep three significant figures at most; tiny CPU rates still show."""
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _speedup(v: float | None) -> str:
    """Two decimals; ratios below 0.1 keep three significant figures (0.0042x, not 0.00x)."""
    if v is None:
        return "-"
    return f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"


def _stats_cell(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{_speedup(s['min'])} / {_speedup(s['p10'])} / **{_speedup(s['geomean'])}** (n={s['n']})"


@dataclass
class Results:
    """Everything one run measured: environment identity, ceilings and per-bench rows.

    ``sweep``: for a run over a bench's sweep (unseen random shapes), ``{"seed", "count",
    "cases_per_bench"}``; None for the tuned set.
    """

    env: dict
    ceilings: dict
    benches: list[BenchResult]
    sweep: dict | None = None

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

    def summary(self) -> dict:
        """:func:`summarize` of these results."""
        return summarize(self.benches)

    def merged_with(self, earlier: Results, order: Sequence[str]) -> tuple[Results, str]:
        """These results plus the benches of ``earlier`` that this run did not re-run, in ``order`` (bench
        names; others of ``earlier`` are dropped), and a note of what was kept. A family's run can then be
        made in parts (``--only``) that add up to one result set. Nothing is merged (the note says why) when
        ``earlier`` comes from another device, or is a sweep where these are not (or of another seed)."""
        if earlier.env.get("device_name") != self.env.get("device_name"):
            return self, f"not merged: earlier results are from {earlier.env.get('device_name')!r}"
        if bool(earlier.sweep) != bool(self.sweep) or (
            self.sweep and earlier.sweep.get("seed") != self.sweep.get("seed")
        ):
            return self, "not merged: earlier results are of another shape set (tuned vs sweep, or another seed)"
        mine = {b.name: b for b in self.benches}
        theirs = {b.name: b for b in earlier.benches}
        kept = [n for n in order if n not in mine and n in theirs]
        benches = [mine.get(n) or theirs[n] for n in order if n in mine or n in theirs]
        sweep = self.sweep
        if sweep and earlier.sweep:
            counts = {**earlier.sweep.get("cases_per_bench", {}), **sweep.get("cases_per_bench", {})}
            sweep = {**sweep, "cases_per_bench": {n: counts[n] for n in order if n in counts}}
        merged = Results(env=self.env, ceilings=self.ceilings, benches=benches, sweep=sweep)
        return merged, f"kept from the earlier run: {', '.join(kept) or 'nothing'}"

    # ---- JSON

    def to_dict(self) -> dict:
        return _finite(
            {
                "schema": SCHEMA_VERSION,
                "env": self.env,
                "ceilings": self.ceilings,
                "sweep": self.sweep,
                "summary": self.summary(),
                "benches": [asdict(b) for b in self.benches],
            }
        )

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        atomic_write_json(path, self.to_dict(), indent=1)
        return path

    @classmethod
    def from_dict(cls, data: dict) -> Results:
        """Rebuild results from :meth:`to_dict`'s form ("summary" is recomputed from the rows)."""
        if data.get("schema") != SCHEMA_VERSION:
            raise ArgumentError(
                f"Results.from_dict: data must be results schema {SCHEMA_VERSION}, got schema {data.get('schema')!r} "
                "(run the benchmark again to write the current form)"
            )
        benches = []
        for b in data["benches"]:
            rows = [Row(**r) for r in b["rows"]]
            benches.append(BenchResult(**{**b, "rows": rows}))
        return cls(env=data["env"], ceilings=data.get("ceilings") or {}, benches=benches, sweep=data.get("sweep"))

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
        lines = [
            f"device: {e.get('device_name')} ({e.get('arch')}, backend {e.get('backend')})",
            f"versions: {versions}",
            f"date: {e.get('date')}",
        ]
        if self.sweep:
            lines.append(
                f"sweep: {sum(self.sweep.get('cases_per_bench', {}).values())} random shapes, "
                f"seed {self.sweep.get('seed')} (repeat with --sweep-only --seed {self.sweep.get('seed')})"
            )
        return lines + self._ceiling_lines()

    def _summary_timings(self) -> list[str]:
        shown: set[str] = set()
        for b in self.benches:
            shown.update(b.shown_timings())
        return [t for t in TIMINGS if t in shown]

    def summary_markdown(self) -> list[str]:
        """The summary table: per bench (and our provider) and over all benches, min / p10 / geomean of the
        ratio to the best peer for each timing, call and step first."""
        timings = self._summary_timings()
        s = self.summary()
        head = ["bench", "ours"] + [f"{_LABEL[t]}: min / p10 / geomean" for t in timings]
        out = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] * 2 + [" ---: "] * len(timings)) + "|"]
        for e in s["benches"]:
            out.append("| " + " | ".join([e["bench"], e["provider"]] + [_stats_cell(e[t]) for t in timings]) + " |")
        fam = s["family"]
        out.append("| " + " | ".join(["**all benches**", ""] + [_stats_cell(fam[t]) for t in timings]) + " |")
        return out

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
            text = "ok" if not r.checked else f"ok ({_fmt(r.rel_error, '.1e')})"
            return f"{text}; {r.reason}" if r.reason else text
        label = {FAILED: "FAILED", ERROR: "ERROR", SKIPPED: "skipped"}.get(r.status, r.status)
        return f"{label}: {r.reason}" if r.reason else label

    def to_markdown(self, path: str | Path | None = None) -> str:
        """The ratio summary, then a table per bench (case, provider, each timing with its ratio to the best
        peer, rate, % of ceiling, check); written when ``path``."""
        title = "# Benchmark results" + (" (sweep: unseen random shapes)" if self.sweep else " (tuned shape set)")
        out = [title, "", "Ratio to the best peer (best peer's time / ours; > 1: ours is faster), per timing:", ""]
        out += self.summary_markdown()
        out.append("")
        out += [f"- {line}" for line in self._header_lines()]
        out += [
            "",
            "Timings (median over timed windows, us a call): call = one public call at a time, host included "
            "(the GPU drained before each call); step = forward + backward on a fresh autograd graph, weight "
            "gradients included, timed like call; gpu = GPU time with the host hidden (launches queued behind a "
            "GPU sleep); host = per-call host cost (calls back to back, no synchronization). Inputs rotate past "
            "L2 for every timing. vs best: the fastest peer's time over ours for that timing (> 1: ours is "
            "faster). Rates and % of ceiling come from gpu, against the ceilings measured in this run (bw: "
            "device copy, fl: matmul peak); an op that reads more than it writes can pass 100% of a copy's 1:1 "
            "mix. Check: relative error to the reference, checked once before any timing (a failed check is "
            "never timed).",
        ]
        for b in self.benches:
            has_bw, has_fl = self._columns(b)
            timings = b.shown_timings()
            out += ["", f"## {b.name}", ""]
            if b.description:
                out += [b.description, ""]
            if b.date:
                out += [f"Run finished {b.date}.", ""]
            if b.profiled:
                out += [
                    "**Timed under cProfile** (`--profile`): call, step and host timings include the profiler's "
                    "overhead on every Python call; compare them only with another profiled run.",
                    "",
                ]
            head = ["case", "provider"]
            for t in timings:
                head += [f"{_LABEL[t]} (us)", "vs best"]
            head += ["GB/s"] if has_bw else []
            head += ["TFLOP/s"] if has_fl else []
            head += ["% of ceiling"] if has_bw or has_fl else []
            head += ["check"]
            out.append("| " + " | ".join(head) + " |")
            out.append(
                "|" + "|".join(" --- " if i < 2 or i == len(head) - 1 else " ---: " for i in range(len(head))) + "|"
            )
            for r in b.rows:
                cells = [r.case, f"**{r.provider}**" if r.is_ours else r.provider]
                for t in timings:
                    cells += [_us(r.us(t)), _speedup(r.speedups.get(t))]
                cells += [_rate(r.gbps)] if has_bw else []
                cells += [_rate(r.tflops)] if has_fl else []
                cells += [self._fraction(r)] if has_bw or has_fl else []
                cells += [self._status(r).replace("|", "/")]
                out.append("| " + " | ".join(cells) + " |")
        text = "\n".join(out) + "\n"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
        return text

    def print_table(self, file=None) -> None:
        """A compact table on stdout (or ``file``), the ratio summary last."""
        file = file or sys.stdout
        for line in self._header_lines():
            print(line, file=file)
        for b in self.benches:
            has_bw, has_fl = self._columns(b)
            timings = b.shown_timings()
            width = max([len(r.case) for r in b.rows] + [4])
            pwidth = max([len(r.provider) for r in b.rows] + [8])
            head = f"{'case':<{width}}  {'provider':<{pwidth}}"
            for t in timings:
                head += f" {_LABEL[t] + ' us':>9} {'x':>6}"
            head += f" {'GB/s':>8}" if has_bw else ""
            head += f" {'TFLOP/s':>8}" if has_fl else ""
            head += f" {'%ceil':>11}  status"
            print(f"\n[{b.name}]", file=file)
            print(head, file=file)
            print("-" * len(head), file=file)
            for r in b.rows:
                line = f"{r.case:<{width}}  {r.provider:<{pwidth}}"
                for t in timings:
                    line += f" {_us(r.us(t)):>9} {_speedup(r.speedups.get(t)):>6}"
                line += f" {_rate(r.gbps):>8}" if has_bw else ""
                line += f" {_rate(r.tflops):>8}" if has_fl else ""
                line += f" {self._fraction(r):>11}  {self._status(r)}"
                print(line, file=file)
        print("\nratio to the best peer (min / p10 / geomean):", file=file)
        s = self.summary()
        for e in [*s["benches"], {"bench": "all benches", "provider": "", **s["family"]}]:
            parts = [f"{_LABEL[t]} {_stats_cell(e[t]).replace('**', '')}" for t in self._summary_timings() if e[t]]
            print(f"  {e['bench']} {e['provider']}: " + ("; ".join(parts) or "-"), file=file)
        file.flush()

    # ---- plot

    def plot(self, path: str | Path) -> Path:
        """Every timing in one figure. Tuned set: one column per (bench, group), one row per timing (gpu:
        the rate against ``x_param`` with the ceiling dashed; call / step / host: us against ``x_param``,
        log scale), one line per provider. Sweep: one column per bench, one row per timing, the ratio to
        the best peer of each random shape, sorted, with 1.0 (parity) and the geomean marked."""
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt

        timings = self._summary_timings()
        if self.sweep:
            panels = [(b, (), b.rows) for b in self.benches if any(r.speedups for r in b.rows)]
            draw = self._plot_sweep_panel
        else:
            panels = []
            for b in self.benches:
                groups: dict[tuple, list[Row]] = {}
                for r in b.rows:
                    groups.setdefault(tuple((k, r.params.get(k)) for k in b.group_by), []).append(r)
                panels += [(b, key, rows) for key, rows in groups.items()]
            draw = self._plot_panel
        if not panels or not timings:
            raise ValueError("no results to plot")
        ncols = min(4, len(panels))
        blocks = math.ceil(len(panels) / ncols)
        nrows = blocks * len(timings)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 3.3 * nrows), squeeze=False)
        for ax in axes.flat:
            ax.set_visible(False)
        for i, (b, key, rows) in enumerate(panels):
            block, col = divmod(i, ncols)
            for j, t in enumerate(timings):
                if t not in b.shown_timings():
                    continue
                ax = axes[block * len(timings) + j][col]
                ax.set_visible(True)
                draw(ax, b, key, rows, t)
        kind = "sweep" if self.sweep else "tuned set"
        fig.suptitle(
            f"{self.env.get('device_name')} ({self.env.get('arch')}), {kind}, {str(self.env.get('date', ''))[:10]}"
        )
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90 if nrows * ncols > 24 else 110)
        plt.close(fig)
        return path

    def _plot_panel(self, ax, b: BenchResult, key: tuple, rows: list[Row], timing: str) -> None:
        metric = b.metric if timing == "gpu" else "us"
        attr = {"GB/s": "gbps", "TFLOP/s": "tflops"}.get(metric, f"{timing}_us")
        xs_all = [r.params.get(b.x_param) if b.x_param else r.case for r in rows]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in xs_all)
        categories = list(dict.fromkeys(str(x) for x in xs_all))
        for provider in dict.fromkeys(r.provider for r in rows):
            pts = []
            for r in rows:
                y = getattr(r, attr)
                if r.provider != provider or y is None or r.us(timing) is None:
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
                markersize=4,
                linewidth=2.2 if ours else 1.4,
                linestyle="-" if ours else "--",
                label=provider,
            )
        ceiling = None
        if metric == "GB/s":
            ceiling, label = self.ceilings.get(COPY_GBPS), "device copy"
        elif metric == "TFLOP/s":
            ceiling, label = self.ceilings.get(MATMUL_BF16_TFLOPS), "matmul bf16 peak"
        if ceiling:
            ax.axhline(ceiling, color="gray", linestyle=":", linewidth=1.5, label=f"{label} ({ceiling:.0f})")
        if numeric:
            ax.set_xscale("log", base=2)
        else:
            ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=7)
        ax.set_xlabel(b.x_param or "case")
        if metric == "us":
            from matplotlib.ticker import FormatStrFormatter

            ax.set_ylabel(f"{_LABEL[timing]} us a call (lower is better)")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 20, not 2 x 10^1
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        else:
            ax.set_ylabel(f"{metric} (from gpu time)")
            ax.set_ylim(bottom=0)
        group = ", ".join(f"{v}" for _, v in key)
        ax.set_title(f"{b.name}" + (f" [{group}]" if group else "") + f": {_LABEL[timing]}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)

    def _plot_sweep_panel(self, ax, b: BenchResult, key: tuple, rows: list[Row], timing: str) -> None:
        for provider in dict.fromkeys(r.provider for r in rows if r.is_ours):
            vals = sorted(r.speedups[timing] for r in rows if r.provider == provider and timing in r.speedups)
            if not vals:
                continue
            (line,) = ax.plot(range(1, len(vals) + 1), vals, marker="o", markersize=3, linewidth=1.2, label=provider)
            s = ratio_stats(vals)
            ax.axhline(s["geomean"], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"geomean {s['geomean']:.2f}x, p10 {s['p10']:.2f}x, min {s['min']:.2f}x")  # fmt: skip
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1.5, label="parity with the best peer")
        ax.set_xlabel("shapes, sorted by ratio")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel(f"{_LABEL[timing]}: best peer / ours")
        ax.set_title(f"{b.name}: {_LABEL[timing]}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
