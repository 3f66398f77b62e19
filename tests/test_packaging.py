"""A clean install: building the package prints no setuptools warning about its layout,
and the wheel holds every data file the code reads (the Lua scripts, the bundled sample,
the live page, the example configs).

The wheel is built from a copy of the sources, as a fresh clone has them, by pip in an
isolated build environment, as `pip install` builds it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("service", "streams", "deploy")
DATA = ("service/core/data", "service/store/lua", "streams/consumer/static", "deploy/examples")


def test_the_wheel_builds_without_warnings_and_holds_the_data(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, source / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # What setuptools says of a package layout it has to guess (a data folder that is not a
    # package, say), and its other warnings, are all BuildBackendWarnings.
    assert "BuildBackendWarning" not in output and "absent from" not in output, output
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {
        path.relative_to(ROOT).as_posix()
        for folder in DATA
        for path in (ROOT / folder).iterdir()
        if path.is_file()
    }
    assert data and data <= names, sorted(data - names)
