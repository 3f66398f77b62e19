"""The benchmarks still run (tiny sizes; timings are not checked here, see bench/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.mark.parametrize(
    ("script", "arguments", "expected"),
    [
        (
            "batch_decoy.py",
            ["--rows", "5000", "--repeats", "1", "--queries", "20"],
            "publish 5,000 rows",
        ),
        ("decoy_accuracy.py", ["--queries", "20", "--publications", "1"], "[default]"),
        (
            "calibration.py",
            ["--rows", "45222", "--publications", "2", "--small", "5", "--jobs", "1"],
            "personal stream",
        ),
        (
            "personal_accuracy.py",
            ["--queries", "20", "--publications", "1", "--rows", "5000", "--repeats", "1"],
            "SPS publish 5,000 rows",
        ),
        ("personal_reserve.py", ["--sizes", "5000", "--publications", "2"], "borrowed rows"),
        (
            "stream_throughput.py",
            ["--records", "5000", "--buffered", "5000", "--backfill", "0", "--no-targets"],
            "Redis bytes per buffered record",
        ),
        ("framework_floor.py", ["--records", "5000", "--rounds", "1"], "faust, json"),
        ("kafka_records.py", ["--records", "2000", "--take", "500", "--repeat", "1"], "fill_batch"),
    ],
)
def test_benchmark_runs(script, arguments, expected):
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
