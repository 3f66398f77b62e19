"""The PNG figures of the evaluation (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

from bench.experiments.mechanisms import DEFAULT_GAMMA, MECHANISMS, Mechanism
from bench.experiments.workload import BANDS, INCOME, LARGE_KEY, OCCUPATION

DPI = 110
WIDE = (14, 5.5)
SINGLE = (11.5, 5.5)


@dataclass(frozen=True)
class Figure:
    name: str  # file name inside the output directory
    title: str


FIGURES = {
    "large_vs_gamma": Figure("large_vs_gamma.png", "Large counts (selectivity ≥ 1%) versus γ"),
    "small_vs_gamma": Figure("small_vs_gamma.png", "Small counts (true count 1–10) versus γ"),
    "selectivity": Figure("selectivity.png", f"Error by band at γ = {DEFAULT_GAMMA}"),
    "vs_n": Figure("vs_n.png", f"Large and small counts versus N at γ = {DEFAULT_GAMMA}"),
    "runtime": Figure("runtime.png", "Run times versus N"),
    "personal": Figure("personal.png", "Personal groups and SPS on the income workload"),
}


def percent(value: float, _position: object = None) -> str:
    if value >= 1:
        return f"{value * 100:,.0f}%"
    if value >= 0.01:
        return f"{value * 100:.0f}%"
    return f"{value * 100:.2g}%"


def thousands(value: float, _position: object = None) -> str:
    return f"{value / 1000:,.0f}k"


def _value(rows: list[dict], mechanism: str, band: str, **match: object) -> float | None:
    for row in rows:
        if (
            row["mechanism"] == mechanism
            and row["band"] == band
            and all(row[k] == v for k, v in match.items())
        ):
            return row["mean_rel_error"]
    return None


def _series(rows: list[dict], mechanism: str, band: str, x: str) -> tuple[list, list]:
    points = sorted(
        (row[x], row["mean_rel_error"])
        for row in rows
        if row["mechanism"] == mechanism and row["band"] == band and row[x] != ""
    )
    return [p[0] for p in points], [p[1] for p in points]


def _log_y(ax: Axes, label: str = "mean relative error", formatter=percent) -> None:
    """Log scale; ticks at 1, 2, 5 × 10^k when the data span three decades or less."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    subs = (1.0, 2.0, 5.0) if math.log10(high / low) <= 3 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(formatter))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel(label)
    ax.grid(True, which="major", alpha=0.3)


def _log_n(ax: Axes, sizes: list[int]) -> None:
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_major_formatter(FuncFormatter(thousands))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_xlabel("N: Adult, then Adult resampled with replacement")


def _line(ax: Axes, mechanism: Mechanism, xs: list, ys: list, constant: bool = False) -> None:
    bold = mechanism.key == "decoy"
    ax.plot(
        xs,
        ys,
        color=mechanism.color,
        linestyle=mechanism.style,
        linewidth=2.6 if bold else 1.5,
        marker=None if constant else "o",
        markersize=4,
        label=mechanism.label + (" (no γ)" if constant else ""),
        zorder=3 if bold else 2,
    )


def _bands(ax: Axes, mechanism: Mechanism, ys: list[float | None]) -> None:
    """The small band as a lone marker, the selectivity bands as a line: they do not connect."""
    _line(ax, mechanism, list(range(1, len(ys))), ys[1:])
    ax.plot([0], [ys[0]], color=mechanism.color, marker="D", markersize=6, linestyle="none")


def _band_axis(ax: Axes) -> None:
    ax.set_xticks(list(range(len(BANDS))), [b.label for b in BANDS])
    ax.axvline(0.5, color="black", linewidth=0.8)
    ax.text(
        0.5,
        1.0,
        "← privacy side | utility side →",
        transform=ax.get_xaxis_transform(),
        fontsize=8,
        ha="center",
        va="bottom",
    )
    ax.set_xlabel("true count 1–10 (◆), then selectivity = true count / N")


def _legend(fig: plt.Figure, ax: Axes) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()


def _save(fig: plt.Figure, output: Path, key: str) -> None:
    fig.savefig(output / FIGURES[key].name, dpi=DPI)
    plt.close(fig)


