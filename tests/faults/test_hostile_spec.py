"""Hostile users against the real daemon and dev cluster (issue 2.2: spec options, secrets).

* A secret in the daemon's environment never reaches a job: every process of the job
  (batch shell, srun, agents, engines; read from /proc on this machine, where the dev
  cluster's nodes are network namespaces) lacks it, while the spec's own [env] arrives.
* The job's files are private: every job process runs under umask 077, config.json (the
  spec's [env] values) is 0600, and nothing the job wrote is readable by group or others.
* `submit` refuses what the attack used (--export-file=<root-only file>, abbreviations
  and aliases of reserved options, an option-like python, `/` mounts, deep TOML
  nesting, a 5,000-digit integer) with exit status 2 and a message naming the value and
  the fix, submits nothing, and the daemon keeps serving.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from pathlib import Path

from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster

PORT = 8860
CANARY_NAME = "LLMD_TEST_DAEMON_SECRET"
# The engine stand-ins dump their environment before exec'ing the engine.
DUMP_ENV = """'env > "$LLMD_JOB_DIR/env.rank$LLMD_RANK"; exec "$0" "$@"'"""


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or a kernel thread
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _umask(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return line.split()[1]
    except OSError:
        return None
    return None


def _job_processes(job_id: str) -> dict[int, dict[str, str]]:
    """Every process on this machine whose environment says it belongs to `job_id`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            env = _environ(int(entry.name))
            if env is not None and env.get("SLURM_JOB_ID") == job_id:
                found[int(entry.name)] = env
    return found


def _hostile_demo(log_dir: Path, *, slurm_extra: str = "", top: str = "") -> str:
    text = demo_spec(
        log_dir,
        port=PORT,
        common={"LLMD_FAKE_MARKER_DELAY_S": "6", "LLMD_SPEC_TOKEN": "from-the-spec"},
    )
    for role in ("prefill", "decode"):
        text = text.replace(
            f'{role}_command = ["python3",', f'{role}_command = ["sh", "-c", {DUMP_ENV}, "python3",'
        )
    if slurm_extra:
        text = text.replace("requeue = false", f"requeue = false\n{slurm_extra}")
    return top + text


def test_daemon_environment_never_reaches_the_job_and_job_files_are_private(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    daemon = Daemon(cluster, tmp_path, env={CANARY_NAME: canary})
    daemon.start()
    try:
        assert daemon.proc is not None
        assert (_environ(daemon.proc.pid) or {}).get(CANARY_NAME) == canary
        extra = 'extra_args = ["--comment=llmd-hostile-spec", "--mem=0"]'
        result = daemon.submit(_hostile_demo(shared_tmp, slurm_extra=extra))
        assert result.returncode == 0, result.stderr
        run = str(json.loads(result.stdout)["run"])
        status = daemon.wait_state(run, {"running"} | _FINAL, timeout=300)
        job_id = str(status["slurm_job_id"])
        job_dir = shared_tmp / job_id

        # While the job runs: all four engines have dumped their environment, and every
        # process of the job is inspected.
        deadline = time.monotonic() + 60
        while len(list(job_dir.glob("env.rank*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        procs = _job_processes(job_id)
        scontrol = cluster.slurm(["scontrol", "show", "job", job_id], check=False).stdout

        final = daemon.wait_state(run, _FINAL, timeout=300)
    finally:
        daemon.stop()

    assert final["outcome"] == "succeeded", final["reason"]
    assert "Comment=llmd-hostile-spec" in scontrol
    dumps = sorted(job_dir.glob("env.rank*"))
    assert [p.name for p in dumps] == [f"env.rank{r}" for r in range(4)]
    for dump in dumps:
        text = dump.read_text()
        assert canary not in text and CANARY_NAME not in text, dump
        assert "LLMD_SPEC_TOKEN=from-the-spec" in text  # the spec's [env] still arrives
    # The batch shell, srun, the four agents and the engines at least.
    assert len(procs) >= 9, procs
    for pid, env in procs.items():
        assert CANARY_NAME not in env and canary not in "".join(env.values()), pid
        assert _umask(pid) in ("0077", None), (pid, env.get("_"))

    # Modes: the config holds the [env] values; nothing the job wrote is group/other
    # readable (the job's files are created under umask 077, the batch logs by Slurm
    # with SLURM_UMASK=0077).
    node_dir = job_dir / "node"
    assert stat.S_IMODE((node_dir / "config.json").stat().st_mode) == 0o600
    written = [job_dir, *job_dir.rglob("*"), *shared_tmp.glob(f"*{job_id}*")]
    assert any(p.name == f".bench_done.{job_id}" for p in written)
    assert any(p.suffix == ".out" for p in written)
    loose = [(str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in written]
    assert [x for x in loose if int(x[1], 8) & 0o077] == []


_FINAL = {"succeeded", "failed", "cancelled", "timed_out", "node_failed", "unverified"}


def test_submit_refuses_hostile_specs_with_exit_2_and_the_fix(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    secret = tmp_path / "root-only.env"
    secret.write_bytes(b"LLMD_STOLEN=1\0")
    secret.chmod(0o600)
    pyxis = '[container]\nkind = "pyxis"\nsquash_file = "/img/x.sqsh"\n'
    cases = [
        (
            _hostile_demo(shared_tmp, slurm_extra=f'extra_args = ["--export-file={secret}"]'),
            ["'slurm.extra_args[0]'", f"--export-file={secret}", "reads a file", "allowed: --"],
        ),
        (
            _hostile_demo(shared_tmp, slurm_extra='extra_args = ["--tasks-per=2"]'),
            ["abbreviates --tasks-per-node", "cannot be overridden"],
        ),
        (
            _hostile_demo(shared_tmp, slurm_extra='extra_args = ["--uid=0"]'),
            ["changes the job's user", "remove it"],
        ),
        (
            _hostile_demo(shared_tmp, slurm_extra='extra_args = ["-C", "gpu"]'),
            ["short sbatch options are not accepted; write --constraint"],
        ),
        (
            _hostile_demo(shared_tmp).replace('python = "python3"', 'python = "-c"'),
            ["'container.python'", "never starting with '-'"],
        ),
        (
            _hostile_demo(shared_tmp).replace(
                '[container]\nkind = "none"\npython = "python3"',
                pyxis + 'mounts = ["/:/host"]',
            ),
            ["'container.mounts[0]'", "'/' cannot be mounted"],
        ),
        (
            _hostile_demo(shared_tmp).replace(
                '[container]\nkind = "none"\npython = "python3"',
                pyxis + 'mounts = ["/var/run/docker.sock:/var/run/docker.sock"]',
            ),
            ["overlaps /var/run/docker.sock"],
        ),
        ("x = " + "[" * 50_000 + "]" * 50_000 + "\n", ["nested more than 16 deep"]),
        ("x = " + "9" * 5000 + "\n", ["4300 digits", "fit in 64 bits"]),
        ("a." * 20_000 + "b = 1\n", ["more than 16 parts"]),
    ]
    daemon = Daemon(cluster, tmp_path)
    daemon.start()
    try:
        for text, parts in cases:
            result = daemon.submit(text)
            assert result.returncode == 2, (text[:200], result.stdout, result.stderr)
            for part in parts:
                assert part in result.stderr, (part, result.stderr)
            assert "internal" not in result.stderr.lower()
        assert json.loads(daemon.cli("list", "--all", "--json").stdout)["runs"] == []
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.log_text()
    assert os.environ.get("LLMD_STOLEN") is None
