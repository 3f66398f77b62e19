"""What every publication shares: its one-line errors, its account on stderr, its input
and how its options are named and written.

The mechanisms themselves, their options and defaults are in the registry
(`service.core.mechanisms.registry`); the batch publishers in `service.core.publishers`;
the files a batch publication writes beside OUT.csv in `service.core.batch_files`.

Errors are `PublicationError`s naming the command line's flags (--gamma); a windowed stream
renames them to its configuration keys.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import TextIO

from service.core.table import open_text

SHOWN = 10
# Options whose flag and configuration key are not their name (`lam` is --lambda, lambda).
SPELLED = {"lam": "lambda"}


class PublicationError(ValueError):
    """A failure to report as one clear line, with nothing half-written."""


def log(message: str) -> None:
    """The publishers' account on stderr: the CLI shows it, a windowed worker logs it."""
    print(message, file=sys.stderr, flush=True)


def spelled(option: str) -> str:
    """An option as a config file and a manifest name it (`lam` is lambda)."""
    return SPELLED.get(option, option)


def flag_of(option: str) -> str:
    """The command-line flag of an option (`lam` is --lambda)."""
    return "--" + spelled(option).replace("_", "-")


def configured(message: str, table: str) -> str:
    """An error naming command-line flags (--min-size) as a config table's keys
    (windowed.min_size), for the same check made on a stream's configuration."""
    return re.sub(r"--([a-z][a-z-]*)", lambda m: f"{table}." + m[1].replace("-", "_"), message)


@contextmanager
def open_input(path: str) -> Iterator[TextIO]:
    """The text of `path` (.gz too), or stdin for "-"."""
    try:
        stream = sys.stdin if path == "-" else open_text(path)
    except OSError as err:
        raise PublicationError(f"cannot read {path}: {err.strerror}") from None
    try:
        yield stream
    finally:
        if stream is not sys.stdin:
            stream.close()


def exact_number(value: object, flag: str) -> Fraction:
    """An exact number from a decimal or a ratio as written (0.02 is 1/50, not a float)."""
    if isinstance(value, Fraction):
        return value
    try:
        return Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise PublicationError(
            f"{flag} must be a number or a ratio like 1/13, got {value!r}"
        ) from None


def shown_option(value: object) -> object:
    """An option's value as OUT.params.json and a manifest record it (exact numbers as
    text: "1/13", which JSON keeps exactly)."""
    return str(value) if isinstance(value, Fraction) else value