def draw_all(
    output: Path,
    gamma_rows: list[dict],
    n_rows: list[dict],
    runtime_rows: list[dict],
    gammas: tuple[int, ...],
) -> dict[str, Figure]:
    """Draw every figure into `output`; returns them by key."""
    occupation = [m for m in MECHANISMS if m.workload == OCCUPATION]
    adult_name = gamma_rows[0]["dataset"]
    sizes = sorted({row["n"] for row in n_rows})
    adult = sizes[0]

    for key, band in (("large_vs_gamma", LARGE_KEY), ("small_vs_gamma", "small")):
        fig, ax = plt.subplots(figsize=SINGLE)
        for mechanism in occupation:
            if mechanism.uses_gamma:
                xs, ys = _series(gamma_rows, mechanism.key, band, "gamma")
                _line(ax, mechanism, xs, ys)
            else:
                y = _value(gamma_rows, mechanism.key, band)
                if y is not None:
                    _line(ax, mechanism, [min(gammas), max(gammas)], [y, y], constant=True)
        ax.set_xticks(list(gammas))
        ax.set_xlabel("γ: decoy group size = Anatomy's ℓ; SDR's amplification; global p = 1/γ")
        _log_y(ax)
        ax.set_title(f"{FIGURES[key].title}, occupation workload on {adult_name}")
        _legend(fig, ax)
        _save(fig, output, key)

    fig, ax = plt.subplots(figsize=SINGLE)
    for mechanism in occupation:
        match = {"gamma": DEFAULT_GAMMA} if mechanism.uses_gamma else {}
        _bands(ax, mechanism, [_value(gamma_rows, mechanism.key, b.key, **match) for b in BANDS])
    _band_axis(ax)
    _log_y(ax)
    ax.set_title(f"{FIGURES['selectivity'].title}, occupation workload on {adult_name}", pad=16)
    _legend(fig, ax)
    _save(fig, output, "selectivity")

    fig, axes = plt.subplots(1, 2, figsize=WIDE, sharey=True)
    panels = ((LARGE_KEY, "large (selectivity ≥ 1%)"), ("small", "small (true count 1–10)"))
    for ax, (band, title) in zip(axes, panels, strict=True):
        for mechanism in (m for m in occupation if m.sweeps_n):
            xs, ys = _series(n_rows, mechanism.key, band, "n")
            _line(ax, mechanism, xs, ys)
        _log_n(ax, sizes)
        ax.set_title(f"{title}, γ = {DEFAULT_GAMMA}, occupation workload")
    _log_y(axes[0])
    axes[1].tick_params(labelleft=True)
    _legend(fig, axes[1])
    _save(fig, output, "vs_n")

    fig, axes = plt.subplots(1, 2, figsize=WIDE)
    publishing = [m for m in MECHANISMS if m.sweeps_n and not m.key.startswith("laplace")]
    for mechanism in publishing:
        runs = sorted(
            (r["n"], r["publish_seconds"], r["answer_ms_per_query"])
            for r in runtime_rows
            if r["mechanism"] == mechanism.key
        )
        label = mechanism.label + (" (income)" if mechanism.workload == INCOME else "")
        for ax, column in ((axes[0], 1), (axes[1], 2)):
            ax.plot(
                [r[0] for r in runs],
                [r[column] for r in runs],
                color=mechanism.color,
                linestyle=mechanism.style,
                linewidth=2.6 if mechanism.key == "decoy" else 1.5,
                marker="o",
                markersize=4,
                label=label,
            )
    for ax, ylabel, title, unit in (
        (axes[0], "seconds", "publication time (median over publications)", "s"),
        (
            axes[1],
            "milliseconds per query",
            "answer time per query, incl. building the reader",
            "ms",
        ),
    ):
        _log_n(ax, sizes)
        _log_y(ax, ylabel, lambda v, _p, unit=unit: f"{v:g} {unit}")
        ax.set_title(title)
    _legend(fig, axes[1])
    _save(fig, output, "runtime")

    fig, axes = plt.subplots(1, 2, figsize=WIDE, sharey=True)
    adult_label = next(row["dataset"] for row in n_rows if row["n"] == adult)
    for mechanism in (m for m in MECHANISMS if m.workload == INCOME):
        _bands(axes[0], mechanism, [_value(n_rows, mechanism.key, b.key, n=adult) for b in BANDS])
        xs, ys = _series(n_rows, mechanism.key, LARGE_KEY, "n")
        _line(axes[1], mechanism, xs, ys)
    _band_axis(axes[0])
    axes[0].set_title(f"by band on {adult_label} (income, m = 2)", pad=16)
    _log_n(axes[1], sizes)
    axes[1].set_title("large (selectivity ≥ 1%) versus N", pad=16)
    _log_y(axes[0])
    axes[1].tick_params(labelleft=True)
    _legend(fig, axes[1])
    _save(fig, output, "personal")
    return FIGURES
