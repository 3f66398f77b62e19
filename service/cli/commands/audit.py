"""`splu audit personal` and `splu audit dp`: privacy audits of raw data (trusted side)."""

from __future__ import annotations

import argparse
import json

import numpy as np

from service.cli.commands.common import (
    BUDGET_HELP,
    FORMATTER,
    LAMBDA_HELP,
    RETENTION_HELP,
    Commands,
    add_table_options,
    key_and_ids,
    read_input_table,
    report_rejections,
)
from service.core.dp_audit import audit_disclosures
from service.core.mechanisms.personal import BUDGETS, PersonalGroups
from service.core.publication import SHOWN
from service.core.publishers import audit_summary, merge_summary, only_sensitive, value_map_for


def command_audit_personal(args: argparse.Namespace) -> int:
    table, rejections = read_input_table(args)
    report_rejections(rejections)
    sensitive = only_sensitive(table, "the personal-group audit")
    value_map = value_map_for(args.merge_map, table, sensitive)
    mechanism = PersonalGroups(args.retention, args.lam, args.delta, args.budget, value_map)
    key, ids = key_and_ids(args.seed, len(table))
    release = mechanism.publish(table, ids, key)
    plain, sps = release.plain, release.audit
    if args.json:
        print(json.dumps({
            "retention": args.retention, "lambda": args.lam, "delta": args.delta,
            "budget": args.budget, "groups": len(plain.sizes), "records": len(table),
            "plain": {"v_g": plain.groups_failing, "v_r": plain.records_failing},
            "sps": {"v_g": sps.groups_failing, "v_r": sps.records_failing},
            "per_group": [
                {"group": list(label), "size": int(size), "max_frequency": float(f),
                 "limit": float(limit), "trials_plain": int(size), "trials_sps": int(trials),
                 "passed_plain": bool(size <= limit), "passed_sps": bool(trials <= limit)}
                for label, size, f, limit, trials in zip(
                    plain.labels, plain.sizes, plain.max_frequency, plain.limit, sps.trials,
                    strict=True,
                )
            ],
        }, indent=2))  # fmt: skip
        return 0
    print(
        f"(λ, δ) = ({args.lam}, {args.delta}) reconstruction privacy, p = {args.retention}, "
        f"m = {table.schema[sensitive].size}; merged public values: {merge_summary(value_map)}"
    )
    print(f"plain perturbation: {audit_summary(plain)}")
    print(f"SPS, {args.budget} budget:  {audit_summary(sps)}")
    failing = np.flatnonzero(~plain.passed)
    failing = failing[np.argsort(-plain.sizes[failing])][:SHOWN]
    if len(failing):
        print(
            f"\nlargest groups over their limit under plain perturbation (of {len(plain.sizes)}):"
        )
        print(f"  {'size':>7} {'max f':>6} {'s_g':>7} {'SPS trials':>10}  group")
        for g in failing:
            label = " ∧ ".join(v if len(v) <= 24 else v[:21] + "..." for v in plain.labels[g])
            print(
                f"  {plain.sizes[g]:7,} {plain.max_frequency[g]:6.3f} {plain.limit[g]:7.1f} "
                f"{sps.trials[g]:10,}  {label}"
            )
    return 0


