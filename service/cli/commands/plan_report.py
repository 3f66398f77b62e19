"""What `splu plan` shows: each mechanism's table of planned settings (guarantees and
errors), the baselines' guarantees in words, and the --plot figure."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from service.cli.commands.common import CommandError
from service.core import planning
from service.core.mechanisms.registry import MECHANISMS
from service.core.publication import SHOWN


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def band(errors: dict[str, Any], name: str, statistic: str) -> str:
    figures = errors[name]
    return percent(None if figures is None else figures[statistic])


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], left_columns: int = 0
) -> None:
    """Figures right-aligned; the first `left_columns` (names) left-aligned."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        cells = [
            str(c).ljust(w) if i < left_columns else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(cells))


def print_decoy(settings: Sequence[planning.Setting], args: argparse.Namespace) -> None:
    first = settings[0].guarantees
    print(
        f"\nDecoy groups ({planning.GROUPING}); T_P at ε = {first['epsilon']:g}, α = "
        f"{first['alpha']}; T_f at ε = {first['utility_epsilon']:g}, T_E = {first['T_E']:g}"
    )
    print_table(
        ["γ", "T_P", "T_f", "suppressed", "large mean", "median", "small mean", "median",
         "warnings"],
        [
            [
                str(s.parameters["gamma"]), f"{s.guarantees['T_P']:.3f}",
                f"{s.guarantees['T_f']:,}", percent(s.guarantees["suppressed_share"]),
                band(s.errors, "large", "mean"), band(s.errors, "large", "median"),
                band(s.errors, "small", "mean"), band(s.errors, "small", "median"),
                str(len(s.warnings)),
            ]
            for s in settings
        ],
    )  # fmt: skip
    values = first["values"]
    print(
        f"\n  share of each value in the sample, and the amplification of the noise of "
        f"conjunctive counts on it (! past {args.max_amplification:g}):"
    )
    rows = []
    for i, entry in enumerate(values[:SHOWN]):
        cells = [entry["value"], percent(entry["share"])]
        for s in settings:
            factor = s.guarantees["values"][i]["amplification"]
            shown = "∞" if factor is None else f"{factor:.1f}"
            warned = factor is None or factor > args.max_amplification
            cells.append(shown + ("!" if warned else " "))
        rows.append(cells)
    print_table(["value", "share", *(f"γ={s.parameters['gamma']} " for s in settings)], rows)
    if len(values) > SHOWN:
        smallest = values[SHOWN - 1]["share"]
        print(f"  ... and {len(values) - SHOWN} more values, each at most {smallest:.1%}")
    for s in settings:
        # The JSON lists one warning per value; here one line per γ keeps the table readable.
        warned = [
            (v["value"], v["amplification"])
            for v in s.guarantees["values"]
            if v["amplification"] is None or v["amplification"] > args.max_amplification
        ]
        if warned:
            listed = ", ".join(
                f"{value} {'∞' if factor is None else f'{factor:.1f}×'}"
                for value, factor in warned[:3]
            )
            more = f" and {len(warned) - 3} more" if len(warned) > 3 else ""
            print(
                f"  warning, γ = {s.parameters['gamma']}: {len(warned)} of {len(values)} values "
                f"amplify conjunctive counts past {args.max_amplification:g}×: {listed}{more}"
            )


def print_personal(settings: Sequence[planning.Setting], merge_map: str | None) -> None:
    p = settings[0].parameters
    groups = f"merged by {merge_map}" if merge_map else "each public combination a group"
    print(
        f"\nPersonal groups (λ = {p['lambda']:g}, δ = {p['delta']:g}, {p['budget']} budget; "
        f"{settings[0].guarantees['groups']:,} groups, {groups})"
    )
    print_table(
        ["p", "plain v_g", "plain v_r", "SPS perturbs", "SPS v_g", "large mean", "median",
         "small mean", "median"],
        [
            [
                f"{s.parameters['retention']:g}", percent(s.guarantees["plain"]["v_g"]),
                percent(s.guarantees["plain"]["v_r"]), percent(s.guarantees["perturbed_share"]),
                percent(s.guarantees["sps"]["v_g"]),
                band(s.errors, "large", "mean"), band(s.errors, "large", "median"),
                band(s.errors, "small", "mean"), band(s.errors, "small", "median"),
            ]
            for s in settings
        ],
    )  # fmt: skip
    for s in settings:
        if s.guarantees["sps"]["v_g"]:
            print(f"  warning, p = {s.parameters['retention']:g}: {s.warnings[-1]}")


