"""`splu guarantees`: decoy groups' exact privacy and utility thresholds for a γ."""

from __future__ import annotations

import argparse
import json

from service.cli.commands.common import (
    FORMATTER,
    GAMMA_HELP,
    Commands,
    add_threshold_options,
)
from service.core.guarantees import chebyshev_thresholds, privacy_threshold, utility_threshold


def command_guarantees(args: argparse.Namespace) -> int:
    privacy = privacy_threshold(args.gamma, args.epsilon, args.alpha)
    utility_epsilon = args.utility_epsilon or args.epsilon
    utility = utility_threshold(args.gamma, utility_epsilon, args.te)
    chebyshev = chebyshev_thresholds(args.gamma, utility_epsilon, args.te)
    if args.json:
        print(json.dumps({
            "mechanism": "decoy",
            "gamma": args.gamma,
            "privacy": {
                "epsilon": args.epsilon,
                "alpha": args.alpha,
                "T_P": privacy.threshold,
                "worst_count": privacy.worst_count,
                "deviation_probability": {str(f): p for f, p in enumerate(privacy.curve, 1)},
            },
            "utility": {
                "epsilon": utility_epsilon,
                "T_E": args.te,
                "T_f": utility.threshold,
                "checked_exactly_up_to": utility.checked_up_to,
                "chebyshev_T_f_paper": chebyshev["paper"],
                "chebyshev_T_f_corrected": chebyshev["corrected"],
            },
        }, indent=2))  # fmt: skip
        return 0
    print(f"Decoy groups, γ = {args.gamma}; published count of a value f ~ Binomial(γf, 1/γ)")
    print(
        f"Small-sum privacy (ε = {args.epsilon}, α = {args.alpha}): "
        f"T_P = {privacy.threshold:.4f}, reached at f = {privacy.worst_count}"
    )
    print(
        f"  any value with true count 1..{args.alpha} is published off by more than "
        f"{args.epsilon:.0%} with probability ≥ {privacy.threshold:.4f}"
    )
    print(f"Large-sum utility (ε = {utility_epsilon}, T_E = {args.te}): T_f = {utility.threshold}")
    print(
        f"  any value with true count ≥ {utility.threshold} is published within "
        f"±{utility_epsilon:.0%} with probability ≥ {1 - args.te:g}"
    )
    print(
        f"  (the papers' Chebyshev formula claims T_f = {chebyshev['paper']:.1f}, which is "
        f"wrong; corrected Chebyshev gives {chebyshev['corrected']:.0f}, which is loose)"
    )
    return 0


def register(commands: Commands) -> None:
    """Add `splu guarantees`."""
    guarantees = commands.add_parser(
        "guarantees", formatter_class=FORMATTER,
        help="exact small-sum privacy T_P and large-sum utility T_f for a γ",
        description=(
            "Exact binomial tails of f′ ~ Binomial(γf, 1/γ):\n"
            "  T_P(ε, α) = min over f = 1..α of P(|f′ − f| > εf)  (privacy of small counts)\n"
            "  T_f       = smallest f with P(|f′ − f| ≥ εf) ≤ T_E for every larger f (utility)"
        ),
    )  # fmt: skip
    guarantees.add_argument(
        "--mechanism",
        choices=["decoy"],
        default="decoy",
        help="decoy groups (personal groups: see `splu audit personal`)",
    )
    guarantees.add_argument("--gamma", type=int, default=5, help=GAMMA_HELP)
    add_threshold_options(guarantees)
    guarantees.add_argument("--json", action="store_true", help="machine-readable output")
    guarantees.set_defaults(run=command_guarantees)
