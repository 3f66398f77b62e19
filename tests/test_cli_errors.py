"""Errors a user can act on: the stream commands fail in one line, without a traceback.

Each case runs the real command as a subprocess against a config written here, with
the environment a user would have, and checks: a non-zero exit, exactly one line on
stderr, no traceback and no "Unclosed ..." noise, and the line names the address and
the setting or environment variable to change. `splu run` takes its servers from
KAFKA_BOOTSTRAP and REDIS_URL (it starts embedded ones for those unset), and says
nothing else before the error.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import redis
import tomli_w

from deploy.embedded import free_port

EXAMPLES = Path(__file__).parents[1] / "deploy" / "examples"
STREAM_COMMAND = [sys.executable, "-m", "streams.cli"]


def write_config(directory: Path, kafka: str, redis_url: str, **stream: object) -> Path:
    document = tomllib.loads((EXAMPLES / "adult-decoy.toml").read_text())
    document["stream"].update({"name": f"err{secrets.token_hex(4)}", "partitions": 2, **stream})
    document["kafka"]["bootstrap"] = kafka
    document["redis"]["url"] = redis_url
    path = directory / "stream.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "REDIS_", "SPLU_"))}
    return {**env, "SPLU_SERVICE_KEY": secrets.token_hex(32), **extra}


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*STREAM_COMMAND, *command], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def assert_one_line(result: subprocess.CompletedProcess, *names: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert not result.stdout, result.stdout
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def csv_input(directory: Path) -> Path:
    path = directory / "in.csv"
    path.write_text(
        "age,sex,race,marital_status,education,occupation\n"
        "[25, 35),Male,White,Never-married,Bachelors,Sales\n"
    )
    return path


def env_for(command: str, kafka: str, redis_url: str, **extra: str) -> dict[str, str]:
    """A user's environment; `splu run` takes its servers from it, not from the config."""
    servers = {"KAFKA_BOOTSTRAP": kafka, "REDIS_URL": redis_url} if command == "run" else {}
    return clean_env(**servers, **extra)


def arguments_of(command: str, config: Path, directory: Path) -> list[str]:
    arguments = [command, "--config", str(config)]
    if command in ("produce", "run"):
        arguments += ["--input", str(csv_input(directory))]
    return arguments


@pytest.mark.parametrize("command", ["worker", "consumer", "produce", "run"])
def test_an_unreachable_broker_is_one_line_naming_kafka_bootstrap(servers, tmp_path, command):
    nowhere = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path, nowhere, servers.redis_url)
    env = env_for(command, nowhere, servers.redis_url)
    result = run(arguments_of(command, config, tmp_path), env, tmp_path)
    line = assert_one_line(result, nowhere)
    assert "KAFKA_BOOTSTRAP" in line and line.startswith(f"splu {command}: error:")


@pytest.mark.parametrize("command", ["worker", "consumer", "run"])
def test_an_unreachable_redis_is_one_line_naming_redis_url(servers, tmp_path, command):
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    config = write_config(tmp_path, servers.kafka_bootstrap, nowhere)
    env = env_for(command, servers.kafka_bootstrap, nowhere)
    result = run(arguments_of(command, config, tmp_path), env, tmp_path)
    assert_one_line(result, nowhere.removeprefix("redis://"), "REDIS_URL")


@pytest.mark.parametrize("command", ["worker", "run"])
def test_a_wrong_redis_password_is_one_line_naming_the_user(servers, tmp_path, command):
    user = f"splu-err-{secrets.token_hex(3)}"
    admin = redis.Redis.from_url(servers.redis_url)
    admin.execute_command("ACL", "SETUSER", user, "on", f">{secrets.token_hex(8)}", "~*", "+@all")
    admin.close()
    config = write_config(tmp_path, servers.kafka_bootstrap, servers.redis_url)
    env = env_for(
        command, servers.kafka_bootstrap, servers.redis_url, REDIS_USERNAME=user,
        REDIS_PASSWORD="not-the-password",
    )  # fmt: skip
    result = run(arguments_of(command, config, tmp_path), env, tmp_path)
    assert_one_line(result, user, "REDIS_PASSWORD", "REDIS_USERNAME")


def test_a_missing_service_key_is_one_line_naming_the_variable(servers, tmp_path):
    config = write_config(tmp_path, servers.kafka_bootstrap, servers.redis_url)
    env = clean_env()
    env.pop("SPLU_SERVICE_KEY")
    result = run(["worker", "--config", str(config)], env, tmp_path)
    assert_one_line(result, "SPLU_SERVICE_KEY")


@pytest.mark.parametrize("command", ["worker", "consumer", "produce", "run"])
def test_a_bad_config_is_one_line_naming_the_setting(servers, tmp_path, command):
    config = write_config(tmp_path, servers.kafka_bootstrap, servers.redis_url, partitions=0)
    env = env_for(command, servers.kafka_bootstrap, servers.redis_url)
    result = run(arguments_of(command, config, tmp_path), env, tmp_path)
    assert_one_line(result, "stream.partitions")