def print_baselines(settings: Sequence[planning.Setting]) -> None:
    print("\nBatch mechanisms on the same queries (`splu publish --mechanism …`)")
    print_table(
        ["mechanism", "parameters", "large mean", "median", "small mean", "median"],
        [
            [
                s.mechanism, parameters_text(s.parameters),
                band(s.errors, "large", "mean"), band(s.errors, "large", "median"),
                band(s.errors, "small", "mean"), band(s.errors, "small", "median"),
            ]
            for s in settings
        ],
        left_columns=2,
    )  # fmt: skip
    for mechanism in dict.fromkeys(s.mechanism for s in settings):
        print(f"  {mechanism}: {MECHANISMS[mechanism].guarantee}")


def parameters_text(parameters: dict[str, Any]) -> str:
    shown = ", ".join(f"{k} = {v:.4g}" for k, v in parameters.items())
    return shown or "–"


def plot_plan(
    settings: Sequence[planning.Setting],
    recommendations: Sequence[dict[str, Any]],
    max_error: float,
    path: str,
) -> None:
    """The privacy/utility curve: each mechanism's small-count error against its large-count
    error (the further up and left, the better) and, for decoy groups, T_P against it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise CommandError(
            "--plot needs matplotlib: pip install 'splu-stream[evaluation]'"
        ) from None
    # Settings with a privacy threshold T_P (decoy groups) get a privacy–utility panel.
    decoy = [s for s in settings if "T_P" in s.guarantees and s.large_mean() is not None]
    figure, axes = pyplot.subplots(1, 2 if decoy else 1, figsize=(12 if decoy else 6.5, 5))
    utility = axes[0] if decoy else axes
    chosen = [r["setting"] for r in recommendations if r["setting"] is not None]
    for mechanism in dict.fromkeys(s.mechanism for s in settings):
        points = [
            s
            for s in settings
            if s.mechanism == mechanism and s.errors["large"] and s.errors["small"]
        ]
        if not points:
            continue
        x = [s.errors["large"]["mean"] for s in points]
        y = [s.errors["small"]["mean"] for s in points]
        utility.plot(x, y, "o-", label=mechanism)
        for s, xi, yi in zip(points, x, y, strict=True):
            utility.annotate(
                short_label(s), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
            if s.parameters in chosen:
                utility.plot([xi], [yi], "k*", markersize=14, fillstyle="none")
    utility.set_xlabel("large-count mean relative error (lower: more useful)")
    utility.set_ylabel("small-count mean relative error (higher: more private)")
    utility.axvline(max_error, color="grey", linestyle=":", label=f"--max-error {max_error:g}")
    utility.set_title("privacy/utility on the sample (★ recommended)")
    utility.legend(fontsize=8)
    if decoy:
        privacy = axes[1]
        x = [s.large_mean() for s in decoy]
        privacy.plot(x, [s.guarantees["T_P"] for s in decoy], "o-", color="C0")
        for s, xi in zip(decoy, x, strict=True):
            privacy.annotate(
                short_label(s), (xi, s.guarantees["T_P"]), textcoords="offset points",
                xytext=(4, 4), fontsize=7,
            )  # fmt: skip
        privacy.axvline(max_error, color="grey", linestyle=":")
        privacy.set_xlabel("large-count mean relative error (lower: more useful)")
        privacy.set_ylabel("T_P: least chance a count ≤ α is off by more than ε·f")
        privacy.set_title("decoy groups: privacy threshold against error")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as err:
        raise CommandError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        pyplot.close(figure)


def short_label(setting: planning.Setting) -> str:
    p = setting.parameters
    if "gamma" in p:
        return f"γ={p['gamma']}"
    if "ell" in p:
        return f"ℓ={p['ell']}"
    if "retention" in p:
        return f"p={p['retention']:g}"
    return ""
