"""`python -m bench.experiments`: see bench/experiments/run.py."""

from bench.experiments.run import main

main()
