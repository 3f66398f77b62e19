"""The layers, as the folders show them (README, "Layout"), each building only on those
below it:

    streams.cli                      the `splu` entry point: every command
    streams.tools                    produce, run, demo, up, the downstream reader
    streams.worker  streams.consumer the Faust agents of each process
    streams.runtime                  what every stream process shares
    service.cli                      the batch commands
    service.store                    the Redis store
    service.core                     the privacy core: no Redis, Kafka or Faust

`deploy` (the embedded servers) builds on the core and the store, and only the stream's
tools and the entry point use it. The worker's and the consumer's agents never import
each other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Low to high: a module may import its own layer and the layers before it.
LAYERS = (
    ("service.core",),
    ("service.store",),
    ("service.cli",),
    ("deploy",),
    ("streams.runtime",),
    ("streams.worker", "streams.consumer"),
    ("streams.tools",),
    ("streams.cli",),
)
# Side by side in one layer, yet apart.
APART = (("streams.worker", "streams.consumer"),)


def _modules(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    return sorted(_module(path) for path in folder.rglob("*.py"))


@pytest.mark.parametrize(
    ("package", "blocked"),
    [
        (
            "service.core",
            ("faust", "aiokafka", "kafka", "redis", "prometheus_client", "streams", "deploy"),
        ),
        ("service.store", ("faust", "aiokafka", "kafka", "streams", "deploy")),
        ("service.cli", ("faust", "aiokafka", "kafka", "streams", "deploy")),
    ],
)
def test_a_layer_imports_without_what_sits_above_it(package, blocked):
    # A module set to None in sys.modules raises ImportError when imported.
    modules = _modules(package)
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
            # `from service import cli` imports the module service.cli.batch.
            submodules = [f"{module}.{a.name}" for a in node.names]
            found += [(node.lineno, m) for m in (module, *filter(_is_module, submodules))]
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(module: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if _within(module, layer)), None)


def test_no_module_reaches_up_a_layer_or_across_to_its_neighbour():
    edges = [
        (path, line, _module(path), target)
        for folder in ("service", "streams", "deploy")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, target in _imports(path)
        if _within(target, ("service", "streams", "deploy"))
    ]
    assert edges, "no imports found: is ROOT the repository?"
    unplaced = sorted(
        {m for _, _, module, target in edges for m in (module, target) if _layer(m) is None}
        - {"service", "streams", "deploy"}
    )
    assert not unplaced, f"modules in no layer: {unplaced}"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path, line, module, target in edges
        if target not in ("service", "streams", "deploy")
        and (
            _layer(target) > _layer(module)
            or any(
                _within(module, a) and _within(target, b) and not _within(target, a)
                for pair in APART
                for a, b in (pair, pair[::-1])
            )
        )
    ]
    assert not wrong, "a module reaches up a layer or across:\n" + "\n".join(wrong)
