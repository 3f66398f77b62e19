"""The batch command line on top of the core (`splu publish`, `query`, `plan`, ...);
the `splu` entry point, `streams/cli.py`, adds the stream's commands."""
