"""`shipyard view` in a real Chromium (Debian's, driven by Playwright): the dashboard's charts hold
the run's metrics, a rollout opens with its tool calls, summaries and diff, the page follows a
live run, and bad input gets a message, never a stack trace.

With ``SHIPYARD_VIEW_RUN=<run dir>`` (a real demo run) the last test also writes the screenshots in
docs/img/ (``make screenshots``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import uvicorn

from shipyard.metrics.logger import read_metrics
from shipyard.view.run import RunReader
from shipyard.view.server import Runs, listening_socket, make_app
from shipyard.view.types import RolloutQuery

from .conftest import ROOT, overrides

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")
expect = playwright.expect
WAIT_MS = 15_000  # how long a count may take to settle after a click or a filter (a slow, shared machine)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")


class Viewer:
    """A viewer on loopback in a thread, stopped at exit."""

    def __init__(self, run_dirs: list[Path]) -> None:
        sock = listening_socket("127.0.0.1", 0)  # connections queue until uvicorn accepts them
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(make_app(Runs(run_dirs)), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    def url(self, route: str = "#/", poll_ms: int = 300) -> str:
        return f"http://127.0.0.1:{self.port}/?poll={poll_ms}{route}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    pg.close()
    assert errors == [], f"JavaScript errors in the page: {errors}"


@pytest.fixture
def viewer(tiny_run) -> Iterator[Viewer]:
    v = Viewer([tiny_run[0]])
    yield v
    v.stop()


def _chart(page, name: str) -> list[list[float | None]]:
    return page.evaluate(f"window.shipyardCharts[{json.dumps(name)}].data")


def _no_traceback(page) -> None:
    text = page.inner_text("body")
    assert "Traceback" not in text and 'File "' not in text


def test_dashboard_charts_hold_the_runs_metrics(viewer, page, tiny_run) -> None:
    train = [r for r in read_metrics(tiny_run[0] / "metrics.jsonl") if r.get("kind") == "train"]
    page.goto(viewer.url())
    page.wait_for_selector('[data-testid=chart-reward][data-points="3"]')
    reward = _chart(page, "reward")
    assert reward[0] == [1, 2, 3] and reward[1] == pytest.approx([r["reward/mean"] for r in train])
    staleness = _chart(page, "staleness")
    assert staleness[1] == pytest.approx([r["staleness/mean"] for r in train])
    idle = _chart(page, "idle")
    assert idle[1] == pytest.approx([r["time/wait_s"] / r["time/step_s"] for r in train], rel=1e-6)
    page.wait_for_selector("[data-testid=chart-sync]:not([data-points='0'])")
    assert _chart(page, "sync")[0] == [1, 2, 3], "one weight-sync time per adopted version"
    status = page.inner_text("[data-testid=run-status][data-run=tiny]")
    assert "finished" in status and "3" in status
    _no_traceback(page)


def test_the_health_panel_shows_each_component_and_a_stall(browser, tiny_run, tmp_path: Path) -> None:
    """Issue 40: every watched component has a row with its phase and last progress; a component the
    watchdog named, with no progress since, is shown stalled, with its stalls and crashes counted and
    the last one said."""
    run = tmp_path / "tiny"
    shutil.copytree(tiny_run[0], run)
    lines = [json.loads(x) for x in (run / "health.jsonl").read_text().splitlines()]
    last = next(x for x in reversed(lines) if x["kind"] == "snapshot")["components"]
    worker = next(c for c in last if c["component"] == "worker w0")
    stall = {**worker, "kind": "stall", "phase": "sessions", "at": worker["last_progress_at"] + 900}
    crash = {"kind": "crash", "component": "worker w0", "at": stall["at"] + 5, "error": "ActorDiedError"}
    with open(run / "health.jsonl", "a") as f:
        f.write(json.dumps({**stall, "stacks": "logs/stall-worker-w0-0.txt"}) + "\n")
        f.write(json.dumps({**crash, "action": "starting a new actor"}) + "\n")
    v = Viewer([run])
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        pg.goto(v.url())
        row = pg.locator("[data-testid=health] tr[data-component='worker w0']")
        expect(row).to_have_attribute("data-state", "stalled", timeout=WAIT_MS)
        assert "sessions" in row.inner_text()
        events = row.locator("[data-testid=events]").inner_text()
        assert (
            "1 stall, 1 crash; last: crash" in events and "(ActorDiedError): starting a new actor" in events
        )
        for name in ("trainer", "server 0"):
            ok = pg.locator(f"[data-testid=health] tr[data-component='{name}']")
            expect(ok).to_have_attribute("data-state", "ok", timeout=WAIT_MS)
            assert ok.locator("[data-testid=events]").inner_text() == "-"
        assert "done" in pg.inner_text("[data-testid=health] tr[data-component='trainer']")
        _no_traceback(pg)
    finally:
        pg.close()
        v.stop()


def test_a_rollout_opens_with_tool_calls_summaries_diff_and_tokens(viewer, page, tiny_run) -> None:
    page.goto(viewer.url("#/rollouts/tiny"))
    page.wait_for_selector("[data-testid=rollout-table] tr[data-rollout-id]")
    page.select_option("[data-testid=filter-family]", "long")
    expert = tiny_run[1][0]
    page.wait_for_selector(f'tr[data-rollout-id="{expert}"]')
    # the expert row was already listed before the filter: wait for the filtered table, not for it
    expect(page.locator("[data-testid=rollout-table] tr[data-rollout-id]")).to_have_count(2, timeout=WAIT_MS)
    page.click(f'tr[data-rollout-id="{expert}"]')
    page.wait_for_selector("[data-testid=segment]")
    expect(page.locator("[data-testid=segment]")).to_have_count(4, timeout=WAIT_MS)
    calls = page.locator("[data-testid=tool-call]").all_inner_texts()
    assert any("cat part_00.py" in c for c in calls) and any("solution.py" in c for c in calls)
    assert "$ cat part_00.py" in page.locator("[data-testid=tool-output]").first.inner_text()
    expect(page.locator("[data-testid=turn][data-role=summary]")).to_have_count(3, timeout=WAIT_MS)
    diff = page.inner_text("[data-testid=diff]")
    assert "+++ b/solution.py" in diff and "+def process_value(x):" in diff
    assert "passed" in page.inner_text("[data-testid=grade]")
    page.select_option("[data-testid=token-mode]", "logprob")
    page.wait_for_selector("span.tok")
    sampled = RunReader(tiny_run[0]).rollout(expert)["sampled"]
    expect(page.locator("span.tok")).to_have_count(sampled, timeout=WAIT_MS)
    assert "long-00000" in page.inner_text("[data-testid=rollout-header]")
    _no_traceback(page)


def test_two_rollouts_of_a_task_side_by_side(viewer, page, tiny_run) -> None:
    page_rows = RunReader(tiny_run[0]).rollouts(RolloutQuery(trained=True, sort="step"))["rows"]
    a = page_rows[0]  # every group holds 4 sessions of one task: there is always another to compare
    page.goto(viewer.url(f"#/rollout/tiny/{quote(a['id'], safe='')}"))
    page.wait_for_selector("[data-testid=compare-select] option >> nth=1", state="attached")
    page.select_option("[data-testid=compare-select]", index=1)
    page.wait_for_selector("[data-testid=compare-right] [data-testid=segment]")
    page.wait_for_selector("[data-testid=compare-left] [data-testid=segment]")
    left, right = (
        page.inner_text("[data-testid=compare-left]"),
        page.inner_text("[data-testid=compare-right]"),
    )
    assert a["task_id"] in left and a["task_id"] in right and left != right


def test_the_dashboard_follows_a_live_run(browser, tmp_path: Path) -> None:
    from shipyard.config import load_config
    from shipyard.orchestrate.train import train

    train(load_config(ROOT / "configs/tiny.toml", overrides(tmp_path, "trainer.steps=2")))
    v = Viewer([tmp_path / "tiny"])
    page = browser.new_page()
    try:
        page.goto(v.url(poll_ms=250))
        page.wait_for_selector('[data-testid=chart-reward][data-points="2"]')
        more = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shipyard.cli",
                "train",
                str(ROOT / "configs/tiny.toml"),
                *overrides(tmp_path, "trainer.steps=4"),
            ],
            stdout=(tmp_path / "more.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        points = "Number(document.querySelector('[data-testid=chart-reward]').dataset.points)"
        try:  # at least 3: on a loaded machine one poll may bring steps 3 and 4 together
            page.wait_for_function(f"{points} >= 3", timeout=300_000)
            page.wait_for_selector('[data-testid=chart-reward][data-points="4"]', timeout=300_000)
        finally:
            assert more.wait(300) == 0, (tmp_path / "more.log").read_text()[-3000:]
        train_recs = [r for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
        assert _chart(page, "reward")[1] == pytest.approx([r["reward/mean"] for r in train_recs])
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1, "no reload"
    finally:
        page.close()
        v.stop()


def test_bad_input_shows_a_message(viewer, page, tiny_run, tmp_path: Path) -> None:
    page.goto(viewer.url("#/rollout/tiny/w9%2Fnope"))
    error = page.locator("[data-testid=error]")
    error.wait_for(state="visible")
    assert "has no rollout 'w9/nope'" in error.inner_text()
    page.goto(viewer.url("#/rollouts/ghost"))
    page.wait_for_function("document.querySelector('[data-testid=error]').innerText.includes('no run')")
    page.goto(viewer.url())
    page.fill("[data-testid=add-run-input]", str(tmp_path / "does-not-exist"))
    page.click("[data-testid=add-run]")
    page.wait_for_function(
        "document.querySelector('[data-testid=error]').innerText.includes('does not exist')"
    )
    half = tmp_path / "half"
    half.mkdir()
    (half / "run.json").write_text((tiny_run[0] / "run.json").read_text())
    page.fill("[data-testid=add-run-input]", str(half))
    page.click("[data-testid=add-run]")
    page.wait_for_selector("[data-testid=run-status][data-run=half]")
    assert "no config.json" in page.inner_text("[data-testid=problems][data-run=half]")
    _no_traceback(page)


@pytest.mark.skipif(
    not os.environ.get("SHIPYARD_VIEW_RUN"), reason="set SHIPYARD_VIEW_RUN=<a real demo run dir>"
)
def test_screenshots_of_a_real_run(browser) -> None:
    run_dir = Path(os.environ["SHIPYARD_VIEW_RUN"])
    out = ROOT / "docs/img"
    out.mkdir(parents=True, exist_ok=True)
    v = Viewer([run_dir])
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    try:
        page.goto(v.url(poll_ms=1000))
        steps = len([r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"])
        page.wait_for_selector(f'[data-testid=chart-reward][data-points="{steps}"]')
        page.wait_for_timeout(500)
        page.screenshot(path=out / "view-dashboard.png", full_page=True)
        page.goto(v.url(f"#/rollouts/{run_dir.name}?sort=-reward&trained=true"))
        page.wait_for_selector("[data-testid=rollout-table] tr[data-rollout-id]")
        page.screenshot(path=out / "view-rollouts.png")
        page.click("[data-testid=rollout-table] tr[data-rollout-id] >> nth=0")
        page.wait_for_selector("[data-testid=segment]")
        page.select_option("[data-testid=token-mode]", "mismatch")
        page.wait_for_timeout(300)
        page.screenshot(path=out / "view-rollout.png", full_page=True)
    finally:
        page.close()
        v.stop()
    assert all((out / f"view-{n}.png").stat().st_size > 20_000 for n in ("dashboard", "rollouts", "rollout"))
