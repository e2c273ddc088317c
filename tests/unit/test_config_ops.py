"""`config check` / `config show`, the effective-config round trip, and the new validations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmd_supervisor.core.config import Config, effective, load_config, to_toml
from llmd_supervisor.errors import ConfigError
from tests.devcluster import REPO

FULL = """
[daemon]
state_dir = "/srv/llmd/state"
socket = "/srv/llmd/control.sock"
socket_mode = "0640"
admin_group = "root"
log_format = "json"

[ssh]
user = "svc"
identity_files = ["/k/id_ed25519", "/k/id_rsa"]
known_hosts = "/k/known_hosts"
port = 2222
connect_timeout_s = 5

[poll]
min_interval_s = 0.5
max_interval_s = 7.5
command_timeout_s = 20
sacct_chunk = 50

[limits]
verify_timeout_s = 90

[metrics]
listen = "127.0.0.1:9464"

[[clusters]]
name = "alpha"
slurm_conf = "/etc/slurm-alpha/slurm.conf"

[[clusters]]
name = "beta"
login_host = "login.beta"
slurm_conf = "/etc/slurm/slurm.conf"
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("text", ["", FULL, (REPO / "deploy" / "llmd-supervisor.toml").read_text()])
def test_show_output_is_a_config_that_loads_back_to_the_same_values(text: str) -> None:
    config = load_config(text)
    again = load_config(to_toml(effective(config)))
    assert effective(again) == effective(config)
    assert again.clusters == config.clusters and again.ssh == config.ssh
    assert again.poll == config.poll and again.limits == config.limits


@pytest.mark.parametrize(
    ("daemon", "mode"),
    [
        ("", 0o600),  # a per-user daemon started by hand: only its user
        ('socket_group = "llmd-users"', 0o660),  # the group the config names may connect
        ('socket_mode = "0660"', 0o660),  # as written (the daemon warns: no group named)
        ('socket_mode = "0640"\nsocket_group = "g"', 0o640),
    ],
)
def test_the_socket_is_private_unless_a_group_is_named(daemon: str, mode: int) -> None:
    assert load_config(f"[daemon]\n{daemon}\n").socket_mode == mode
    assert Config().socket_mode == 0o600


