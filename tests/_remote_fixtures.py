"""Fixtures for the object-storage tests: a moto S3 server on 127.0.0.1 and ``memory://``.

``remote`` is parametrized over both stores; each test gets a fresh bucket / prefix. The
S3 server is moto's ``ThreadedMotoServer`` (no network: 127.0.0.1, a free port) with a
WSGI wrapper that counts requests and can inject failures (``server.fail(...)``).
Everything skips when s3fs / moto are not installed (``pip install 'tdckpt[remote]'`` and
the test extra).
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

#: Seconds any one remote test may run before it fails instead of hanging the suite.
TEST_TIMEOUT_S = 120


def remote_timeout(seconds: Callable[[int], float]) -> Callable[[Any], Any]:
    """Give one test ``seconds(fault_trials)`` instead of TEST_TIMEOUT_S."""

    def mark(fn: Any) -> Any:
        fn.remote_timeout_s = seconds
        return fn

    return mark


@pytest.fixture(autouse=True)
def _timeout(request: pytest.FixtureRequest, fault_trials: int) -> Iterator[None]:
    """Every test in a module importing this fails after TEST_TIMEOUT_S (SIGALRM)."""
    custom = getattr(request.function, "remote_timeout_s", None)
    limit = int(custom(fault_trials)) if custom is not None else TEST_TIMEOUT_S

    def hung(signum: int, frame: object) -> None:
        raise AssertionError(f"remote test ran past {limit} s (hung?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class MotoS3:
    endpoint: str
    requests: Counter[str] = field(default_factory=Counter)
    #: response body bytes sent, by method (what a client fetched)
    sent: Counter[str] = field(default_factory=Counter)
    #: (method, path) -> should this request fail with a 500?
    failing: Callable[[str, str], bool] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def new_bucket(self) -> str:
        import boto3

        name = f"b{uuid.uuid4().hex[:20]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket=name)
        return name

    def total(self) -> int:
        with self.lock:
            return sum(self.requests.values())

    def snapshot(self) -> tuple[int, int]:
        """(GET requests, GET body bytes) so far: subtract two to count what a call fetched."""
        with self.lock:
            return self.requests["GET"], self.sent["GET"]


def start_moto() -> tuple[Any, MotoS3]:
    """Start a ThreadedMotoServer on 127.0.0.1:<free port> with a counting wrapper."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    state = MotoS3(endpoint=f"http://{host}:{port}")
    app = server._server.app  # type: ignore[union-attr]

    def counting(environ: dict[str, Any], start_response: Any) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with state.lock:
            state.requests[method] += 1
        if state.failing is not None and state.failing(method, path):
            start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
            return [
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                b"<Message>injected</Message></Error>"
            ]
        result = app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        with state.lock:
            state.sent[method] += len(body)
        return [body]

    server._server.app = counting  # type: ignore[union-attr]
    return server, state


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    server, state = start_moto()
    try:
        yield state
    finally:
        server.stop()


@dataclass
class Remote:
    """One fresh root URL with its storage options."""

    kind: str
    url: str
    storage_options: dict[str, Any] | None
    s3: MotoS3 | None = None

    def fs(self) -> Any:
        from fsspec.core import url_to_fs

        return url_to_fs(self.url, **(self.storage_options or {}))[0]

    def path(self, rel: str = "") -> str:
        """The filesystem path (no protocol) of ``rel`` under the root."""
        from fsspec.core import url_to_fs

        root = url_to_fs(self.url, **(self.storage_options or {}))[1].rstrip("/")
        return f"{root}/{rel}" if rel else root


@pytest.fixture(params=["memory", "s3"])
def remote(request: pytest.FixtureRequest) -> Iterator[Remote]:
    pytest.importorskip("fsspec")
    if request.param == "memory":
        name = f"t{uuid.uuid4().hex[:12]}"
        yield Remote("memory", f"memory://{name}/run", None)
        import contextlib

        import fsspec

        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(f"/{name}", recursive=True)
        return
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    s3.failing = None
    bucket = s3.new_bucket()
    yield Remote("s3", f"s3://{bucket}/run", s3.options(), s3)
    s3.failing = None


@pytest.fixture
def s3_remote(moto_s3: MotoS3) -> Iterator[Remote]:
    moto_s3.failing = None
    bucket = moto_s3.new_bucket()
    yield Remote("s3", f"s3://{bucket}/run", moto_s3.options(), moto_s3)
    moto_s3.failing = None


def fast_failures(s3_remote: Remote, monkeypatch: pytest.MonkeyPatch) -> Remote:
    """``s3_remote`` with retries cut short: a failing store fails in a second, not 40."""
    from tdckpt._remote import store

    monkeypatch.setattr(store, "BACKOFF_S", 0.001)
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 1)
    options = {
        **(s3_remote.storage_options or {}),
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    return Remote(s3_remote.kind, s3_remote.url, options, s3_remote.s3)
