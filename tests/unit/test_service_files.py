"""The systemd unit and deploy/install.sh (run for real under a scratch root)."""

from __future__ import annotations

import configparser
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import REPO

UNIT = REPO / "systemd" / "llmd-supervisor.service"
INSTALL = REPO / "deploy" / "install.sh"


def unit_directives(text: str) -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(text)
    return {name: dict(parser[name]) for name in parser.sections()}


def test_unit_has_every_directive_issue_6_asks_for() -> None:
    service = unit_directives(UNIT.read_text())["Service"]
    expected = {
        "Type": "notify",
        "Restart": "on-failure",
        "RuntimeDirectory": "llmd-supervisor",
        "StateDirectory": "llmd-supervisor",
        "User": "llmd",
        "Group": "llmd",
        "KillMode": "mixed",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "read-only",
        "PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert service.get(key) == value, key
    assert float(service["WatchdogSec"]) > 0
    assert float(service["TimeoutStopSec"]) >= 30
    assert service["ExecStart"].endswith("daemon --config /etc/llmd-supervisor/config.toml")
    assert service["RestartPreventExitStatus"] == "2"  # a config error is not retried
    # ssh to the nodes and the Slurm commands (TCP to slurmctld, munge socket) stay possible.
    families = service["RestrictAddressFamilies"].split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    assert "ReadOnlyPaths" not in service and "InaccessiblePaths" not in service
    text = UNIT.read_text()
    assert "NEVER cancels a Slurm job" in text  # documented where operators look
    # A request that makes the daemon grow stops at its own cgroup, not the login node's.
    assert service["MemoryMax"] == "3G" and service["TasksMax"] == "512"


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, (
        "systemd-analyze is not installed on this machine; deploy/install-dev.sh installs it"
    )
    binary = Path(sys.executable).parent / "llmd-supervisor"
    assert binary.is_file(), binary
    unit = tmp_path / "llmd-supervisor.service"
    # The only change: point ExecStart at an executable that exists here.
    text = UNIT.read_text().replace("/opt/llmd-supervisor/bin/llmd-supervisor", str(binary))
    unit.write_text(text)
    out = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    # And the check is real: a misspelt directive is reported.
    unit.write_text(unit.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    out = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "kill mode" in out.stderr and "mixd" in out.stderr


@pytest.fixture
def throwaway_user() -> Iterator[str]:
    """A user name nobody has; the user and its group are removed afterwards."""
    name = f"llmdt{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", name], capture_output=True, check=False)


