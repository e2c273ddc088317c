"""The first hour with the CLI, before there is a daemon (issue 4.7): a spec is checked
here, `submit --dry-run` renders without a daemon, a file of the other kind is named as
such, sbatch options before `--` are explained, missing files are sentences, and `render`
gives the same bytes for the same spec. Run as the real entry point, no socket anywhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.devcluster import REPO

DEPLOY = REPO / "deploy" / "llm-d"
NO_SOCKET = "/nonexistent/llmd/control.sock"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMD_SUPERVISOR_SOCKET": NO_SOCKET}
    return subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        check=False,
    )


def test_dry_run_without_a_daemon_prints_the_script_and_says_what_was_not_checked() -> None:
    out = cli("submit", str(DEPLOY / "demo.toml"), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.startswith("#!/bin/bash\n") and "#SBATCH --job-name=llmd-dry-run\n" in out.stdout
    )
    assert f"Cannot reach the llmd-supervisor daemon at {NO_SOCKET}" in out.stderr
    assert "The spec is valid and its script follows, rendered here" in out.stderr
    assert "daemon.log_roots" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_spec_with_a_typo_is_reported_before_any_daemon_is_asked(
    tmp_path: Path, dry_run: bool
) -> None:
    spec = tmp_path / "typo.toml"
    spec.write_text((DEPLOY / "demo.toml").read_text().replace("[run]\n", "[run]\nnmae = 'x'\n"))
    out = cli("submit", str(spec), *(["--dry-run"] if dry_run else []))
    assert out.returncode == 2, out.stderr  # not 3: the daemon was never needed
    assert f"llmd-supervisor submit: {spec}: Run spec field 'run.nmae'" in out.stderr
    assert out.stdout == "" and "Cannot reach" not in out.stderr


def test_a_campaign_file_given_to_render_or_submit_names_campaign_submit() -> None:
    campaign = DEPLOY / "campaign-demo.toml"
    for command in (["render"], ["submit"], ["submit", "--dry-run"]):
        out = cli(*command[:1], str(campaign), *command[1:])
        assert out.returncode == 2, out.stderr
        assert f"{campaign} is a campaign file, not a run spec" in out.stderr
        assert f"`llmd-supervisor campaign submit {campaign}`" in out.stderr
        assert "unknown key" not in out.stderr


def test_a_run_spec_given_to_campaign_submit_names_submit() -> None:
    spec = DEPLOY / "demo.toml"
    out = cli("campaign", "submit", str(spec), "--dry-run")
    assert out.returncode == 2, out.stderr
    assert f"{spec} is a run spec, not a campaign file" in out.stderr
    assert f"`llmd-supervisor submit {spec}`" in out.stderr and "unknown key" not in out.stderr


def test_sbatch_options_before_the_double_dash_are_explained(tmp_path: Path) -> None:
    (tmp_path / "job.slurm").write_text("#!/bin/bash\nsrun true\n")
    out = cli("submit", "--script", "job.slurm", "-N", "3", "--time=5", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == (
        "llmd-supervisor submit: -N 3 --time=5: not options of submit; sbatch options go after"
        " `--`: llmd-supervisor submit --script job.slurm [submit's options] -- -N 3 --time=5\n"
    )
    plain = cli("submit", "x.toml", "-N", "3")  # no --script: argparse's own answer
    assert plain.returncode == 2 and "unrecognized arguments" in plain.stderr


def test_missing_files_and_bad_options_are_sentences_naming_the_fix(tmp_path: Path) -> None:
    out = cli("submit", "nope.toml", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == (
        f"llmd-supervisor submit: The run spec nope.toml does not exist (looked for"
        f" {tmp_path / 'nope.toml'}); check the path.\n"
    )
    out = cli("render", str(tmp_path / "nope.toml"))
    assert out.stderr == (
        f"llmd-supervisor render: The run spec {tmp_path / 'nope.toml'} does not exist;"
        " check the path.\n"
    )
    out = cli("submit", "--script", "nope.slurm", cwd=tmp_path)
    assert out.returncode == 2 and "Errno" not in out.stderr
    assert "The batch script nope.slurm does not exist" in out.stderr
    out = cli("render", str(tmp_path))
    assert f"The run spec {tmp_path} is a directory; give the file in it." in out.stderr

    (tmp_path / "job.slurm").write_text("#!/bin/bash\n")
    out = cli("submit", "--script", "job.slurm", "--", "a b", cwd=tmp_path)
    assert out.returncode == 2 and "SBATCH-ARGS" not in out.stderr and "Run spec" not in out.stderr
    assert "The sbatch option 'a b' (after --) is not accepted: give options only" in out.stderr
    out = cli("submit", "--script", "job.slurm", "--job-name-prefix", "a;b", cwd=tmp_path)
    assert "The option --job-name-prefix 'a;b' is not accepted" in out.stderr


def test_a_script_submission_failing_names_the_command_not_the_op(tmp_path: Path) -> None:
    (tmp_path / "job.slurm").write_text("#!/bin/bash\n")
    out = cli("submit", "--script", "job.slurm", "--", "-N", "2", cwd=tmp_path)
    assert out.returncode == 3  # no daemon
    assert out.stderr.startswith("llmd-supervisor submit: Cannot reach the llmd-supervisor")
    assert "submit_script" not in out.stderr


def test_render_gives_the_same_bytes_for_the_same_spec_and_a_name_from_it(tmp_path: Path) -> None:
    first, second = (
        cli("render", str(DEPLOY / "demo.toml")),
        cli("render", str(DEPLOY / "demo.toml")),
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    (name,) = re.findall(r"^#SBATCH --job-name=(\S+)$", first.stdout, re.M)
    assert re.fullmatch(r"llmd-demo-[0-9a-f]{8}", name)  # [run] name = "demo"
    changed = tmp_path / "other-file.toml"
    changed.write_text((DEPLOY / "demo.toml").read_text().replace('name = "demo"', 'name = "d2"'))
    other = cli("render", str(changed))
    (name2,) = re.findall(r"^#SBATCH --job-name=(\S+)$", other.stdout, re.M)
    assert name2.startswith("llmd-d2-") and name2[-8:] != name[-8:]
