"""The dashboard of a daemon on the real dev cluster, in a real browser (Playwright driving
Debian's chromium over loopback TCP with the token): the runs page lists the demo run
with the stage its agents report, the run page appends the job's own new log lines while
it runs (server-sent events), the finished run's chart has one point per concurrency, no
request leaves the page's origin, no CSP violation is reported, and screenshots are kept
(in $LLMD_TEST_ARTIFACTS when set). The replayed-cluster twin (tests/unit/test_dashboard.py)
covers the refusals and hostile text; this one the real job's logs and stages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.core.web.pages import CSP
from tests.browser import browser_page, free_port, screenshots
from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster

pytestmark = pytest.mark.timeout(240)


def paced_demo(log_dir: Path) -> str:
    """The demo run, its benchmark paced at 2 requests/s: ~14 s of benchmarking (4, 8 and
    16 requests for concurrencies 1, 2 and 4), long enough to watch it live."""
    spec = demo_spec(log_dir, port=9700)
    assert 'request_rate = "inf"' in spec
    return spec.replace('request_rate = "inf"', "request_rate = 2")


def test_the_demo_run_live_in_a_browser(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    port = free_port()
    daemon = Daemon(cluster, tmp_path, extra_config=f'[dashboard]\ntcp = "127.0.0.1:{port}"\n')
    daemon.start()
    try:
        spec = paced_demo(shared_tmp)
        proc = daemon.submit(spec)
        assert proc.returncode == 0, proc.stderr
        run = str(json.loads(proc.stdout)["run"])
        token_file = daemon.state_dir / "dashboard.token"
        deadline = time.monotonic() + 30
        while not token_file.exists():
            assert time.monotonic() < deadline, "the dashboard wrote no token in 30 s"
            time.sleep(0.1)
        token = token_file.read_text().strip()
        origin = f"http://127.0.0.1:{port}"
        shots = screenshots(tmp_path)
        with browser_page() as (page, seen):
            response = page.goto(f"{origin}/?token={token}")
            assert response is not None and response.status == 200
            assert response.headers["content-security-policy"] == CSP
            # The runs page, reloaded until the run's row shows its agents benchmarking.
            deadline = time.monotonic() + 90
            while True:
                row = page.locator("table.runs tbody tr", has_text=run)
                text = row.inner_text() if row.count() == 1 else ""
                if "benchmarking" in text:
                    break
                assert time.monotonic() < deadline, f"no benchmarking stage: {text!r}"
                time.sleep(0.5)
                page.reload()
            page.screenshot(path=str(shots / "dashboard-cluster-runs.png"), full_page=True)

            # The run page: the job's log grows in the page while the run runs.
            response = page.goto(f"{origin}/runs/{run}")
            assert response is not None and response.status == 200
            log = page.locator("#log")
            page.wait_for_function(
                "document.querySelector('#log').textContent.length > 0", timeout=30_000
            )
            first = len(log.inner_text())
            deadline = time.monotonic() + 60
            while len(log.inner_text()) <= first:
                assert time.monotonic() < deadline, "the page's log did not grow"
                time.sleep(0.2)
            assert daemon.status(run)["state"] == "running"  # it grew while live
            page.screenshot(path=str(shots / "dashboard-cluster-run.png"), full_page=True)

            done = daemon.wait_state(run, {"succeeded", "failed", "unverified"}, 180)
            assert done["state"] == "succeeded", done
            response = page.goto(f"{origin}/runs/{run}")
            assert response is not None and response.status == 200
            chart = page.locator('img.chart[src*="/total-tput-vs-interactivity.svg"]')
            assert chart.count() == 1
            src = chart.get_attribute("src")
            assert src is not None
            svg = page.request.get(origin + src)
            assert svg.status == 200
            concurrencies = load_spec(spec).benchmark.concurrencies
            assert svg.text().count('class="point"') == len(concurrencies)
            page.wait_for_function(
                "document.querySelector('img.chart').naturalWidth > 0", timeout=60_000
            )
            page.screenshot(path=str(shots / "dashboard-cluster-results.png"), full_page=True)
        assert seen.requests and all(url.startswith(origin + "/") for url in seen.requests), (
            seen.requests
        )
        assert not [c for c in seen.console if "Content Security Policy" in c], seen.console
    finally:
        daemon.stop()
