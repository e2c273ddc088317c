"""The per-user service on the real cluster: a normal user (present on every node, with a
Slurm association) installs it with `deploy/install.sh --user`, runs the daemon its unit
starts, submits the demo through the CLI's socket discovery, and Slurm's accounting shows
the job under that user.

The machine has no systemd user manager, so the test plays its part: it creates the
unit's RuntimeDirectory and runs its ExecStart as the user. The package comes from a
wheelhouse built here first (the user has no pip cache and needs no network).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon_helpers import demo_spec
from tests.devcluster import REPO, DevCluster, with_slurm_bin

pytestmark = pytest.mark.slow

PORT = 9300
ACCOUNT = "llmdusers"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path
    base: Path  # world-traversable scratch directory holding home, sources, logs

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "PATH": with_slurm_bin(
                f"{self.home}/.local/bin:/usr/local/bin:/usr/bin:/bin",
                os.environ.get("DEVCLUSTER_SLURM_BIN", ""),
            ),
            "LANG": "C.UTF-8",
            "XDG_RUNTIME_DIR": str(self.base / "run"),
            **extra,
        }

    def run(
        self, argv: list[str], env: Mapping[str, str], timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=dict(env),
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            cwd=self.home,
        )


@pytest.fixture
def user(cluster: DevCluster) -> Iterator[User]:
    """A normal user with its home in /var/tmp and a Slurm association; removed after."""
    if not cluster.accounting:
        pytest.fail("the dev cluster runs without accounting; this test needs slurmdbd")
    name = f"llmdu{uuid.uuid4().hex[:8]}"
    base = Path(tempfile.mkdtemp(prefix="llmd-user-", dir="/var/tmp"))
    base.chmod(0o755)
    home = base / "home"
    subprocess.run(
        ["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash", name],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    (base / "run").mkdir(mode=0o700)
    os.chown(base / "run", entry.pw_uid, entry.pw_gid)
    sacctmgr = ["sacctmgr", "--immediate"]
    try:
        cluster.slurm([*sacctmgr, "add", "account", ACCOUNT], check=False)
        cluster.slurm([*sacctmgr, "add", "user", name, f"account={ACCOUNT}"])
        yield User(name, entry.pw_uid, entry.pw_gid, home, base)
    finally:
        cluster.slurm([*sacctmgr, "delete", "user", name], check=False)
        subprocess.run(["userdel", "--remove", name], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)


def _sources(user: User) -> Path:
    """The checkout as the user can read it (the real one may sit below a 0700 directory)."""
    src = user.base / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build"),
    )
    wheels = user.base / "wheels"
    # The package, what it needs, and what building it from source needs.
    wanted = [str(src), "setuptools>=68", "wheel"]
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels), *wanted],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    subprocess.run(["chmod", "-R", "a+rX", str(wheels)], check=True)
    # The user's own checkout: pip builds in it (egg-info).
    subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(src)], check=True)
    return src


def _last_json(text: str) -> dict[str, object]:
    """The last of the JSON documents `submit --wait --json` printed."""
    decoder, i, last = json.JSONDecoder(), 0, None
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        last, i = decoder.raw_decode(text, i)
    assert isinstance(last, dict), text[-2000:]
    return last


def _exec_start(unit: Path, user: User) -> list[str]:
    line = next(ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart="))
    text = line.removeprefix("ExecStart=")
    text = text.replace("%h", str(user.home)).replace("%E", str(user.home / ".config"))
    return text.split()


def test_a_user_installs_the_user_service_and_its_job_runs_as_that_user(
    cluster: DevCluster, user: User
) -> None:
    src = _sources(user)
    env = user.env(
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(user.base / "wheels"),
        PYTHON="/usr/bin/python3",
        LLMD_EXTRAS="",  # the report extra's install is the scratch-root test's
    )
    first = user.run(["bash", str(src / "deploy/install.sh"), "--user"], env)
    assert first.returncode == 0, first.stderr
    assert "systemctl --user enable --now llmd-supervisor" in first.stderr
    assert "loginctl enable-linger" in first.stderr
    unit = user.home / ".config/systemd/user/llmd-supervisor.service"
    config = user.home / ".config/llmd-supervisor/config.toml"
    assert unit.is_file() and config.is_file()
    assert config.stat().st_uid == user.uid and config.stat().st_mode & 0o077 == 0
    socket = user.base / "run/llmd-supervisor/control.sock"
    assert f'socket = "{socket}"' in config.read_text()
    config.write_text(config.read_text() + "\n# edited\n")
    again = user.run(["bash", str(src / "deploy/install.sh"), "--user"], env)
    assert again.returncode == 0 and "kept the existing" in again.stderr, again.stderr
    assert config.read_text().endswith("# edited\n")
    as_root = subprocess.run(
        ["bash", str(src / "deploy/install.sh"), "--user"], capture_output=True, text=True
    )
    assert as_root.returncode != 0 and "run it as the user who will submit" in as_root.stderr

    # The operator's part: where logs may be, the cluster (no SSH keys: shared-fs).
    logs = user.base / "runs"
    logs.mkdir()
    os.chown(logs, user.uid, user.gid)
    text = config.read_text().replace(
        "# log_roots = [", f'log_roots = ["{user.base}"]\n# log_roots = ['
    )
    text = text.replace(
        '# slurm_conf = "/etc/slurm/slurm.conf"',
        f'slurm_conf = "{cluster.env["SLURM_CONF"]}"\naccess = "shared-fs"',
    )
    config.write_text(text)
    # No --config: the CLI takes the user's own config before the system one.
    check = user.run(["llmd-supervisor", "config", "check"], env)
    assert check.returncode == 0, check.stderr
    assert str(config) in check.stdout and "access shared-fs" in check.stdout

    # systemd's part: RuntimeDirectory=, then ExecStart= as the user.
    (user.base / "run/llmd-supervisor").mkdir(mode=0o700)
    os.chown(user.base / "run/llmd-supervisor", user.uid, user.gid)
    argv = _exec_start(unit, user)
    assert argv[0] == str(user.home / ".local/share/llmd-supervisor/venv/bin/llmd-supervisor")
    daemon_log = (user.base / "daemon.log").open("wb")
    daemon = subprocess.Popen(
        argv,
        stdout=daemon_log,
        stderr=subprocess.STDOUT,
        env=user.env(PYTHONUNBUFFERED="1"),
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        cwd=user.home,
    )
    daemon_log.close()
    try:
        deadline = time.monotonic() + 30
        while not socket.exists() and time.monotonic() < deadline and daemon.poll() is None:
            time.sleep(0.2)
        assert socket.exists(), (user.base / "daemon.log").read_text()[-2000:]
        assert socket.stat().st_mode & 0o777 == 0o600
        spec = user.home / "demo.toml"
        spec.write_text(demo_spec(logs, port=PORT))
        os.chown(spec, user.uid, user.gid)
        # No --socket and no $LLMD_SUPERVISOR_SOCKET: the CLI finds the user's socket.
        done = user.run(["llmd-supervisor", "submit", str(spec), "--wait", "--json"], env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        final = _last_json(done.stdout)
        assert final["outcome"] == "succeeded", final["reason"]
        job = str(final["slurm_job_id"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    deadline = time.monotonic() + 30
    rows: list[str] = []
    while time.monotonic() < deadline:
        out = cluster.slurm(["sacct", "-j", job, "-X", "-n", "-P", "-o", "User,Account,State"])
        rows = [r for r in out.stdout.splitlines() if r.strip()]
        if rows:
            break
        time.sleep(1)
    assert rows == [f"{user.name}|{ACCOUNT}|COMPLETED"], rows


@pytest.mark.slurm_contract
def test_a_job_its_own_user_cancels_reads_cancelled_by_that_uid(
    cluster: DevCluster, user: User
) -> None:
    """`CANCELLED by <uid>` for a non-root `scancel` (the captures hold only root's `by 0`):
    parsed as CANCELLED on both versions, the uid kept in the reason."""
    script = user.base / "sleep.sh"
    script.write_text("#!/bin/bash\nsrun sleep 300\n")
    script.chmod(0o755)
    env = user.env(SLURM_CONF=cluster.env["SLURM_CONF"])
    sbatch = user.run(["sbatch", "--parsable", "-N", "1", "--output=/dev/null", str(script)], env)
    assert sbatch.returncode == 0, sbatch.stderr
    job = sbatch.stdout.strip().split(";")[0]
    cluster.wait_running(job)
    cancel = user.run(["scancel", job], env)
    assert cancel.returncode == 0, cancel.stderr
    cluster.wait_terminal(job)
    status, receipt = cluster.verify(job, user.base, "--timeout", "15")
    assert (status, receipt["outcome"]) == (11, "cancelled"), receipt["reason"]
    assert f"State=CANCELLED by {user.uid} " in str(receipt["reason"]), receipt["reason"]
