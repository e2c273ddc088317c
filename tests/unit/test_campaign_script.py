"""Campaigns over a batch script (core.campaign.script, core.campaign.expand.expand_script): the
file, its points, their recipe ids, the `submit --script` spec of each job's run, and the
points a script run's archive proves (supervision.campaign.points)."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmd_supervisor.core.campaign.expand import (
    CampaignFile,
    Expansion,
    expand,
    expand_script,
    job_spec,
    job_text,
    parse_campaign,
)
from llmd_supervisor.core.campaign.script import (
    Launcher,
    ScriptJob,
    is_script_job,
    recipe_sbatch_args,
    time_limit_of,
)
from llmd_supervisor.core.results.evidence import Point, ResultProblem
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.errors import CampaignError, SpecError
from llmd_supervisor.supervision.campaign.points import still_good, verified_of
from llmd_supervisor.supervision.run.bench_files import BenchFiles, foreign_table

SCRIPT = """#!/bin/bash
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:30:00
#SBATCH --output=slurm_job-%j.out
srun bash server.sh
"""

# InferenceX's llm-d launcher, as a campaign: settings in the environment, the
# concurrencies in BENCH_MAX_CONCURRENCY ("1x4x16").
IX = """
name = "ix-sweep"
script = "job.slurm"
[launcher]
chdir = "run"
logs = ["slurm_job-{job_id}_rank_*.log"]
marker = ".bench_done.{job_id}"
marker_format = "int"
results = ["results/*.json"]
job_name_prefix = "ix"
sbatch_args = ["--partition=gpu", "--time=01:00:00", "--gres=gpu:8"]
nodes = 2
gpus_per_node = 8
concurrency_env = "BENCH_MAX_CONCURRENCY"
concurrencies = [1, 4, 16]
topology_env = ["PREFILL_NODES"]
[launcher.env]
MODEL_NAME = "deepseek-ai/DeepSeek-R1"
BENCH_REQUEST_RATE = inf
RUN_EVAL = false
BENCH_RANDOM_RANGE_RATIO = 0.8
[matrix]
"env.BENCH_INPUT_LEN" = [1024, 8192]
[[zip]]
"env.PREFILL_NODES" = [1, 2]
"launcher.nodes" = [2, 3]
"""

DIR = "/home/me/ix"


def _script_campaign(launcher: str, rest: str = "") -> CampaignFile:
    text = f'script = "job.slurm"\n[launcher]\n{launcher}\n{rest}'
    return parse_campaign(text, default_name="c")


MINIMAL = 'nodes = 1\nconcurrency_env = "CONC"\nconcurrencies = [1, 2]'


def _expand(c: CampaignFile, script: str = SCRIPT, *, max_points: int = 10_000) -> Expansion:
    return expand_script(
        c, script, script_name="job.slurm", campaign_dir=DIR, max_points=max_points
    )


# --- the file -----------------------------------------------------------------------------


def test_an_inferencex_style_campaign_parses() -> None:
    c = parse_campaign(IX, default_name="ignored")
    assert (c.name, c.base, c.script) == ("ix-sweep", None, "job.slurm")
    assert c.launcher == Launcher(
        nodes=2,
        concurrency_env="BENCH_MAX_CONCURRENCY",
        gpus_per_node=8,
        concurrencies=(1, 4, 16),
        topology_env=("PREFILL_NODES",),
        env=(
            ("MODEL_NAME", "deepseek-ai/DeepSeek-R1"),
            ("BENCH_REQUEST_RATE", "inf"),  # as InferenceX passes it
            ("RUN_EVAL", "false"),  # booleans as a shell script tests them
            ("BENCH_RANDOM_RANGE_RATIO", "0.8"),
        ),
        chdir="run",
        logs=("slurm_job-{job_id}_rank_*.log",),
        marker=".bench_done.{job_id}",
        marker_format="int",
        results=("results/*.json",),
        job_name_prefix="ix",
        sbatch_args=("--partition=gpu", "--time=01:00:00", "--gres=gpu:8"),
    )
    assert [a.keys for a in c.axes] == [
        ("env.BENCH_INPUT_LEN",),
        ("env.PREFILL_NODES", "launcher.nodes"),
    ]


def test_launcher_defaults() -> None:
    launcher = _script_campaign('nodes = 1\nconcurrency_env = "CONC"').launcher
    assert launcher == Launcher(nodes=1, concurrency_env="CONC")
    assert (launcher.concurrency_separator, launcher.gpus_per_node) == ("x", 0)
    assert launcher.marker_format == "none"
    marked = _script_campaign('nodes = 1\nconcurrency_env = "C"\nmarker = "done"').launcher
    assert marked is not None and marked.marker_format == "json"  # as submit --script


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        (
            'base = "s.toml"\nscript = "job.slurm"',
            "script",
            "give base (a run spec to vary) or script (a batch script whose environment"
            " varies), not both",
        ),
        (
            "[launcher]\nnodes = 1",
            "base",
            'give base = "spec.toml" (a run spec to vary) or script = "job.slurm" (a batch'
            " script whose environment varies, with a [launcher] table), relative to the"
            " campaign file.",
        ),
        (
            'base = "s.toml"\n[launcher]\nnodes = 1',
            "launcher",
            'only a campaign over a batch script (script = "job.slurm") has a [launcher]',
        ),
        ('script = ""', "script", "give script as a non-empty string"),
        (
            'script = "j"',
            "launcher.nodes",
            "a script campaign needs launcher.nodes (the nodes of each job) and"
            " launcher.concurrency_env (the variable of its concurrencies, e.g."
            ' "BENCH_MAX_CONCURRENCY").',
        ),
        ('script = "j"\nlauncher = 3', "launcher", "use a table [launcher]"),
    ],
)
def test_base_or_script(text: str, field: str, fragment: str) -> None:
    with pytest.raises(CampaignError) as err:
        parse_campaign(text, default_name="c")
    assert err.value.field == field
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("launcher", "rest", "field", "fragment"),
    [
        (
            MINIMAL + '\nworkdir = "x"',
            "",
            "launcher.workdir",
            "unknown key; allowed: chdir, log_dir, logs, marker, marker_format, results,"
            " job_name_prefix, sbatch_args, prefill_gpus, decode_gpus, nodes, gpus_per_node,"
            " concurrency_env, concurrency_separator, concurrencies, topology_env, env.",
        ),
        ('concurrency_env = "C"', "", "launcher.nodes", "a script campaign needs"),
        ("nodes = 1", "", "launcher.concurrency_env", "a script campaign needs"),
        ('nodes = 0\nconcurrency_env = "C"', "", "launcher.nodes", "use an integer from 1 to"),
        ('nodes = true\nconcurrency_env = "C"', "", "launcher.nodes", "use an integer"),
        (
            MINIMAL + "\ngpus_per_node = 65",
            "",
            "launcher.gpus_per_node",
            "use an integer from 0 to 64",
        ),
        ('nodes = 1\nconcurrency_env = "1X"', "", "launcher.concurrency_env", "shell variable"),
        (
            'nodes = 1\nconcurrency_env = "SLURM_CONC"',
            "",
            "launcher.concurrency_env",
            "submit --script never exports this variable",
        ),
        (
            MINIMAL + '\nconcurrency_separator = "1"',
            "",
            "launcher.concurrency_separator",
            'no digits, e.g. "x" (InferenceX: 1x4x16)',
        ),
        (MINIMAL.replace("[1, 2]", "[1, 1]"), "", "launcher.concurrencies", "duplicate"),
        (MINIMAL.replace("[1, 2]", "[]"), "", "launcher.concurrencies", "at least one"),
        (MINIMAL.replace("[1, 2]", "[0]"), "", "launcher.concurrencies", "from 1 to 100000"),
        (
            MINIMAL,
            "[launcher.env]\nLD_PRELOAD = '/x.so'",
            "launcher.env.LD_PRELOAD",
            "submit --script never exports this variable (it would change what sbatch"
            " executes or how it names, places or exports the job); set it in the script.",
        ),
        (MINIMAL, "[launcher.env]\nBASH_ENV = 'x'", "launcher.env.BASH_ENV", "never exports"),
        (MINIMAL, "[launcher.env]\nSLURM_X = '1'", "launcher.env.SLURM_X", "never exports"),
        (
            MINIMAL,
            "[launcher.env]\nSBATCH_PARTITION = 'gpu'",
            "launcher.env.SBATCH_PARTITION",
            "sbatch reads SBATCH_* as its own options; give them in launcher.sbatch_args",
        ),
        (MINIMAL, "[launcher.env]\n'A-B' = '1'", "launcher.env.A-B", "use a shell variable"),
        (
            MINIMAL,
            "[launcher.env]\nCONC = '1x2'",
            "launcher.env.CONC",
            "it carries a job's concurrencies (launcher.concurrency_env)",
        ),
        (
            MINIMAL,
            "[launcher.env]\nX = [1, 2]",
            "launcher.env.X",
            "give a string (at most 32768 bytes, no NUL), an integer, a float or a boolean",
        ),
        (MINIMAL, '[launcher.env]\nX = "a\\u0000b"', "launcher.env.X", "no NUL"),
        (
            MINIMAL + '\nsbatch_args = ["--nodes=2"]',
            "",
            "launcher.sbatch_args",
            "set launcher.nodes instead: the daemon passes it to sbatch as --nodes",
        ),
        (MINIMAL + '\nsbatch_args = ["-N", "2"]', "", "launcher.sbatch_args", "launcher.nodes"),
        (
            MINIMAL + '\nsbatch_args = ["--job-name=x"]',
            "",
            "launcher.sbatch_args",
            "--job-name is not allowed: the daemon names the job (use --job-name-prefix)",
        ),
        (
            MINIMAL + '\nsbatch_args = ["--export=ALL"]',
            "",
            "launcher.sbatch_args",
            "--export is not allowed",
        ),
        (MINIMAL + '\nsbatch_args = "--time=5"', "", "launcher.sbatch_args", "a list of"),
        (
            MINIMAL + '\nlogs = ["../x.log"]',
            "",
            "launcher.logs",
            "use a pattern relative to --log-dir without '.', '..' or '//'",
        ),
        (MINIMAL + '\nresults = ["*/c.json"]', "", "launcher.results", "only in the last part"),
        (MINIMAL + '\nmarker = "done.*"', "", "launcher.marker", "name one file (no wildcards)"),
        (
            MINIMAL + '\nmarker_format = "text"',
            "",
            "launcher.marker_format",
            "use json (this project's protocol), int (the rc and a newline, InferenceX) or none",
        ),
        (MINIMAL + '\njob_name_prefix = "a b"', "", "launcher.job_name_prefix", "use 1-64"),
        (
            MINIMAL + "\nprefill_gpus = 8",
            "",
            "launcher.decode_gpus",
            "give both --prefill-gpus and --decode-gpus",
        ),
        (
            MINIMAL + '\ntopology_env = ["PREFILL_NODES"]',
            "",
            "launcher.topology_env",
            "neither [launcher.env] nor a matrix key (env.PREFILL_NODES) sets it",
        ),
        (
            MINIMAL,
            '[matrix]\n"benchmark.isl_osl" = [[1, 2]]',
            "matrix.benchmark.isl_osl",
            "not a key a script campaign can set; use one of: env.<NAME>; launcher.nodes;"
            " launcher.gpus_per_node; launcher.concurrencies.",
        ),
        (MINIMAL, '[matrix]\n"launcher.chdir" = ["a"]', "matrix.launcher.chdir", "not a key"),
        (
            MINIMAL,
            '[matrix]\n"env.LD_PRELOAD" = ["/x.so"]',
            "matrix.env.LD_PRELOAD",
            "never exports this variable",
        ),
        (MINIMAL, '[matrix]\n"env.CONC" = ["1"]', "matrix.env.CONC", "carries a job's"),
        (
            MINIMAL,
            '[[zip]]\n"env.A" = ["1", "2"]\n"launcher.nodes" = [1]',
            "zip[0]",
            "their lists need equal lengths (env.A has 2, launcher.nodes has 1)",
        ),
        (
            MINIMAL,
            '[matrix]\n"env.A" = ["1"]\n[[exclude]]\n"env.B" = "1"',
            "exclude[0].env.B",
            "env.B is not a [matrix] or [[zip]] key, so no point could match",
        ),
        (MINIMAL, '[[include]]\n"launcher.log_dir" = "x"', "include[0].launcher.log_dir", "not"),
    ],
)
def test_launcher_errors_name_the_field_and_the_fix(
    launcher: str, rest: str, field: str, fragment: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _script_campaign(launcher, rest)
    assert err.value.field == field
    assert err.value.point is None
    assert fragment in str(err.value), str(err.value)
    assert isinstance(err.value, SpecError)


# --- expansion ----------------------------------------------------------------------------


def test_the_inferencex_sweep_gives_four_jobs_of_three_points() -> None:
    e = _expand(parse_campaign(IX, default_name="x"))
    assert (len(e.jobs), e.points, e.merged_points) == (4, 12, 0)
    assert [(j.topology, j.nodes, j.gpus, j.concurrencies) for j in e.jobs] == [
        ("2N/8gpn/PREFILL_NODES=1", 2, 16, (1, 4, 16)),
        ("3N/8gpn/PREFILL_NODES=2", 3, 24, (1, 4, 16)),
        ("2N/8gpn/PREFILL_NODES=1", 2, 16, (1, 4, 16)),
        ("3N/8gpn/PREFILL_NODES=2", 3, 24, (1, 4, 16)),
    ]
    # The command line's --time wins over the script's #SBATCH --time.
    assert {j.time_limit_s for j in e.jobs} == {3600}
    assert e.gpu_hours_upper_bound == pytest.approx((16 + 24 + 16 + 24) * 3600 / 3600)
    first = e.jobs[0]
    assert first.key == first.recipe_id[:12] and first.workload == 0
    assert first.values == (
        ("env.BENCH_INPUT_LEN", 1024),
        ("env.PREFILL_NODES", 1),
        ("launcher.nodes", 2),
    )
    job = first.script_job
    assert job is not None
    assert job.env_of((16, 1, 4)) == {
        "MODEL_NAME": "deepseek-ai/DeepSeek-R1",
        "BENCH_REQUEST_RATE": "inf",
        "RUN_EVAL": "false",
        "BENCH_RANDOM_RANGE_RATIO": "0.8",
        "BENCH_INPUT_LEN": "1024",
        "PREFILL_NODES": "1",
        "BENCH_MAX_CONCURRENCY": "1x4x16",  # ascending, InferenceX's separator
    }
    # Paths are the campaign file's; sbatch gets the point's nodes before the user's options.
    assert (job.chdir, job.log_dir) == (f"{DIR}/run", f"{DIR}/run")
    assert job.sbatch_args == ("--nodes=2", "--partition=gpu", "--time=01:00:00", "--gres=gpu:8")
    assert job.script_sha256 == hashlib.sha256(SCRIPT.encode()).hexdigest()
    # The journal keeps it as JSON, and reads back the same job.
    text = job_text(first)
    assert is_script_job(text) and ScriptJob.from_json(text) == job
    assert not is_script_job("[run]\nlog_dir = '/x'\n")  # a run spec's TOML


def test_a_jobs_run_is_a_submit_script_spec_with_its_environment() -> None:
    job = _expand(parse_campaign(IX, default_name="x")).jobs[1].script_job
    assert job is not None
    client = {"PATH": "/usr/bin", "HOME": "/home/me", "BENCH_MAX_CONCURRENCY": "999"}
    spec = foreign_spec.load(job.foreign_json(SCRIPT, client, [4, 16]))
    assert spec.kind == "script" and spec.script == SCRIPT and spec.script_name == "job.slurm"
    assert spec.env is not None
    assert spec.env["PATH"] == "/usr/bin"  # the environment it is submitted from
    assert spec.env["PREFILL_NODES"] == "2"  # the point's over it
    assert spec.env["BENCH_MAX_CONCURRENCY"] == "4x16"  # only the points still to run
    assert spec.sbatch_options("ix-r1")[:3] == [
        "--job-name=ix-r1",
        f"--chdir={DIR}/run",
        "--nodes=3",
    ]
    assert spec.job_name("r1") == "ix-r1"
    assert spec.watch.marker_format is foreign_spec.MarkerFormat.INT
    assert spec.watch.log_dir == f"{DIR}/run"
    with pytest.raises(ValueError, match="the campaign's script has sha256"):
        job.foreign_json(SCRIPT + "# changed\n", {}, [4])


def test_a_custom_separator_and_paths() -> None:
    c = _script_campaign(
        MINIMAL + '\nconcurrency_separator = ","\nchdir = "/abs/run"\nlog_dir = "../logs"'
    )
    job = _expand(c).jobs[0].script_job
    assert job is not None
    assert job.env_of([2, 1]) == {"CONC": "1,2"}
    assert (job.chdir, job.log_dir) == ("/abs/run", "/home/me/logs")


@pytest.mark.parametrize(
    ("rest", "field", "point", "fragment"),
    [
        (
            '[matrix]\n"launcher.nodes" = [2, 0]',
            "launcher.nodes",
            (("launcher.nodes", 0),),
            "Campaign file field 'launcher.nodes' at point {launcher.nodes = 0}: Launcher"
            " field 'launcher.nodes' has invalid value 0: use an integer from 1 to 1024.",
        ),
        (
            '[matrix]\n"env.A" = ["x", {b = 1}]',
            "env.A",
            (("env.A", {"b": 1}),),
            "give a string (at most 32768 bytes, no NUL), an integer, a float or a boolean",
        ),
        (
            '[[include]]\n"launcher.concurrencies" = 4',  # an include gives one value
            "launcher.concurrencies",
            (("launcher.concurrencies", 4),),
            "has invalid value 4: list at least one concurrency, e.g. [1, 4, 16]",
        ),
        (
            '[matrix]\n"launcher.gpus_per_node" = [8, -1]',
            "launcher.gpus_per_node",
            (("launcher.gpus_per_node", -1),),
            "use an integer from 0 to 64",
        ),
    ],
)
def test_an_invalid_point_names_its_values_and_field(
    rest: str, field: str, point: tuple[tuple[str, object], ...], fragment: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _expand(_script_campaign(MINIMAL, rest))
    assert err.value.field == field
    assert err.value.point == point
    assert fragment in str(err.value), str(err.value)


def test_concurrencies_missing_everywhere_are_named() -> None:
    with pytest.raises(CampaignError) as err:
        _expand(_script_campaign('nodes = 1\nconcurrency_env = "C"', '[matrix]\n"env.A" = [1]'))
    assert err.value.field == "launcher.concurrencies"
    assert err.value.point == (("env.A", 1),)
    assert "give launcher.concurrencies = [...] or vary launcher.concurrencies" in str(err.value)


def test_concurrencies_from_the_matrix_merge_into_one_job_per_recipe() -> None:
    e = _expand(
        _script_campaign(
            'nodes = 1\nconcurrency_env = "C"',
            '[matrix]\n"launcher.concurrencies" = [[1, 2], [2, 4], [2, 1]]\n'
            '"env.PARTITION_HINT" = ["a"]',
        )
    )
    assert len(e.jobs) == 1 and e.jobs[0].concurrencies == (1, 2, 4)
    assert len(e.duplicates) == 1  # [2, 1] repeats [1, 2]
    assert (e.points_before_merge, e.points, e.merged_points) == (6, 3, 3)


def test_too_many_points_are_refused() -> None:
    c = _script_campaign(MINIMAL, '[matrix]\n"env.A" = [1, 2, 3]')
    assert _expand(c, max_points=6).points == 6
    with pytest.raises(CampaignError, match="expands to at least 6 points"):
        _expand(c, max_points=5)


@pytest.mark.parametrize(
    ("script", "field", "fragment"),
    [
        ("echo hi\n", "script", "a batch script starts with '#!'"),
        ("#!/bin/bash\n#SBATCH --wait\nsrun x\n", "script", "--wait in a #SBATCH line"),
    ],
)
def test_the_script_is_checked_as_submit_script_checks_it(
    script: str, field: str, fragment: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _expand(_script_campaign(MINIMAL), script)
    assert err.value.field == field
    assert fragment in str(err.value)


def test_the_campaign_directory_must_be_absolute_and_kinds_do_not_mix() -> None:
    c = _script_campaign(MINIMAL)
    with pytest.raises(CampaignError, match="absolute path"):
        expand_script(c, SCRIPT, script_name="j", campaign_dir="rel")
    with pytest.raises(ValueError, match="use expand_script"):
        expand(c, {})
    spec_campaign = parse_campaign('base = "b.toml"', default_name="b")
    with pytest.raises(ValueError, match="use expand"):
        expand_script(spec_campaign, SCRIPT, script_name="j", campaign_dir=DIR)
    with pytest.raises(ValueError, match="runs a batch script"):
        job_spec(_expand(c).jobs[0], [1])


# --- recipe id ----------------------------------------------------------------------------


def _rid(launcher: str = MINIMAL, rest: str = "", script: str = SCRIPT) -> str:
    jobs = _expand(_script_campaign(launcher, rest), script).jobs
    assert len(jobs) == 1
    return jobs[0].recipe_id


BASE_RID_ARGS = MINIMAL + '\nsbatch_args = ["--partition=a", "--gres=gpu:8"]'


@pytest.mark.parametrize(
    ("launcher", "rest"),
    [
        (BASE_RID_ARGS.replace("[1, 2]", "[8, 16]"), ""),  # concurrencies
        (BASE_RID_ARGS.replace("--partition=a", "--partition=b"), ""),
        (BASE_RID_ARGS + '\nchdir = "elsewhere"\nlog_dir = "/tmp/x"', ""),
        (BASE_RID_ARGS + '\njob_name_prefix = "other"\nmarker = "m"\nlogs = ["*.log"]', ""),
        (
            BASE_RID_ARGS.replace(
                '"--gres=gpu:8"',
                '"--gres=gpu:8", "-A", "team", "--qos=high", "-t", "5", "--output=o",'
                ' "-e", "e", "--time=10", "--acc=x"',
            ),
            "",
        ),
        (BASE_RID_ARGS.replace('concurrency_env = "CONC"', 'concurrency_env = "OTHER"'), ""),
        (BASE_RID_ARGS + '\ntopology_env = ["A"]', "[launcher.env]\nA = '1'"),
    ],
)
def test_recipe_id_ignores_where_how_long_and_what_concurrencies(launcher: str, rest: str) -> None:
    same = _rid(BASE_RID_ARGS, "[launcher.env]\nA = '1'" if "topology_env" in launcher else "")
    assert _rid(launcher, rest) == same


@pytest.mark.parametrize(
    ("launcher", "rest", "script"),
    [
        (BASE_RID_ARGS, "", SCRIPT + "# one more line\n"),
        (BASE_RID_ARGS.replace("nodes = 1", "nodes = 2"), "", SCRIPT),
        (BASE_RID_ARGS + "\ngpus_per_node = 8", "", SCRIPT),
        (BASE_RID_ARGS.replace("gpu:8", "gpu:4"), "", SCRIPT),
        (BASE_RID_ARGS + "\nprefill_gpus = 8\ndecode_gpus = 8", "", SCRIPT),
        (BASE_RID_ARGS, "[launcher.env]\nMODEL = 'a'", SCRIPT),
    ],
)
def test_recipe_id_changes_with_the_configuration(launcher: str, rest: str, script: str) -> None:
    assert _rid(launcher, rest, script) != _rid(BASE_RID_ARGS)


def test_recipe_id_sees_values_as_the_script_does() -> None:
    # 1 and "1" reach the script as the same text: one configuration.
    assert _rid(MINIMAL, "[launcher.env]\nA = 1") == _rid(MINIMAL, "[launcher.env]\nA = '1'")
    assert _rid(MINIMAL, "[launcher.env]\nA = 1") != _rid(MINIMAL, "[launcher.env]\nA = 1.0")
    assert _rid(MINIMAL, "[launcher.env]\nA = true") == _rid(MINIMAL, "[launcher.env]\nA = 'true'")


def test_recipe_ids_are_versioned_canonical_json() -> None:
    c = _script_campaign(MINIMAL)
    rid = _rid()
    assert len(rid) == 64
    doc = {
        "schema": 1,
        "kind": "script",
        "script_sha256": hashlib.sha256(SCRIPT.encode()).hexdigest(),
        "env": {},
        "nodes": 1,
        "gpus_per_node": 0,
        "prefill_gpus": None,
        "decode_gpus": None,
        "sbatch_args": [],
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    assert rid == hashlib.sha256(canonical.encode()).hexdigest()
    assert c.launcher is not None


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        (["--partition=gpu", "-pgpu", "--job-name=x", "-Jx"], []),
        (["--account=a", "-Aa", "--qos=q", "-qq", "--time=5", "-t5"], []),
        (["--output=o", "-oo", "--error=e", "-ee", "--part=gpu", "--time-min=5"], ["--time-min=5"]),
        (
            ["--gres=gpu:8", "--exclusive", "--constraint=h100"],
            ["--gres=gpu:8", "--exclusive", "--constraint=h100"],
        ),
    ],
)
def test_recipe_sbatch_args(args: list[str], kept: list[str]) -> None:
    assert recipe_sbatch_args(args) == kept


@pytest.mark.parametrize(
    ("args", "script", "seconds"),
    [
        ((), SCRIPT, 1800),
        (("--time=01:00:00",), SCRIPT, 3600),
        (("-t10",), SCRIPT, 600),
        ((), "#!/bin/bash\n#SBATCH -t 2-00\n", 2 * 86400),
        ((), "#!/bin/bash\n#SBATCH --time 45\n", 2700),
        ((), "#!/bin/bash\necho\n#SBATCH --time=45\n", 0),  # after a command: not read
        ((), "#!/bin/bash\n", 0),
        (("--time=UNLIMITED",), SCRIPT, 0),
    ],
)
def test_time_limit_of(args: tuple[str, ...], script: str, seconds: int) -> None:
    assert time_limit_of(args, script) == seconds


def test_a_journaled_job_of_another_version_is_refused() -> None:
    job = _expand(_script_campaign(MINIMAL)).jobs[0].script_job
    assert job is not None
    doc = json.loads(job.to_json())
    doc["script_job"]["v"] = 2
    with pytest.raises(SpecError, match="not a script campaign's job"):
        ScriptJob.from_json(json.dumps(doc))
    with pytest.raises(SpecError, match="not a script campaign's job"):
        ScriptJob.from_json("{}")


# --- a script run's archive proves its points -----------------------------------------------


def _point(concurrency: int) -> Point:
    return Point("vllm", concurrency, 8, 8, 0, 1.0, 8.0, 64.0, 1088.0, 1024, 64)


def test_a_script_runs_nested_result_files_prove_points_and_duplicates_prove_nothing(
    tmp_path: Path,
) -> None:
    # As a --script run archives them: results/<path below the log directory>.
    parsed: dict[str, Point | ResultProblem] = {
        "results/results/77/ix_c4.json": _point(4),
        "results/results/77/ix_c8.json": _point(8),
        "results/results/a_c16.json": _point(16),  # two files for c=16: whose is it?
        "results/results/b_c16.json": _point(16),
    }
    for name in parsed:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"the result file {name}")
    (tmp_path / "results.json").write_text(json.dumps(foreign_table(BenchFiles(parsed=parsed))))
    proofs = verified_of(
        tmp_path,
        recipe_id="r" * 64,
        concurrencies=[4, 8, 16],
        run_id="run1",
        campaign_id="c1",
        now=datetime.now(UTC),
    )
    assert [(p.concurrency, p.result_file) for p in proofs] == [
        (4, "results/results/77/ix_c4.json"),
        (8, "results/results/77/ix_c8.json"),
    ]
    first = tmp_path / proofs[0].result_file
    assert proofs[0].sha256 == hashlib.sha256(first.read_bytes()).hexdigest()
    assert still_good(proofs, {"run1": tmp_path}) == [True, True]
    first.write_text("edited by hand")
    assert still_good(proofs, {"run1": tmp_path}) == [False, True]


def test_env_placeholders_give_each_job_its_own_patterns() -> None:
    c = _script_campaign(
        MINIMAL + '\nresults = ["logs/{env.NAME}_c*.json"]\nlogs = ["{env.NAME}/{job_id}.log"]',
        '[matrix]\n"env.NAME" = ["isl1k", "isl8k"]',
    )
    jobs = [j.script_job for j in _expand(c).jobs]
    assert [(j.results, j.logs) for j in jobs if j is not None] == [
        (("logs/isl1k_c*.json",), ("isl1k/{job_id}.log",)),
        (("logs/isl8k_c*.json",), ("isl8k/{job_id}.log",)),
    ]


@pytest.mark.parametrize(
    ("launcher", "rest", "field", "point", "fragment"),
    [
        (
            MINIMAL + '\nresults = ["{env.NAME}_c*.json"]',
            '[matrix]\n"env.OTHER" = ["a"]',
            "launcher.results",
            (("env.OTHER", "a"),),
            "the job has no variable NAME; set it in [launcher.env] or the matrix",
        ),
        (
            MINIMAL + '\nresults = ["{env.NAME}_c*.json"]',
            '[matrix]\n"env.NAME" = ["../up"]',
            "launcher.results",
            (("env.NAME", "../up"),),
            "with the job's variables it is '../up_c*.json': use a pattern relative",
        ),
    ],
)
def test_env_placeholders_are_checked_with_each_jobs_values(
    launcher: str, rest: str, field: str, point: tuple[tuple[str, object], ...], fragment: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _expand(_script_campaign(launcher, rest))
    assert (err.value.field, err.value.point) == (field, point)
    assert fragment in str(err.value), str(err.value)


def test_an_env_placeholder_names_a_variable() -> None:
    with pytest.raises(CampaignError, match=r"\{env\.1A\} does not name a variable"):
        _script_campaign(MINIMAL + '\nresults = ["{env.1A}.json"]')
