"""``shipyard view``: the run dashboard and rollout viewer, served over HTTP (FastAPI, like the
inference server), on loopback by default.

Contract: :func:`make_app` serves the page (``/``: ``static/index.html``, its script and the
vendored libraries: uPlot for charts, highlight.js for code and diffs) and a JSON API over one or
more :class:`~shipyard.view.run.RunReader` (each run under its label, the directory's name,
de-duplicated):

    GET  /api/runs                                  every run's status
    POST /api/runs {"dir": PATH}                    add a run to compare (400 + message if not a run)
    GET  /api/runs/{run}/metrics?after=N            train records after the first N (live: poll)
    GET  /api/runs/{run}/evals | rewards | servers  held-out intervals, reward quantiles, adoptions
    GET  /api/runs/{run}/health                     each component's last progress and state
    GET  /api/runs/{run}/rollouts?family=&min_reward=&flagged=&sort=-reward&offset=&limit=
    GET  /api/runs/{run}/rollout?id=SESSION_ID      one whole session (404 + message if absent)

Every error is ``{"error": message}`` with a 4xx status for the user's mistakes and 500 for ours
(the traceback goes to the server's log, never to the page). Large runs page: the list returns
``limit`` rows at a time, and the index grows a slice per request (``indexed`` / ``batches``).
"""

from __future__ import annotations

import socket
import threading
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from shipyard.view.run import RunReader
from shipyard.view.types import RolloutQuery

STATIC = Path(__file__).with_name("static")


class Runs:
    """The runs a viewer shows, by label."""

    def __init__(self, run_dirs: list[str | Path]) -> None:
        self.readers: dict[str, RunReader] = {}
        self._lock = threading.Lock()
        for d in run_dirs:
            self.add(d)

    def add(self, run_dir: str | Path) -> RunReader:
        reader = RunReader(run_dir)
        with self._lock:
            for r in self.readers.values():
                if r.dir == reader.dir:
                    return r
            label, k = reader.label, 2
            while label in self.readers:
                label, k = f"{reader.label}-{k}", k + 1
            reader.label = label
            self.readers[label] = reader
        reader.warm()
        return reader

    def get(self, label: str) -> RunReader:
        try:
            return self.readers[label]
        except KeyError:
            raise LookupError(
                f"no run {label!r} in this viewer (it shows: {', '.join(self.readers) or 'none'})"
            ) from None


def _query(params: dict[str, str]) -> RolloutQuery:
    kinds = {f.name: f.type for f in fields(RolloutQuery)}
    out: dict[str, Any] = {}
    for name, raw in params.items():
        if name not in kinds:
            raise ValueError(f"unknown rollout filter {name!r}; filters: {', '.join(kinds)}")
        if raw == "":
            continue
        kind = str(kinds[name])
        try:
            if "bool" in kind:
                if raw not in ("true", "false"):
                    raise ValueError
                out[name] = raw == "true"
            elif "int" in kind:
                out[name] = int(raw)
            elif "float" in kind:
                out[name] = float(raw)
            else:
                out[name] = raw
        except ValueError:
            raise ValueError(f"rollout filter {name}={raw!r} is not a valid {kind.split(' ')[0]}") from None
    return RolloutQuery(**out)


def _errors_as_messages(app: FastAPI) -> None:
    """``{"error": message}``: 400 for bad input, 404 for what does not exist, 500 for our bugs
    (whose traceback goes to the server's log only)."""

    @app.exception_handler(ValueError)
    async def _bad_input(_: Request, e: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=400)

    @app.exception_handler(LookupError)
    async def _missing(_: Request, e: LookupError) -> JSONResponse:
        return JSONResponse({"error": str(e.args[0] if e.args else e)}, status_code=404)

    @app.exception_handler(Exception)
    async def _ours(_: Request, e: Exception) -> JSONResponse:
        traceback.print_exception(e)
        return JSONResponse(
            {"error": f"the viewer failed: {type(e).__name__}: {e} (details in its log)"}, status_code=500
        )


PARTS = ("evals", "rewards", "servers", "health")
"""Per-run parts served as they are: each is the :class:`RunReader` method of its name."""


def _part_route(runs: Runs, part: str) -> Any:
    def route(run: str) -> Any:
        return getattr(runs.get(run), part)()

    route.__name__ = part
    return route


def make_app(runs: Runs) -> FastAPI:
    app = FastAPI(title="shipyard view", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    _errors_as_messages(app)

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/runs")
    def list_runs() -> list[dict[str, Any]]:
        return [r.status() for r in list(runs.readers.values())]

    @app.post("/api/runs")
    async def add_run(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise ValueError('POST /api/runs takes JSON {"dir": "<run directory>"}') from None
        if not isinstance(body, dict) or not isinstance(body.get("dir"), str) or not body["dir"].strip():
            raise ValueError('POST /api/runs takes JSON {"dir": "<run directory>"}')
        return runs.add(body["dir"].strip()).status()

    @app.get("/api/runs/{run}/status")
    def status(run: str) -> dict[str, Any]:
        return runs.get(run).status()

    @app.get("/api/runs/{run}/metrics")
    def metrics(run: str, after: int = 0) -> dict[str, Any]:
        return runs.get(run).metrics(after)

    for part in PARTS:  # GET /api/runs/{run}/<part>: the RunReader method of that name
        app.add_api_route(f"/api/runs/{{run}}/{part}", _part_route(runs, part), methods=["GET"])

    @app.get("/api/runs/{run}/rollouts")
    def rollouts(run: str, request: Request) -> dict[str, Any]:
        return runs.get(run).rollouts(_query(dict(request.query_params)))

    @app.get("/api/runs/{run}/rollout")
    def rollout(run: str, id: str = "") -> dict[str, Any]:
        if not id:
            raise ValueError(
                "GET /api/runs/{run}/rollout needs ?id=<rollout id> (the session id the list shows)"
            )
        return runs.get(run).rollout(id)

    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening: connections queue from this moment on, before
    the server's loop accepts them (port 0 picks a free port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited: no 40 ms Nagle stalls
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e}); pick another --port") from None
    sock.listen(128)
    return sock


def serve_view(run_dirs: list[str], host: str = "127.0.0.1", port: int = 8600) -> None:
    """Serve the viewer until interrupted (``shipyard view``); the address is printed once it listens."""
    import uvicorn

    runs = Runs(run_dirs)
    sock = listening_socket(host, port)
    print(f"shipyard view: {', '.join(runs.readers)} at http://{host}:{sock.getsockname()[1]}/", flush=True)
    uvicorn.Server(uvicorn.Config(make_app(runs), log_level="warning")).run(sockets=[sock])