@pytest.mark.slow
def test_install_sh_into_a_scratch_root_is_complete_and_idempotent(
    tmp_path: Path, throwaway_user: str
) -> None:
    if os.geteuid() != 0:
        pytest.fail("install.sh must run as root")
    root = tmp_path / "root"
    env = {
        **os.environ,
        "DESTDIR": str(root),
        "LLMD_USER": throwaway_user,
        "LLMD_CREATE_USER": "1",
    }

    def install() -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["bash", str(INSTALL)], capture_output=True, text=True, env=env, timeout=400
        )
        assert out.returncode == 0, out.stderr
        return out

    first = install()
    assert "Next steps" in first.stderr and "systemctl enable --now llmd-supervisor" in first.stderr
    assert "journalctl -u llmd-supervisor -o json" in first.stderr
    user = pwd.getpwnam(throwaway_user)
    assert user.pw_dir == "/var/lib/llmd-supervisor" and user.pw_uid < 1000  # a system user

    state = root / "var/lib/llmd-supervisor"
    for d in (state, state / "archive", state / ".ssh"):
        assert d.is_dir() and d.stat().st_uid == user.pw_uid, d
    assert (state / ".ssh").stat().st_mode & 0o777 == 0o700
    key = state / ".ssh/id_ed25519"
    assert key.stat().st_uid == user.pw_uid and (state / ".ssh/known_hosts").is_file()

    venv_cli = root / "opt/llmd-supervisor/bin/llmd-supervisor"
    version = subprocess.run([venv_cli, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("llmd-supervisor ")
    venv_python = root / "opt/llmd-supervisor/bin/python"
    subprocess.run([venv_python, "-c", "import matplotlib"], check=True)  # `report` works
    link = root / "usr/local/bin/llmd-supervisor"
    assert os.readlink(link) == "/opt/llmd-supervisor/bin/llmd-supervisor"

    unit = root / "etc/systemd/system/llmd-supervisor.service"
    service = unit_directives(unit.read_text())["Service"]
    assert service["User"] == service["Group"] == throwaway_user
    assert service["ExecStart"].startswith("/opt/llmd-supervisor/bin/llmd-supervisor daemon")

    config = root / "etc/llmd-supervisor/config.toml"
    assert config.stat().st_mode & 0o777 == 0o640 and config.stat().st_gid == user.pw_gid
    shown = subprocess.run(
        [venv_cli, "config", "show", "--config", str(config)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr  # the shipped default is a valid config

    # Again: nothing breaks, the operator's config and the key are kept.
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    key_bytes = key.read_bytes()
    second = install()
    assert "kept the existing /etc/llmd-supervisor/config.toml" in second.stderr
    assert config.read_text().endswith("# edited by the operator\n")
    assert key.read_bytes() == key_bytes
    assert "created" not in second.stderr  # no user, group, venv or key created twice


USER_UNIT = REPO / "systemd" / "user" / "llmd-supervisor.service"


def test_the_user_unit_runs_the_users_own_daemon() -> None:
    units = unit_directives(USER_UNIT.read_text())
    service = units["Service"]
    assert "User" not in service and "Group" not in service  # the user manager's own user
    assert service["Type"] == "notify" and service["KillMode"] == "mixed"
    assert service["RuntimeDirectory"] == service["StateDirectory"] == "llmd-supervisor"
    assert service["RuntimeDirectoryMode"] == service["StateDirectoryMode"] == "0700"
    assert service["ExecStart"] == (
        "%h/.local/share/llmd-supervisor/venv/bin/llmd-supervisor daemon"
        " --config %E/llmd-supervisor/config.toml"
    )
    assert units["Install"]["WantedBy"] == "default.target"
    assert service["MemoryMax"] == "3G" and service["TasksMax"] == "512"
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is part of systemd, which install-dev.sh needs"


def test_user_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed on this machine")
    binary = Path(sys.executable).parent / "llmd-supervisor"
    unit = tmp_path / "llmd-supervisor.service"
    unit.write_text(
        USER_UNIT.read_text().replace(
            "%h/.local/share/llmd-supervisor/venv/bin/llmd-supervisor", str(binary)
        )
    )
    # `--user` needs a running user manager; the directives are the same for both.
    out = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


def test_the_cli_finds_the_users_socket_and_config_before_the_system_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket as sock

    from llmd_supervisor.cli.common import socket_default
    from llmd_supervisor.cli.config import config_default
    from llmd_supervisor.core.config import DEFAULT_PATH
    from llmd_supervisor.core.spec.log_dirs import DEFAULT_SOCKET

    monkeypatch.delenv("LLMD_SUPERVISOR_SOCKET", raising=False)
    monkeypatch.delenv("LLMD_SUPERVISOR_CONFIG", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf"))
    assert socket_default() == DEFAULT_SOCKET and config_default() == DEFAULT_PATH
    user_sock = tmp_path / "run/llmd-supervisor/control.sock"
    user_sock.parent.mkdir(parents=True)
    listener = sock.socket(sock.AF_UNIX)
    listener.bind(str(user_sock))
    user_conf = tmp_path / "conf/llmd-supervisor/config.toml"
    user_conf.parent.mkdir(parents=True)
    user_conf.write_text("")
    try:
        assert socket_default() == user_sock and config_default() == user_conf
        monkeypatch.setenv("LLMD_SUPERVISOR_SOCKET", "/x/y.sock")
        monkeypatch.setenv("LLMD_SUPERVISOR_CONFIG", "/x/c.toml")
        assert socket_default() == Path("/x/y.sock") and config_default() == Path("/x/c.toml")
    finally:
        listener.close()
