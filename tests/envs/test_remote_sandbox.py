"""The Morph Cloud adapter against a loopback server that implements Morph's documented endpoints.

The server below is a fake of a third-party API (not verified against the live service): it
answers ``POST /instance``, ``GET /instance/{id}`` (``pending`` once, then ``ready``),
``POST /instance/{id}/exec``, ``POST /instance/{id}/branch`` and ``DELETE /instance/{id}`` as
Morph's docs and SDK describe them, checks the bearer key, and runs every instance as a real
local bubblewrap sandbox (its workspace is ``/workspace`` there too, forks are real forks).
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from shipyard.config.schema import RemoteSandboxConfig, SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox, SandboxUnavailable, make_sandbox, sandbox_available
from shipyard.envs.sandbox.remote_morph import MorphSandbox

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))

KEY = "test-key-" + uuid.uuid4().hex
LOCAL = SandboxConfig(timeout_s=30, memory_mb=256, max_processes=32)


class FakeMorph:
    """Morph's instance API on 127.0.0.1, each instance a local BwrapSandbox."""

    def __init__(self) -> None:
        self.instances: dict[str, BwrapSandbox] = {}
        self.polls: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict[str, Any] | None]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                with fake.lock:
                    fake.requests.append((method, url.path, body))
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    return self._reply(401, {"detail": "invalid api key"})
                code, out = fake.route(method, url.path.split("/")[1:], parse_qs(url.query), body)
                self._reply(code, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.server = HTTPServer(("127.0.0.1", 0), Handler)  # one long-lived thread owns the sessions
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _new(self, sb: BwrapSandbox) -> dict[str, Any]:
        iid = f"morphvm_{uuid.uuid4().hex[:8]}"
        with self.lock:
            self.instances[iid] = sb
            self.polls[iid] = 0
        return {"id": iid, "object": "instance", "status": "pending"}

    def route(self, method: str, parts: list[str], query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        if parts[:1] != ["api"] or parts[1:2] != ["instance"]:
            return 404, {"detail": "not found"}
        rest = parts[2:]
        if method == "POST" and not rest:
            if query.get("snapshot_id") != ["snapshot_test"] or body.get("ttl_action") != "stop":
                return 422, {"detail": "bad request"}
            return 200, self._new(BwrapSandbox(None, LOCAL))
        sb = self.instances.get(rest[0]) if rest else None
        if sb is None:
            return 404, {"detail": "no such instance"}
        if method == "GET" and len(rest) == 1:
            self.polls[rest[0]] += 1
            return 200, {"id": rest[0], "status": "ready" if self.polls[rest[0]] > 1 else "pending"}
        if method == "POST" and rest[1:] == ["exec"]:
            argv = body["command"]
            res = sb.exec(" ".join(map(_quote, argv)), timeout_s=120)
            return 200, {"exit_code": res.returncode, "stdout": res.stdout, "stderr": res.stderr}
        if method == "POST" and rest[1:] == ["branch"] and query.get("count") == ["1"]:
            inst = self._new(sb.fork())
            return 200, {"snapshot": {"id": "snapshot_branch", "object": "snapshot"}, "instances": [inst]}
        if method == "DELETE" and len(rest) == 1:
            with self.lock:
                self.instances.pop(rest[0]).close()
            return 200, {}
        return 404, {"detail": "not found"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for sb in self.instances.values():
            sb.close()


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"


@pytest.fixture
def morph(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMorph]:
    fake = FakeMorph()
    monkeypatch.setenv("SHIPYARD_TEST_MORPH_KEY", KEY)
    yield fake
    fake.close()


def _cfg(url: str) -> SandboxConfig:
    remote = RemoteSandboxConfig(url=url, api_key_env="SHIPYARD_TEST_MORPH_KEY", snapshot_id="snapshot_test")
    return SandboxConfig(type="remote_morph", timeout_s=20, remote=remote)


def test_lifecycle_exec_files_diff_fork(morph: FakeMorph) -> None:
    with make_sandbox(_cfg(morph.url), {"solution.py": "print(6 * 7)\n", "pkg/data.txt": "d\n"}) as sb:
        assert isinstance(sb, MorphSandbox) and morph.polls[sb.id] == 2  # polled until ready
        res = sb.exec("python solution.py && pwd")
        assert (res.returncode, res.stdout, res.timed_out) == (0, "42\n/workspace\n", False)
        assert sb.exec("echo $A-$B; exit 3", env={"A": "x y", "B": "'q'"}).stdout == "x y-'q'\n"
        assert sb.exec("exit 3").returncode == 3
        assert sb.exec("cat; echo done", stdin="from stdin\n").stdout == "from stdin\ndone\n"
        assert sb.diff().is_empty()
        big = "".join(f"line {i}\n" for i in range(20000))  # > one write chunk
        sb.write("big.txt", big)
        assert sb.read("big.txt") == big
        sb.exec("rm pkg/data.txt && echo changed > solution.py")
        diff = sb.diff()
        assert diff.added == {"big.txt": big} and diff.modified == {"solution.py": "changed\n"}
        assert diff.deleted == ["pkg/data.txt"]
        with sb.fork() as child:
            assert child.id != sb.id and child.diff() == diff
            child.exec("echo c > c.txt")
            assert "c.txt" in child.files() and "c.txt" not in sb.files()
        with pytest.raises(ValueError):
            sb.write("../escape", "x")
    assert morph.instances == {}  # every instance was deleted
    methods = {(m, p.split("/")[-1] if p.count("/") > 3 else "") for m, p, _ in morph.requests}
    assert {("POST", "exec"), ("POST", "branch"), ("DELETE", "")} <= methods


def test_timeout_is_reported(morph: FakeMorph) -> None:
    with make_sandbox(_cfg(morph.url)) as sb:
        res = sb.exec("sleep 30; echo never", timeout_s=1)
    assert res.timed_out and res.returncode == 124 and "never" not in res.stdout


def test_missing_key_and_snapshot_are_clear_errors(morph: FakeMorph, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(morph.url)
    monkeypatch.delenv("SHIPYARD_TEST_MORPH_KEY")
    with pytest.raises(SandboxUnavailable, match="SHIPYARD_TEST_MORPH_KEY"):
        make_sandbox(cfg)
    monkeypatch.setenv("SHIPYARD_TEST_MORPH_KEY", "wrong")
    with pytest.raises(RuntimeError, match="401"):
        make_sandbox(cfg)
    monkeypatch.setenv("SHIPYARD_TEST_MORPH_KEY", KEY)
    cfg.remote.snapshot_id = ""
    with pytest.raises(ValueError, match="snapshot_id"):
        make_sandbox(cfg)
