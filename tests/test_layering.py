"""The layers: the privacy core (`service/`) stands without the stream (`streams/`), the
embedded servers (`deploy/`) and the command line; the stream layer builds on it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# The command line: `service/cli.py` and the modules of its commands.
CLI = ("service.cli", "service.commands")


@pytest.mark.parametrize(
    ("blocked", "modules"),
    [
        (
            ("faust", "aiokafka", "kafka", "redis", "streams", "deploy"),
            ("service.cli", "service.publication", "service.config"),
        ),
        # A windowed stream keeps its windows in Redis, as every stream its buffer.
        (("faust", "aiokafka", "kafka", "streams", "deploy"), ("service.windowed",)),
    ],
)
def test_the_core_imports_without_the_stream(blocked, modules):
    # A module set to None in sys.modules raises ImportError when imported.
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); import {', '.join(modules)}"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, at any depth of its code, with the line."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from service import cli` imports the module service.cli.
            submodules = [f"{module}.{a.name}" for a in node.names]
            found += [(node.lineno, m) for m in (module, *filter(_is_module, submodules))]
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_core_module_imports_the_stream_or_the_command_line():
    edges = [
        (path, line, _module(path), target)
        for folder in ("service", "streams")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, target in _imports(path)
        if _within(target, ("service", "streams", "deploy"))
    ]
    assert edges, "no imports found: is ROOT the repository?"
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path, line, module, target in edges
        if (_within(module, ("service",)) and _within(target, ("streams", "deploy")))
        # The command line is the top: only the entry point builds on it.
        or (_within(target, (*CLI, "streams.cli")) and not _within(module, (*CLI, "streams.cli")))
    ]
    assert not upward, "a module reaches up a layer:\n" + "\n".join(upward)