def test_defaults_verify_host_keys_against_the_users_known_hosts() -> None:
    assert Config().ssh.known_hosts.endswith("/.ssh/known_hosts")
    assert load_config("").ssh.known_hosts == Config().ssh.known_hosts


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:9464", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1", "example.org:9464"]
)
def test_metrics_listen_must_be_loopback_with_a_real_port(listen: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(f'[metrics]\nlisten = "{listen}"\n')
    assert info.value.key == "metrics.listen"
    assert "127.0.0.1:9464" in str(info.value)  # the fix is in the message


@pytest.mark.parametrize(
    ("cluster", "hint_part"),
    [
        ('access = "nfs"', "use 'ssh', 'login-host' or 'shared-fs'"),
        ('access = "login-host"', "'login-host' needs login_host"),
        ('access = "shared-fs"\nlogin_host = "l1"', "only used with access = 'login-host'"),
        ('access = "ssh"\nlogin_host = "l1"', "only used with access = 'login-host'"),
    ],
)
def test_cluster_access_is_checked(cluster: str, hint_part: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(f'[[clusters]]\nname = "a"\n{cluster}\n')
    assert info.value.key == "clusters[0].access" and hint_part in str(info.value)


def test_cluster_access_defaults() -> None:
    config = load_config('[[clusters]]\nname = "a"\n[[clusters]]\nname = "b"\nlogin_host = "l"\n')
    assert [c.access.value for c in config.clusters] == ["ssh", "login-host"]


def test_config_show_prints_effective_values_as_toml_and_json(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(FULL)
    toml_out = cli("config", "show", "--config", str(path))
    assert toml_out.returncode == 0, toml_out.stderr
    assert 'archive_dir = "/srv/llmd/state/archive"' in toml_out.stdout  # a default, shown
    assert "heartbeat_interval_s = 2.0" in toml_out.stdout
    assert 'login_host = "login.beta"' in toml_out.stdout
    json_out = cli("config", "show", "--config", str(path), "--json")
    data = json.loads(json_out.stdout)
    assert data["clusters"][0] == {
        "name": "alpha",
        "slurm_conf": "/etc/slurm-alpha/slurm.conf",
        "login_host": None,
        "access": "ssh",
    }
    assert data["clusters"][1]["access"] == "login-host"  # the default with a login host
    assert data["metrics"]["listen"] == "127.0.0.1:9464"
    assert data["daemon"]["socket_mode"] == "0640"


def test_config_check_names_the_key_and_the_fix_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[poll]\nmin_interval_s = 0.01\n")
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2
    assert "'poll.min_interval_s'" in out.stderr
    assert "use a number of seconds from 0.05" in out.stderr
    path.write_text("[[clusters]]\nname = 'a'\nlogin = 'x'\n")
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2 and "'clusters[0].login'" in out.stderr
    assert "allowed here: name, slurm_conf, login_host" in out.stderr
    out = cli("config", "check", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_config_check_reports_every_missing_file_and_group(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path}/state"
admin_group = "no-such-group-llmd"
log_roots = ["{tmp_path}/link-to-runs"]
[ssh]
identity_files = ["{tmp_path}/nokey"]
known_hosts = "{tmp_path}/nohosts"
[[clusters]]
name = "local"
slurm_conf = "{tmp_path}/no-slurm.conf"
[[clusters]]
name = "remote"
login_host = "login1"
slurm_conf = "/only/on/login1/slurm.conf"
"""
    )
    (tmp_path / "runs").mkdir()
    (tmp_path / "link-to-runs").symlink_to(tmp_path / "runs")
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    keys = [
        "ssh.identity_files[0]",
        "ssh.known_hosts",
        "clusters[0].slurm_conf",
        "admin_group",
        f"daemon.log_roots[0]' has invalid value '{tmp_path}/link-to-runs': it resolves to"
        f" {tmp_path}/runs",
    ]
    for key in keys:
        assert any(key in line for line in lines), (key, lines)
    assert len(lines) == 5  # the login_host cluster's slurm.conf is not looked for here
    assert "ssh-keygen" in out.stderr and "ssh-keyscan" in out.stderr


def test_config_check_passes_a_good_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    hosts = tmp_path / "known_hosts"
    key.write_text("k")
    hosts.write_text("")
    path = tmp_path / "c.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path}/not/yet/state"
log_roots = ["{tmp_path / "runs"}"]
[ssh]
identity_files = ["{key}"]
known_hosts = "{hosts}"
[[clusters]]
name = "here"
[[clusters]]
name = "there"
login_host = "login1"
"""
    )
    (tmp_path / "runs").mkdir()
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
    assert "here (access ssh: Slurm here, logs over SSH per node)" in out.stdout
    assert "there (access login-host: Slurm on login1" in out.stdout
    # shared-fs: named, and a log root this machine does not see is warned about.
    shared = path.read_text().replace('name = "here"', 'name = "here"\naccess = "shared-fs"')
    path.write_text(
        shared.replace(f'log_roots = ["{tmp_path / "runs"}"]', 'log_roots = ["/no/such"]')
    )
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 0, out.stderr
    assert "here (access shared-fs: Slurm here, logs from the shared file system" in out.stdout
    assert "warning: daemon.log_roots[0] '/no/such' is not a directory here" in out.stderr
    assert "cluster here (access shared-fs)" in out.stderr
    path.write_text(shared)
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    path.write_text(path.read_text().replace(f'log_roots = ["{tmp_path / "runs"}"]', ""))
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2 and "daemon.log_roots" in out.stderr, out.stderr
    assert "no run can be submitted" in out.stderr


def test_config_check_reports_every_problem_at_once_each_naming_key_and_fix(
    tmp_path: Path,
) -> None:
    """A relative state_dir and socket, a log root holding the state directory and two bad
    values further down: one line each, not only the first."""
    path = tmp_path / "c.toml"
    path.write_text(
        """
[daemon]
state_dir = "state"
socket = "./control.sock"
log_format = "xml"
[poll]
sacct_chunk = 0
[[clusters]]
name = "a b"
"""
    )
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    keys = ["daemon.state_dir", "daemon.socket", "daemon.log_format", "poll.sacct_chunk"]
    keys += ["clusters[0].name"]
    assert len(lines) == len(keys), out.stderr
    for line, key in zip(lines, keys, strict=True):
        assert f"Configuration key {key!r}" in line and str(path) in line, line
    # The hint is a sentence naming the key, its value and an absolute example.
    assert (
        "daemon.state_dir = 'state' is a relative path" in lines[0]
        and "write an absolute path" in lines[0]
        and "e.g. daemon.state_dir = '/var/lib/llmd-supervisor'" in lines[0]
    ), lines[0]
    assert "e.g. daemon.socket = '/run/llmd-supervisor/control.sock'" in lines[1], lines[1]
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path}/state"\nlog_roots = ["{tmp_path}/state/runs"]\n'
    )
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2 and "'daemon.log_roots[0]'" in out.stderr
    assert "is inside daemon.state_dir" in out.stderr
    # A root holding the state directory (a user's home) is fine: that part is refused.
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path}/home/state"\nlog_roots = ["{tmp_path}/home"]\n'
    )
    assert "log_roots" not in cli("config", "check", "--config", str(path)).stderr


def test_a_toml_syntax_error_names_the_file_and_line_not_its_text(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[daemon]\nstate_dir = /var/lib/x\nsecret = 'do not print me'\n")
    out = cli("config", "check", "--config", str(path))
    assert out.returncode == 2
    assert "line 2" in out.stderr and str(path) in out.stderr
    assert "do not print me" not in out.stderr
    assert "--config" in cli("config", "check", "--help").stdout
    assert "LLMD_SUPERVISOR_CONFIG" in cli("config", "check", "--help").stdout
