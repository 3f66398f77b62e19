"""Prometheus itself on the alert rules, the scrape config and the dashboard (issue 18).

- promtool checks deploy/prometheus/alerts.yml and prometheus.yml as the compose
  Prometheus loads them, and runs tests/data/alerts_test.yml: each alert fires on series
  that break its rule, and stays silent on close ones that do not.
- Each alert has a severity, names its stream and links its section of
  docs/operations.md, which says what it means, how to confirm it, what to do and what not.
- The dashboard and the alerts use only series a worker or the consumer exports.
- A real Prometheus (Debian's, deploy/system-packages.sh) scrapes a worker and the consumer
  of a short stream on the embedded servers every second with the real scrape settings and
  rules: every expression of the Grafana dashboard returns data, and once the adversary
  sees the true values in the published tallies (as if the workers published raw values)
  the adversary test fails and SpluPrivacyTestFailed fires.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from harness import Harness, adult_rows
from prometheus_client.parser import text_string_to_metric_families

from deploy.embedded import ManagedProcess, free_port, spawn
from service.cli import client
from service.store.buffer import BufferState
from streams.runtime.metrics import render_prometheus, render_worker
from streams.runtime.topics import create_topics
from streams.tools.produce import produce

ROOT = Path(__file__).parents[1]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "splu-stream.json"
RUNBOOK = ROOT / "docs" / "operations.md"
STREAMED = 5_000  # records: enough small cells for the adversary test, a few seconds' work
TIMEOUT = 60.0  # seconds for each wait of the integration test


def promtool(*arguments: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: deploy/system-packages.sh installs Debian's prometheus"
    return subprocess.run(
        [binary, *arguments], capture_output=True, text=True, timeout=60, check=False
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_promtool_accepts_the_rules_and_the_config_compose_loads():
    # The config names alerts.yml relative to itself, as compose mounts both side by side
    # (tests/test_compose.py), so promtool checks the real files in place.
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout
    checked = promtool("check", "config", str(CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def test_each_alert_fires_and_stays_silent_in_promtools_unit_tests():
    tests = yaml.safe_load((ROOT / "tests" / "data" / "alerts_test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    assert tested == {rule["alert"] for rule in alert_rules()}
    result = promtool("test", "rules", str(ROOT / "tests" / "data" / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_each_alert_names_its_stream_and_links_its_runbook_section():
    runbook = RUNBOOK.read_text()
    sections = dict(re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", runbook, re.M | re.S))
    anchors = {github_anchor(heading): body for heading, body in sections.items()}
    rules = alert_rules()
    assert len(rules) == 9
    for rule in rules:
        name, annotations = rule["alert"], rule["annotations"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert "{{ $labels.stream }}" in annotations["summary"], name
        page, _, anchor = annotations["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, (name, anchor)
        for part in ("What it means.", "How to confirm.", "What to do.", "What not to do."):
            assert f"**{part}**" in anchors[anchor], (name, part)


def exported_names() -> set[str]:
    """Every series name a consumer or a worker exports, from sample documents."""
    status = json.loads((ROOT / "tests" / "data" / "status-sample.json").read_text())
    worker = {
        "stream": status["stream"],
        "delay_bound": 31.0,
        "partitions": {0: {**status["worker"], "delay": status["delay"]}},
    }
    return {
        sample.name
        for text in (render_prometheus(status), render_worker(worker))
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_dashboard_and_alerts_use_only_series_the_processes_export():
    exported = exported_names() | {"up"}  # Prometheus's own series of each target
    expressions = dashboard_expressions() + [rule["expr"] for rule in alert_rules()]
    used = {m for e in expressions for m in re.findall(r"\b(?:splu_[a-z_]+|up)\b", e)}
    assert len(expressions) > 20 and used <= exported, used - exported


# ---------------------------------------------------------------------------------------
# A real Prometheus


def prometheus_config(directory: Path, stream: str, targets: dict[str, str]) -> Path:
    """The compose config with its scrape settings and rules, scraping `targets` (job →
    host:port) every second and evaluating the rules every second. JSON is YAML."""
    config = yaml.safe_load(CONFIG.read_text())
    jobs = []
    for job in config["scrape_configs"]:
        discovery = ("static_configs", "dns_sd_configs", "relabel_configs")
        local = {k: v for k, v in job.items() if k not in discovery}
        local.update(scrape_interval="1s", scrape_timeout="1s")
        local["static_configs"] = [
            {"targets": [targets[job["job_name"]]], "labels": {"stream": stream}}
        ]
        jobs.append(local)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(CONFIG.parent / name) for name in config["rule_files"]]
    config["scrape_configs"] = jobs
    path = directory / "prometheus.json"
    path.write_text(json.dumps(config))
    return path


def start_prometheus(directory: Path, config: Path) -> tuple[ManagedProcess, str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: deploy/system-packages.sh installs it"
    url = f"http://127.0.0.1:{free_port()}"
    command = [
        binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
        f"--web.listen-address={url.removeprefix('http://')}", "--log.level=warn",
    ]  # fmt: skip
    return spawn(command, None, directory / "prometheus.log"), url


def api(url: str, path: str, **parameters: str) -> Any:
    query = urllib.parse.urlencode(parameters)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def eventually(check, what: str):  # type: ignore[no-untyped-def]
    """check() until it returns something true; the last value in the error if never."""
    deadline = time.monotonic() + TIMEOUT
    value = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except (OSError, client.ConsumerError) as err:  # a process still starting
            value = err
        if value and not isinstance(value, Exception):
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {value}")


async def publish_true_values(config) -> int:  # type: ignore[no-untyped-def]
    """Make the shown tally of the adversary test the true one, as if the workers had
    published the raw values: the adversary test's own way to fail
    (tests/test_privacy_tests.py). Returns the records so published."""
    redis = aioredis.from_url(config.redis_url)
    buffer = BufferState(redis, config)
    copied = 0
    try:
        for partition in range(config.partitions):
            prefix = buffer.prefix(partition)
            epoch = int(await redis.hget(f"{prefix}:stats", "truth_epoch"))
            for number in (epoch - 1, epoch):
                true = await redis.hgetall(f"{prefix}:truth:true:{number}")
                await redis.delete(f"{prefix}:truth:shown:{number}")
                if true:
                    await redis.hset(f"{prefix}:truth:shown:{number}", mapping=true)
                copied += sum(map(int, true.values()))
    finally:
        await redis.aclose()
    return copied


@pytest.mark.stream
def test_prometheus_answers_every_dashboard_query_and_fires_on_a_failed_privacy_test(
    servers, tmp_path
):
    harness = Harness(servers, tmp_path, "adult-decoy.toml", row_column=False)
    config = harness.config
    asyncio.run(create_topics(config.kafka, config.topic_partitions))
    worker_port = free_port()
    harness.start_worker(port=worker_port)
    harness.start_consumer()
    targets = {
        "splu-consumer": harness.url.removeprefix("http://"),
        "splu-worker": f"127.0.0.1:{worker_port}",
    }
    prometheus, url = start_prometheus(tmp_path, prometheus_config(tmp_path, config.name, targets))
    try:
        rows = adult_rows(config)[:STREAMED]
        asyncio.run(produce(config, iter(rows), rate=10_000, progress=False))

        def reported() -> bool:
            status = client.status(harness.url)
            published = status["worker"]["published"]
            return (
                published > 0
                and status["consumer"]["records"] == published
                and bool(status["standing"])
                and any(t["test"] == "adversary" for t in status["tests"])
            )

        eventually(reported, "the consumer to count the stream and report on it")

        # Every panel's expression, for this stream, returns numbers: at 1 s scrapes a
        # 1-minute rate needs two of them after the first publication.
        expressions = [e.replace("$stream", config.name) for e in dashboard_expressions()]

        def unanswered() -> list[str]:
            missing = []
            for expression in expressions:
                result = api(url, "query", query=expression)["result"]
                if not any(math.isfinite(float(r["value"][1])) for r in result):
                    missing.append(expression)
            return missing

        deadline = time.monotonic() + TIMEOUT
        while (missing := unanswered()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not missing, f"dashboard queries without data: {missing}"
        # The dashboard's stream variable (label_values(splu_records_total, stream)).
        streams = api(url, "label/stream/values", **{"match[]": "splu_records_total"})
        assert config.name in streams

        assert asyncio.run(publish_true_values(config)) > 0

        def alerts() -> dict[str, str] | None:
            found = {
                a["labels"]["alertname"]: a["state"]
                for a in api(url, "alerts")["alerts"]
                if a["labels"].get("stream") == config.name
            }
            # adversary fails closed: the pause follows, and its alert waits out its 5 minutes.
            expected = {"SpluPrivacyTestFailed": "firing", "SpluPublishingPaused": "pending"}
            return found if expected.items() <= found.items() else None

        eventually(alerts, "SpluPrivacyTestFailed to fire")
        failed = api(url, "query", query=f'splu_privacy_test_passed{{stream="{config.name}"}}')
        assert {r["metric"]["test"] for r in failed["result"] if r["value"][1] == "0"} == {
            "adversary"
        }
    finally:
        prometheus.stop()
        harness.stop()
