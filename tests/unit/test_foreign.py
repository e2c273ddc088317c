"""Foreign specs (`core.spec.foreign`): what `submit --script` and `adopt` accept, and how a
foreign job's files are named (`core.run.layout` with a `Watch`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.spec import foreign as foreign
from llmd_supervisor.core.spec.foreign import ForeignSpec, MarkerFormat, Watch
from llmd_supervisor.core.verdict.marker import MarkerStatus, read_marker
from llmd_supervisor.errors import SpecError

SCRIPT = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output=slurm_job-%j.out\nsrun true\n"
WATCH = Watch(
    "/shared/runs/ix",
    logs=("slurm_job-{job_id}_rank_*.log", "{job_id}/epp.log"),
    marker=".bench_done.{job_id}",
    marker_format=MarkerFormat.INT,
    results=("results/*.json",),
)


def spec(**kw: object) -> ForeignSpec:
    base: dict[str, object] = {"kind": "script", "watch": WATCH, "script": SCRIPT}
    return ForeignSpec(**{**base, **kw})  # type: ignore[arg-type]


def body(**kw: object) -> str:
    value = json.loads(foreign.dump(spec()))
    value["foreign"].update(kw)
    return json.dumps(value)


def test_a_spec_round_trips_and_the_archive_copy_keeps_only_variable_names() -> None:
    s = spec(env={"MODEL": "m", "HF_TOKEN": "secret"}, sbatch_args=("--time=10",))
    assert foreign.load(foreign.dump(s)) == s
    assert foreign.is_foreign(foreign.dump(s)) and not foreign.is_foreign("[run]\n")
    shown = foreign.dump(s, with_env_values=False)
    assert "secret" not in shown and '"HF_TOKEN"' in shown
    assert s.job_name("abc") == "llmd-abc"
    assert spec(job_name_prefix="ci").sbatch_options("ci-abc") == ["--job-name=ci-abc"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("logs", ["/etc/passwd"], "relative to --log-dir"),
        ("logs", ["../x.log"], "without '.', '..'"),
        ("logs", ["*/x.log"], "only in the last part"),
        ("logs", ["a/{user}.log"], "the only placeholder is {job_id}"),
        ("logs", ["x;rm -rf.log"], "not allowed"),
        ("results", ["a//b"], "'//'"),
        ("marker", "done.*", "no wildcards"),
        ("marker_format", "yaml", "json, int or none"),
        ("job_name_prefix", "a b", "letters, digits"),
        ("chdir", "rel/dir", "absolute path"),
        ("script", "echo hi\n", "starts with '#!'"),
        ("script", "#!/bin/sh\n#SBATCH --wait\nsrun x\n", "--wait in a #SBATCH line"),
        ("script", "#!/bin/sh\n#SBATCH -H\n", "-H in a #SBATCH line"),
        ("script", "#!/bin/sh\n#SBATCH --uid=0\n", "--uid in a #SBATCH line"),
        ("sbatch_args", ["--job-name=x"], "--job-name is not allowed"),
        ("sbatch_args", ["--job=x"], "--job-name is not allowed"),  # sbatch takes prefixes
        ("sbatch_args", ["--exp=NONE"], "--export is not allowed"),
        ("sbatch_args", ["-Jx"], "-J is not allowed"),
        ("sbatch_args", ["--uid=0"], "--uid is not allowed"),
        ("sbatch_args", ["--wrap=true"], "--wrap is not allowed"),
        ("sbatch_args", ["--nodes"], "--nodes needs a value: --nodes VALUE"),
        ("sbatch_args", ["-N"], "-N needs a value: -N VALUE"),
        ("sbatch_args", ["-J", "x"], "-J is not allowed"),
        ("sbatch_args", ["--job", "x"], "--job-name is not allowed"),
        ("sbatch_args", ["-vW"], "a word of its own"),
        ("sbatch_args", ["job.sbatch"], "options only"),
        ("prefill_gpus", 8, "give both --prefill-gpus and --decode-gpus"),
        ("decode_gpus", True, "give both --prefill-gpus and --decode-gpus"),
    ],
)
def test_bad_values_are_refused_naming_the_option(field: str, value: object, says: str) -> None:
    with pytest.raises(SpecError, match=says.replace("(", r"\(").replace("*", r"\*")):
        foreign.load(body(**{field: value}))


def test_a_marker_format_defaults_its_marker_and_adopt_needs_a_numeric_job_id() -> None:
    # A format without --marker means the name `verify --log-dir` looks for.
    assert foreign.load(body(marker=None, marker_format="int")).watch.marker == (
        ".bench_done.{job_id}"
    )
    assert foreign.load(body(marker=None, marker_format="none")).watch.marker is None
    with pytest.raises(SpecError, match="numeric Slurm job id"):
        foreign.load(body(kind="adopt", job_id="12;rm"))
    assert foreign.load(body(kind="adopt", job_id="4711", script="")).job_id == "4711"


def test_sbatch_options_in_their_allowed_spellings_pass() -> None:
    args = ["--time=00:10:00", "-N2", "--exclusive", "-v", "--gres=gpu:8", "--partition=gpu"]
    assert foreign.load(body(sbatch_args=args)).sbatch_args == tuple(args)


def test_an_option_and_its_value_in_two_words_are_joined_as_sbatch_takes_them() -> None:
    args = ["-N", "3", "--time", "00:10:00", "-v", "--partition", "gpu", "--exclusive"]
    got = foreign.load(body(sbatch_args=args)).sbatch_args
    assert got == ("-N3", "--time=00:10:00", "-v", "--partition=gpu", "--exclusive")


def test_the_environment_drops_what_would_change_sbatch_and_bounds_the_rest() -> None:
    env = {"MODEL": "x", "LD_PRELOAD": "/tmp/evil.so", "SLURM_CONF": "/tmp/c", "BASH_ENV": "e"}
    got = foreign.load(body(env=env))
    assert got.env == {"MODEL": "x"}
    assert got.env_dropped == ("BASH_ENV", "LD_PRELOAD", "SLURM_CONF")
    with pytest.raises(SpecError, match="at most"):
        foreign.load(body(env={"BIG": "x" * (foreign.ENV_MAX_BYTES + 1)}))


def test_a_foreign_layout_names_its_own_files() -> None:
    layout = RunLayout(
        WATCH.log_dir,
        "llmd-r1",
        Path("/a/r1"),
        WATCH,
        ("/shared/runs/ix/slurm_job-7.out", "/shared/runs/ix/slurm_job-7.err"),
    )
    assert layout.marker("7") == "/shared/runs/ix/.bench_done.7"
    assert layout.status_file("7", 0) is None and layout.diag_file("7", 0) is None
    assert layout.batch_log_names("7") == ("slurm_job-7.out", "slurm_job-7.err")
    assert layout.log_dirs("7", 0) == ("/shared/runs/ix", "/shared/runs/ix/7")
    assert layout.log_dirs("7", 1) == ()
    ix = "/shared/runs/ix"
    assert layout.log_copy_name("7", 0, ix, "slurm_job-7_rank_1.log") == "slurm_job-7_rank_1.log"
    assert layout.log_copy_name("7", 0, ix, "slurm_job-8_rank_1.log") is None
    assert layout.log_copy_name("7", 0, f"{ix}/7", "epp.log") == "7/epp.log"
    assert layout.streamed("slurm_job-7.out", None) and not layout.streamed("7/epp.log", None)
    assert layout.streamed("7/epp.log", 0)
    assert layout.marker_format is MarkerFormat.INT


@pytest.mark.parametrize(
    ("data", "fmt", "status"),
    [
        (b"0\n", MarkerFormat.INT, MarkerStatus.OK),
        (b"0\n", MarkerFormat.JSON, MarkerStatus.WRONG_FORMAT),
        (b"0\n", MarkerFormat.ANY, MarkerStatus.OK),
        (None, MarkerFormat.NONE, MarkerStatus.NOT_USED),
        (b"7\n", MarkerFormat.NONE, MarkerStatus.NOT_USED),
        (None, MarkerFormat.INT, MarkerStatus.MISSING),
    ],
)
def test_the_marker_is_read_in_the_declared_format(
    data: bytes | None, fmt: MarkerFormat, status: MarkerStatus
) -> None:
    reading = read_marker(data, "7", fmt, ".done.7")
    assert reading.status is status
    if status is MarkerStatus.MISSING:
        assert reading.describe() == "marker .done.7 missing"
    if status is MarkerStatus.NOT_USED:
        assert reading.describe() == "no marker protocol"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["submit", "spec.toml", "--script", "job.sbatch"], "not both"),
        (["submit", "--logs", "x.log"], "--logs need --script"),
        (["submit", "spec.toml", "--", "--time=1"], "not both"),
        (["submit", "--script", "job.sbatch", "--", "--job-name=x"], "--job-name is not allowed"),
        (
            ["submit", "--script", "job.sbatch", "--logs", "../x"],
            "The option --logs '../x' is not accepted",
        ),
        (["adopt", "12x"], "numeric Slurm job id"),
    ],
)
def test_the_cli_refuses_bad_submissions_before_asking_the_daemon(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    says: str,
) -> None:
    from llmd_supervisor.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.sbatch").write_text(SCRIPT)
    (tmp_path / "spec.toml").write_text("")
    assert main([*argv[:1], "--socket", str(tmp_path / "none.sock"), *argv[1:]]) == 2
    assert says in capsys.readouterr().err


def test_the_roles_gpus_round_trip() -> None:
    s = spec(prefill_gpus=16, decode_gpus=8)
    assert foreign.load(foreign.dump(s)) == s
    assert (s.prefill_gpus, s.decode_gpus) == (16, 8)


def test_a_foreign_run_is_named_by_its_script_or_its_job() -> None:
    """`list`'s NAME: the script's file name (escaped, bounded), or adopted-JOBID."""
    assert spec(script_name="run_dsr1.sbatch").name() == "run_dsr1.sbatch"
    assert spec(script_name="jobs/\x1b[2Jx.sh").name() == "\\x1b[2Jx.sh"
    assert len(spec(script_name="a" * 255).name()) == foreign.NAME_MAX
    assert spec(script_name="").name() == ""  # from stdin
    assert spec(kind="adopt", script="", job_id="4711").name() == "adopted-4711"
