"""The experiment harness of issue 7: every mechanism on the papers' workloads, one command.

Run from the repository root (no install of `bench` needed):

    .venv/bin/python -m bench.experiments            # full run, writes docs/evaluation*
    .venv/bin/python -m bench.experiments --quick --output /tmp/eval   # seconds

It measures, with fixed seeds, the relative error of small counts (true count
1–10) and of large counts by selectivity band, versus γ on UCI Adult and
versus N on tables resampled from Adult (100k–500k rows), for decoy groups,
personal groups with SPS, SDR, F′-privacy, Anatomy, DBR, global randomization
and Laplace counts, plus publication and query times. It writes CSV results,
PNG plots and the Markdown report `docs/evaluation.md`, which sets every
figure beside the trend the papers report.
"""