def command_audit_dp(args: argparse.Namespace) -> int:
    table, rejections = read_input_table(args)
    report_rejections(rejections)
    sensitive = only_sensitive(table, "the DP audit")
    reports = [
        audit_disclosures(
            table, sensitive, epsilon, tau=args.tau, k_cp=args.k_cp, k_j=args.k_j,
            sensitivity=args.sensitivity,
        )
        for epsilon in args.epsilon
    ]  # fmt: skip
    if args.json:
        print(json.dumps([{
            "epsilon": r.epsilon, "laplace_scale": r.scale, "tau": r.tau, "k_cp": r.k_cp,
            "k_j": r.k_j, "groups": r.groups, "disclosures": r.disclosures,
            "groups_disclosing": r.groups_disclosing,
            "records_in_disclosing_groups": r.records_in_disclosing_groups,
            "disclosed": [
                {"group": list(g), "value": v, "theta": t, "phi": f, "jump": j, "cp": c}
                for g, v, t, f, j, c in r.disclosed[: args.show]
            ],
        } for r in reports], indent=2))  # fmt: skip
        return 0
    first = reports[0]
    print(
        f"Laplace counts of personal groups (Δ = {args.sensitivity}, b = Δ/ε); disclosure: "
        f"CP_{first.tau:g} ≥ {first.k_cp:g} and jump ≥ {first.k_j:g}; "
        f"{first.groups:,} groups, {first.records:,} records"
    )
    print(f"{'ε':>6} {'b':>8} {'disclosures':>11} {'groups':>7} {'records in them':>15}")
    for r in reports:
        print(
            f"{r.epsilon:6g} {r.scale:8.2f} {r.disclosures:11,} {r.groups_disclosing:7,} "
            f"{r.records_in_disclosing_groups:15,}"
        )
    for r in reports:
        for group, value, theta, phi, jump, cp in r.disclosed[: args.show]:
            print(
                f"  ε = {r.epsilon:g}: {' ∧ '.join(group)} → {value}: {theta}/{phi} = "
                f"{theta / phi:.2f}, jump {jump:.1f}, CP {cp:.3f}"
            )
    return 0


def _add_personal_audit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retention", type=float, default=0.5, help=RETENTION_HELP)
    parser.add_argument("--lambda", dest="lam", type=float, default=0.3, help=LAMBDA_HELP)
    parser.add_argument("--delta", type=float, default=0.3, help="δ in (0, 1), see --lambda")
    parser.add_argument("--budget", choices=BUDGETS, default="adaptive", help=BUDGET_HELP)
    parser.add_argument(
        "--merge-map",
        metavar="FILE",
        help="merged public values from `splu merge` (default: fit on the input)",
    )
    parser.add_argument("--seed", type=int, help="reproducible SPS run (default: a fresh key)")


def register(commands: Commands) -> None:
    """Add `splu audit` and its audits."""
    audit = commands.add_parser("audit", help="privacy audits of raw data (trusted side)")
    audits = audit.add_subparsers(dest="audit", required=True, metavar="AUDIT")
    personal = audits.add_parser(
        "personal", formatter_class=FORMATTER,
        help="the (λ, δ) test for every personal group: s_g, v_g, v_r",
        description=(
            "A personal group with largest true frequency f may hold at most\n"
            "  s_g = −2·(f·p + (1−p)/m)·ln δ / (λ·p·f)²\n"
            "perturbed records (seed 004 Cor. 6). Reports the groups over that limit under\n"
            "plain perturbation (v_g, v_r) and after SPS. Runs on raw data: keep its output\n"
            "on the trusted side."
        ),
    )  # fmt: skip
    add_table_options(personal)
    _add_personal_audit_options(personal)
    personal.add_argument("--json", action="store_true", help="machine-readable, per group")
    personal.set_defaults(run=command_audit_personal)

    dp = audits.add_parser(
        "dp", formatter_class=FORMATTER,
        help="disclosures Laplace counts at ε would allow (seed 004 ch. 3)",
        description=(
            "For every personal group g and value sa, an analyst asking |g| and |g ∧ sa|\n"
            "with Laplace noise b = Δ/ε learns the confidence θ/φ within τ with probability\n"
            "CP_τ (closed form, Lemma 2). A disclosure is CP_τ ≥ K_CP with a jump\n"
            "(θ/φ)/prior ≥ K_J. Runs on raw data: keep its output on the trusted side."
        ),
    )  # fmt: skip
    add_table_options(dp)
    dp.add_argument(
        "--epsilon",
        type=float,
        action="append",
        required=True,
        help="privacy budget ε; repeat for several",
    )
    dp.add_argument("--tau", type=float, default=0.2, help="closeness τ (default 0.2)")
    dp.add_argument("--k-cp", type=float, default=0.7, help="K_CP threshold (default 0.7)")
    dp.add_argument("--k-j", type=float, default=3.0, help="K_J jump threshold (default 3)")
    dp.add_argument(
        "--sensitivity",
        type=float,
        default=2.0,
        help="Δ of the two counts (default 2: one edit changes both)",
    )
    dp.add_argument("--show", type=int, default=5, help="disclosures listed per ε (default 5)")
    dp.add_argument("--json", action="store_true", help="machine-readable output")
    dp.set_defaults(run=command_audit_dp)
