"""Talking to Label Studio: connect, one SDK call with our own errors, list a project's tasks."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx


class LabelStudioUnavailableError(ConnectionError):
    """Label Studio cannot be reached (not started, wrong URL, or it went down)."""

    def __init__(self, url: str, reason: object):
        super().__init__(
            f"Label Studio is not reachable at {url} ({reason}). Start it with "
            "`./run services start labelstudio` (or "
            "`components.services.labelstudio.start_label_studio()`), or pass the URL of a running server."
        )
        self.url = url


class LabelStudioRequestError(RuntimeError):
    """Label Studio answered, but refused a request (bad token, bad config, bad task)."""



def _base_url(client) -> str:
    return client._client_wrapper.get_base_url()


def call(client, what: str, fn: Callable[[], Any]) -> Any:
    """Run one SDK call, turning transport failures and API refusals into our own errors."""
    # deferred: only talking to Label Studio needs the SDK
    from label_studio_sdk.core.api_error import ApiError

    try:
        return fn()
    except httpx.TransportError as exc:
        raise LabelStudioUnavailableError(_base_url(client), f"{type(exc).__name__}: {exc}") from exc
    except ApiError as exc:
        raise LabelStudioRequestError(
            f"Label Studio at {_base_url(client)} refused to {what}: HTTP {exc.status_code}: {str(exc.body)[:500]}"
        ) from exc


def connect(url: str, api_key: str, timeout: float = 120.0):
    """A ``LabelStudio`` SDK client, after checking the server answers and accepts the token."""
    from label_studio_sdk import LabelStudio  # deferred: only talking to Label Studio needs the SDK

    url = url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=5.0)
    except httpx.TransportError as exc:
        raise LabelStudioUnavailableError(url, f"{type(exc).__name__}: {exc}") from exc
    if health.status_code != 200:
        raise LabelStudioUnavailableError(url, f"/health answered HTTP {health.status_code}")
    client = LabelStudio(base_url=url, api_key=api_key, timeout=timeout)
    call(client, "accept the API token", client.users.whoami)
    return client




def iter_tasks(client, project_id: int, *, fields: str = "task_only", query: dict | None = None) -> Iterator[Any]:
    kwargs: dict[str, Any] = {"project": project_id, "fields": fields, "page_size": 100}
    if query is not None:
        kwargs["query"] = json.dumps(query)
    yield from call(client, f"list tasks of project {project_id}", lambda: list(client.tasks.list(**kwargs)))


def queued_page_ids(client, project_id: int) -> dict[str, int]:
    """page_id -> task id for every task in the project that carries a page_id."""
    found: dict[str, int] = {}
    for task in iter_tasks(client, project_id):
        page_id = (task.data or {}).get("page_id")
        if page_id is not None:
            found.setdefault(str(page_id), task.id)
    return found

def iso(value) -> str:
    """An SDK timestamp as ISO text (it may be a datetime or already a string)."""
    return value.isoformat() if isinstance(value, datetime) else str(value or "")
