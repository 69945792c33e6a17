"""`--plot FILE.png` of the benchmarks: the throughput–latency curve and latency percentiles."""

from __future__ import annotations

from collections.abc import Sequence


def plot_latency_curve(points: Sequence[dict], path: str, title: str) -> None:
    """points: {"label", "output_throughput", and for each of ttft/tpot/e2e a dict of
    mean_ms/median_ms/p99_ms}, one per request rate or concurrency, in sweep order."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the Makefile installs it
        raise RuntimeError("--plot needs matplotlib: pip install 'pagedserve[plot]'") from exc

    metrics = [m for m in ("ttft", "tpot", "itl", "e2e") if all(m in p for p in points)]
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    throughput = [p["output_throughput"] for p in points]
    for metric, marker in zip(metrics, "os^D"):
        line, = curve.plot(throughput, [p[metric]["median_ms"] for p in points], marker=marker, label=f"{metric.upper()} median")
        curve.plot(throughput, [p[metric]["p99_ms"] for p in points], marker=marker, linestyle="--",
                   color=line.get_color(), label=f"{metric.upper()} p99")
    for p, x in zip(points, throughput):
        curve.annotate(p["label"], (x, p[metrics[0]]["median_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    curve.set_xlabel("output throughput (tok/s)")
    curve.set_ylabel("latency (ms)")
    curve.set_yscale("log")
    curve.set_title("throughput against latency")
    curve.grid(True, which="both", alpha=0.3)
    curve.legend(fontsize=8)

    width = 0.8 / (2 * len(metrics))
    for i, metric in enumerate(metrics):
        for j, stat in enumerate(("median_ms", "p99_ms")):
            offset = (2 * i + j) * width - 0.4 + width / 2
            bars.bar([k + offset for k in range(len(points))], [p[metric][stat] for p in points], width,
                     label=f"{metric.upper()} {'p50' if stat == 'median_ms' else 'p99'}")
    bars.set_xticks(range(len(points)), [p["label"] for p in points], fontsize=8)
    bars.set_ylabel("latency (ms)")
    bars.set_yscale("log")
    bars.set_title("latency percentiles")
    bars.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
