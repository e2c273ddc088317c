"""A cancel the daemon accepted and then could not carry out (it was SIGKILLed right after
journaling the request) still ends the job cancelled: the next start re-runs the cancel
sequence from the journal. (A cancel during a supervision retry: tests/unit/
test_driver_replay.py, which can hold the driver in its backoff deterministically.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster


def test_cancel_journaled_then_crash_still_cancels_the_job(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    daemon = Daemon(cluster, tmp_path, crash_after="cancel_requested")
    daemon.start()
    spec = demo_spec(shared_tmp, port=8600, common={"LLMD_FAKE_MARKER_DELAY_S": "120"})
    proc = daemon.submit(spec)
    assert proc.returncode == 0, proc.stderr
    run = str(json.loads(proc.stdout)["run"])
    daemon.wait_state(run, {"running"})
    daemon.cli("cancel", run, check=False, timeout=30)  # the daemon dies answering it
    assert daemon.proc is not None
    assert daemon.proc.wait(timeout=30) == -9, daemon.log_text()[-2000:]
    assert daemon.events("test.crash")
    assert not daemon.events("run.cancel_term")  # nothing was sent before the crash

    daemon.crash_after = None
    daemon.start()
    final = json.loads(daemon.cli("wait", run, "--json", check=False, timeout=120).stdout)
    assert final["outcome"] == "cancelled", final["reason"]
    assert final["cancel_requested"] is True
    assert daemon.events("run.cancel_term")
    events = (Path(str(final["archive"])) / "events.jsonl").read_text().splitlines()
    assert any(json.loads(e)["kind"] == "cancel.term_sent" for e in events)
    daemon.stop()
