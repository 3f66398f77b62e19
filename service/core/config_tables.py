"""Reading a stream configuration's TOML tables: typed values whose errors name the file
and the field (`TableReader`), secrets' files readable by their owner only, and
true/false environment variables. `service.core.config` reads each table with these.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.core.schema import SchemaError


class ConfigError(SchemaError):
    """The stream configuration is unusable; the message names the field."""


def read_private_file(path: Path, setting: str) -> str:
    """The text of a secret's file, which must be readable by its owner only; errors
    start with `setting` (the file and key that name it)."""
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{setting} {path} is readable by others (mode {stat.filemode(mode)}); chmod 600 it"
            )
        return path.read_text()
    except OSError as err:
        raise ConfigError(f"{setting} {path}: {err.strerror}") from None


class TableReader:
    """Typed access to one TOML table with errors that name the field."""

    def __init__(self, source: str, table: Mapping[str, Any], path: str) -> None:
        self.source, self.table, self.path = source, table, path
        self.used: set[str] = set()

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.path}.{key} {message}")

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.table.get(key, default)

    def number(self, key: str, default: float | None = None, positive: bool = True) -> float:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise self.fail(key, "must be a finite number")
        if positive and not number > 0:
            raise self.fail(key, f"must be positive, got {value}")
        return number

    def integer(
        self, key: str, default: int | None = None, minimum: int = 1, maximum: int = 10**9
    ) -> int:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(key, f"must be at least {minimum}, got {value}")
        if value > maximum:
            shown = f"{value:,}" if value < 10**15 else "more"
            raise self.fail(key, f"must be at most {maximum:,}, got {shown}")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def refuse_password(self, instead: str) -> None:
        """A literal password would sit in a file that is copied, mounted and committed."""
        if "password" in self.table:
            raise self.fail(
                "password", f"is refused: a password is never written in the config; {instead}"
            )

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.fail(unknown[0], "is not a known setting")


def table_of(
    source: str, document: Mapping[str, Any], name: str, required: bool
) -> TableReader | None:
    table = document.get(name)
    if table is None:
        if required:
            raise ConfigError(f"{source}: the [{name}] table is required")
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {name} must be a table")
    return TableReader(source, table, name)


_FLAG_TEXTS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def env_flag(name: str, default: bool) -> bool:
    """A true/false environment variable (1/0, true/false, yes/no), or `default` if unset."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return _FLAG_TEXTS[text.strip().lower()]
    except KeyError:
        raise ConfigError(f"{name} must be 1 or 0 (true or false), got {text!r}") from None
