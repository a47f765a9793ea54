"""How a run is shown: a table per run, a JSON result, and (optionally) a PNG chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.common import print_table

BUSY = 0.10  # other processes' CPU share above which a row is flagged
PLOT_HINT = "--plot needs matplotlib: .venv/bin/pip install -c constraints.txt -e '.[bench]'"


def require_matplotlib() -> None:
    """Raise SystemExit with the install command unless matplotlib imports (checked before a
    long run starts, not after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(PLOT_HINT) from None


def print_systems(summaries: list[dict[str, Any]], optimal_hit_rate: float | None) -> None:
    """One row per system: throughput, TTFT and ITL percentiles, cache hit rates."""
    headers = [
        "system", "calls", "out tok", "wall s", "tok/s", "req/s", "TTFT p50 s", "p90", "p99",
        "ITL p50 ms", "p90", "p99", "hit rate", "optimal", "others' CPU",
    ]  # fmt: skip
    rows = [
        [
            s["system"], s["calls"], s["output_tokens"], s["wall_s"], s["output_tokens_per_s"],
            s["requests_per_s"], s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"],
            s["itl_p50_ms"], s["itl_p90_ms"], s["itl_p99_ms"], _rate(s["cache_hit_rate"]),
            _rate(optimal_hit_rate), _rate(s.get("other_cpu_share")),
        ]
        for s in summaries
    ]  # fmt: skip
    print_table(headers, rows)
    for s in summaries:
        if s["note"]:
            print(f"  {s['system']}: {s['note']}")
        if (s.get("other_cpu_share") or 0) > BUSY:
            print(
                f"  warning: other processes used {s['other_cpu_share']:.0%} of the CPU while "
                f"{s['system']} ran; its numbers are slowed by them"
            )


def ratio_lines(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Arbor's output tokens/s over each baseline's (the work is the same calls and token
    counts, so this is also the ratio of wall times)."""
    ours = summaries[0]["output_tokens_per_s"]
    return {
        s["system"]: ours / s["output_tokens_per_s"]
        for s in summaries[1:]
        if s["output_tokens_per_s"] > 0
    }


def plot(path: str, title: str, summaries: list[dict[str, Any]]) -> Path:
    """A PNG with three panels: output tokens/s, TTFT p50/p90/p99, ITL p50/p90/p99, one bar
    (group) per system. Small (about 30 KB) so it can be committed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s["system"] for s in summaries]
    figure, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=80)
    axes[0].bar(systems, [s["output_tokens_per_s"] for s in summaries], color="#4c72b0")
    axes[0].set_title("output tokens/s (higher is better)")
    for axis, key, unit in ((axes[1], "ttft_p{}_s", "TTFT, s"), (axes[2], "itl_p{}_ms", "ITL, ms")):
        width = 0.8 / 3
        for j, q in enumerate((50, 90, 99)):
            values = [_finite(s[key.format(q)]) for s in summaries]
            positions = [i + (j - 1) * width for i in range(len(systems))]
            axis.bar(positions, values, width, label=f"p{q}")
        axis.set_xticks(range(len(systems)), systems)
        axis.set_title(f"{unit} (lower is better)")
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    print(f"wrote {out}")
    return out


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _finite(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def format_load(load: tuple[float, float, float]) -> str:
    """A load average triple as ``os.getloadavg`` gives it: "1.20 0.85 0.60"."""
    return " ".join(f"{x:.2f}" for x in load)
