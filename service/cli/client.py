"""A small HTTP client for a running consumer (`splu query --url`, `splu demo`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

QUERY_CHUNK = 1000  # queries per request


class ConsumerError(RuntimeError):
    """The consumer did not answer, or answered with an error status."""


def _call(request: urllib.request.Request | str, timeout: float) -> Any:
    url = request.full_url if isinstance(request, urllib.request.Request) else request
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        raise ConsumerError(f"{url} answered {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ConsumerError(f"cannot reach {url}: {err}") from None


def ask(url: str, objects: list[Any], timeout: float = 60.0) -> list[dict[str, Any]]:
    """POST query objects to the consumer's /estimate, in chunks; one answer per object."""
    endpoint = url.rstrip("/") + "/estimate"
    answers: list[dict[str, Any]] = []
    for start in range(0, len(objects), QUERY_CHUNK):
        body = json.dumps(objects[start : start + QUERY_CHUNK]).encode()
        headers = {"Content-Type": "application/json"}
        answers += _call(urllib.request.Request(endpoint, data=body, headers=headers), timeout)
    return answers


def status(url: str, timeout: float = 10.0) -> dict[str, Any]:
    return _call(url.rstrip("/") + "/status", timeout)
