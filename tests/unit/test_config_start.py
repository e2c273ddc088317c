"""`config check` checks what the daemon will need at start and to deliver (issue 4.7):
the dashboard's token file, the local sendmail of a mail destination; and `config show`
without a file says it shows the built-in defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd_supervisor.cli.main import main


def _good(tmp_path: Path, more: str) -> Path:
    key, hosts = tmp_path / "key", tmp_path / "known_hosts"
    key.write_text("k")
    hosts.write_text("")
    (tmp_path / "runs").mkdir(exist_ok=True)
    path = tmp_path / "c.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path}/state"
log_roots = ["{tmp_path / "runs"}"]
[ssh]
identity_files = ["{key}"]
known_hosts = "{hosts}"
[[clusters]]
name = "here"
{more}
"""
    )
    return path


def test_a_dashboard_token_file_the_daemon_cannot_read_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "dashboard.token"
    path = _good(tmp_path, f'[dashboard]\ntcp = "127.0.0.1:8765"\ntoken_file = "{token}"\n')
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"Configuration key 'dashboard.token_file' has invalid value '{token}'" in err
    assert "cannot be opened: No such file or directory; the daemon would not start" in err
    token.write_text("x" * 40)
    token.chmod(0o644)
    assert main(["config", "check", "--config", str(path)]) == 2
    assert f"chmod 600 {token}" in capsys.readouterr().err
    token.chmod(0o600)
    assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err
    # Without tcp the daemon never reads it: nothing to check.
    token.unlink()
    path.write_text(path.read_text().replace('tcp = "127.0.0.1:8765"\n', ""))
    assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err


def test_a_mail_destination_without_sendmail_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmd_supervisor.adapters.outbox import sender as event_sender

    mail = '[[events.destination]]\nname = "oncall"\nkind = "mail"\nto = ["oncall@example.org"]\n'
    path = _good(tmp_path, mail)
    missing = tmp_path / "no" / "sendmail"
    monkeypatch.setattr(event_sender, "SENDMAIL", (str(missing), "-t", "-oi"))
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Configuration key 'events.destination[0]' has invalid value 'oncall'" in err
    assert f"hands its mails to {missing}, which is not installed here" in err
    present = tmp_path / "sendmail"
    present.write_text("#!/bin/sh\nexit 0\n")
    present.chmod(0o755)
    monkeypatch.setattr(event_sender, "SENDMAIL", (str(present), "-t", "-oi"))
    assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err


def test_config_show_without_a_file_says_it_shows_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmd_supervisor.cli import config as cli_config
    from llmd_supervisor.core import config as core_config

    absent = tmp_path / "etc" / "config.toml"  # the default path, where no file is
    monkeypatch.setattr(core_config, "DEFAULT_PATH", absent)
    monkeypatch.setattr(cli_config, "config_default", lambda: absent)
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        f"# no configuration file at {absent}: the built-in defaults (write them there to"
        " start one)"
    )
    assert "# effective configuration of" not in out
    assert not absent.exists()


def test_a_linked_password_file_is_named_as_a_link_with_the_file_it_points_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ELOOP (O_NOFOLLOW on a link) says what it means: a link, and where to point the key."""
    secret = tmp_path / "real-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    link = tmp_path / "db-password"
    link.symlink_to(secret)
    journal = f'[journal]\nurl = "postgresql://llmd@localhost/llmd"\npassword_file = "{link}"\n'
    path = _good(tmp_path, journal)
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{link} is a symbolic link; the daemon does not follow links for the password file:"
        f" point journal.password_file at the real file ({secret})"
    ) in err, err
    assert "Too many levels of symbolic links" not in err
    path.write_text(path.read_text().replace(str(link), str(secret)))
    assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("mode", ["disable", "allow", "prefer", "require", "verify-ca"])
def test_config_check_refuses_a_journal_link_weaker_than_verify_full_to_a_remote_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """README, A PostgreSQL journal: over the network sslmode is verify-full, and a weaker
    mode is refused (naming the URL, the mode, the host and the fix); loopback and a Unix
    socket directory take any mode."""
    for local in ("localhost", "127.0.0.1", "%2Frun%2Fpostgresql"):
        url = f"postgresql://llmd@{local}/llmd?sslmode={mode}"
        path = _good(tmp_path, f'[journal]\nurl = "{url}"\n')
        assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err
    url = f"postgresql://llmd@localhost,db.example.org/llmd?sslmode={mode}"
    path = _good(tmp_path, f'[journal]\nurl = "{url}"\n')
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"Configuration key 'journal.url' has invalid value '{url}'" in err, err
    assert f"sslmode={mode} to db.example.org" in err, err
    assert "anything weaker than verify-full is refused for a host other than" in err, err
    assert "use sslmode=verify-full" in err and "sslrootcert=" in err, err


def test_config_check_accepts_verify_full_to_a_remote_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url in (
        "postgresql://llmd@db.example.org/llmd",
        "postgresql://llmd@db1,db2/llmd?sslmode=verify-full&sslrootcert=/etc/llmd/ca.pem",
    ):
        path = _good(tmp_path, f'[journal]\nurl = "{url}"\n')
        assert main(["config", "check", "--config", str(path)]) == 0, capsys.readouterr().err
