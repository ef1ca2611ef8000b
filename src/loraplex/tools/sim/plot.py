"""``loraplex sim --plot FILE.png``: the L0 hit ratio over time, one line per policy, with
Belady's offline optimum on the same trace as the limit (matplotlib, an optional extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MISSING = "--plot needs matplotlib: pip install 'loraplex[bench]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def windowed_ratio(
    timeline: Sequence[tuple[float, bool]], start: float, end: float, bins: int
) -> tuple[list[float], list[float | None]]:
    """Hit ratio per time bin: ``bins`` equal bins over ``[start, end]``; a bin's x is its
    middle, its y hits / requests in it (None when it holds no request)."""
    width = (end - start) / bins if end > start else 1.0
    hits, total = [0] * bins, [0] * bins
    for t, hit in timeline:
        i = min(max(int((t - start) / width), 0), bins - 1)
        total[i] += 1
        hits[i] += hit
    xs = [start + (i + 0.5) * width for i in range(bins)]
    ys = [h / n if n else None for h, n in zip(hits, total, strict=True)]
    return xs, ys


def plot_hit_ratio(
    path: str,
    timelines: Mapping[str, Sequence[tuple[float, bool]]],
    belady: Sequence[tuple[float, bool]],
    *,
    title: str = "",
    bins: int = 60,
) -> None:
    """Write the PNG: each policy's (and Belady's) L0 hit ratio per time bin. Raises
    :class:`PlotUnavailable` without matplotlib."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable(MISSING) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for tl in (*timelines.values(), belady) for t, _ in tl]
    start, end = (min(times), max(times)) if times else (0.0, 1.0)
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for name, tl in timelines.items():
        xs, ys = windowed_ratio(tl, start, end, bins)
        ax.plot(xs, [float("nan") if y is None else y for y in ys], label=name, linewidth=1.5)
    xs, ys = windowed_ratio(belady, start, end, bins)
    ax.plot(xs, [float("nan") if y is None else y for y in ys], "k--", label="belady (optimum)")
    ax.set_xlabel("trace time (s)")
    ax.set_ylabel("L0 hit ratio")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "L0 hit ratio over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
