"""Campaign files and their expansion over the demo spec (core.campaign.expand)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import pytest

from llmd_supervisor.core.campaign.expand import (
    ISL_OSL,
    RECIPE_ID_SCHEMA,
    Axis,
    CampaignFile,
    CampaignLimits,
    Expansion,
    PointLimit,
    combinations,
    expand,
    job_spec,
    parse_campaign,
    recipe_id,
)
from llmd_supervisor.core.spec.recipe import recipe_fingerprint
from llmd_supervisor.core.spec.runspec import load_spec, parse_spec
from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.core.spec.toml_write import dump_toml
from llmd_supervisor.errors import CampaignError, ExpansionStopped, SpecError

DEMO_TEXT = (Path(__file__).resolve().parents[2] / "deploy/llm-d/demo.toml").read_text()
DEMO = decode_toml(DEMO_TEXT)

# The demo has 2 prefill workers, so its prefill node counts are even.
SWEEP = """
name = "demo-sweep"
base = "demo.toml"
cluster = "dev"
[limits]
max_jobs = 2
max_nodes = 12
[matrix]
"topology.prefill_nodes" = [2, 4]
"benchmark.isl_osl" = [[64, 16], [128, 32]]
"benchmark.concurrencies" = [[1, 2, 4]]
"""


def _campaign(text: str) -> CampaignFile:
    return parse_campaign('base = "demo.toml"\n' + text, default_name="sweep")


def _expand(text: str, *, max_points: int = 10_000) -> Expansion:
    return expand(_campaign(text), DEMO, max_points=max_points)


def _table(data: Mapping[str, object], name: str) -> Mapping[str, object]:
    table = data[name]
    assert isinstance(table, Mapping)
    return table


def _with(table: str, key: str, value: object) -> dict[str, object]:
    """The demo spec with one value changed."""
    data = copy.deepcopy(DEMO)
    t = data[table]
    assert isinstance(t, dict)
    t[key] = value
    return data


# --- parsing ------------------------------------------------------------------------------


def test_the_sweep_parses() -> None:
    c = parse_campaign(SWEEP, default_name="ignored")
    assert c.name == "demo-sweep"
    assert c.base == "demo.toml"
    assert c.cluster == "dev"
    assert c.limits == CampaignLimits(max_jobs=2, max_nodes=12)
    assert c.limits.pending_cap == 2
    assert c.axes == (
        Axis(("topology.prefill_nodes",), ((2,), (4,))),
        Axis((ISL_OSL,), (([64, 16],), ([128, 32],))),
        Axis(("benchmark.concurrencies",), (([1, 2, 4],),)),
    )
    assert c.excludes == ()
    assert c.includes == ()


def test_defaults() -> None:
    c = parse_campaign('base = "/abs/base.toml"', default_name="from-stem")
    assert c.name == "from-stem"
    assert c.cluster is None
    assert c.limits == CampaignLimits()
    assert (c.limits.max_jobs, c.limits.pending_cap, c.limits.canary_stop_fraction) == (4, 4, 0.5)
    assert c.axes == ()


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        (
            'base = "d.toml"\nbogus = 1',
            "bogus",
            "Campaign file field 'bogus' has invalid value 1: unknown key; allowed at the top"
            " level: name, base, script, cluster, limits, launcher, matrix, zip, exclude,"
            " include, notify.",
        ),
        ("name = 'x'", "base", 'give base = "spec.toml" (a run spec to vary) or script ='),
        ('base = ""', "base", "give base as a non-empty string"),
        ('base = "d.toml"\nname = "a b"', "name", "use 1 to 64 letters, digits and . _ -"),
        ('base = "d.toml"\nname = ".."', "name", "not '.' or '..'"),
        ('base = "d.toml"\ncluster = "x;y"', "cluster", "use 1 to 64 letters"),
        (
            'base = "d.toml"\n[limits]\nmax_job = 2',
            "limits.max_job",
            "unknown key; allowed: max_jobs, max_pending, max_nodes, max_gpus,"
            " canary_stop_fraction",
        ),
        (
            'base = "d.toml"\n[limits]\nmax_jobs = 0',
            "limits.max_jobs",
            "has invalid value 0: use an integer from 1 to 1000",
        ),
        (
            'base = "d.toml"\n[limits]\nmax_pending = true',
            "limits.max_pending",
            "use an integer from 1 to 1000",
        ),
        (
            'base = "d.toml"\n[limits]\ncanary_stop_fraction = 1.5',
            "limits.canary_stop_fraction",
            "use a share from 0 (stop at the first failed canary) to 1 (never stop)",
        ),
        (
            'base = "d.toml"\n[matrix]\n"topology.prefil_nodes" = [1]',
            "matrix.topology.prefil_nodes",
            "has invalid value 'topology.prefil_nodes': not a run spec field a campaign can"
            " set; use one of: run.{name,sigterm_grace_s,marker_grace_s,coordinator_silence_s};"
            " topology.{prefill_nodes,decode_nodes,",
        ),
        (
            'base = "d.toml"\n[matrix]\n"env.common" = [{A = "1"}]',
            "matrix.env.common",
            "env.{common,prefill,decode,bench}.<NAME>",
        ),
        (
            'base = "d.toml"\n[matrix]\n"run.log_dir" = ["/a", "/b"]',
            "matrix.run.log_dir",
            "run.log_dir cannot vary: every run of a campaign writes under the base spec's log dir",
        ),
        (
            'base = "d.toml"\n[matrix]\n"topology.prefill_nodes" = []',
            "matrix.topology.prefill_nodes",
            "has invalid value []: give a non-empty list of values",
        ),
        (
            'base = "d.toml"\n[matrix]\n"topology.prefill_nodes" = 2',
            "matrix.topology.prefill_nodes",
            "give a non-empty list of values",
        ),
        (
            'base = "d.toml"\n[matrix]\n"benchmark.isl_osl" = [[1024, 128, 5]]',
            "matrix.benchmark.isl_osl",
            "has invalid value [1024, 128, 5]: give benchmark.isl_osl as"
            " [input_len, output_len], e.g. [1024, 128]",
        ),
        (
            'base = "d.toml"\n[matrix]\n"benchmark.isl_osl" = [1024, 128]',
            "matrix.benchmark.isl_osl",
            "has invalid value 1024: give benchmark.isl_osl as [input_len, output_len]",
        ),
        (
            'base = "d.toml"\n[[zip]]\n"benchmark.input_len" = [64, 128]\n'
            '"benchmark.output_len" = [16]',
            "zip[0]",
            "the keys of a zip vary together, so their lists need equal lengths"
            " (benchmark.input_len has 2, benchmark.output_len has 1)",
        ),
        (
            'base = "d.toml"\n[matrix]\n"benchmark.isl_osl" = [[64, 16]]\n'
            '[[zip]]\n"benchmark.input_len" = [64, 128]',
            "benchmark.input_len",
            "benchmark.isl_osl already sets benchmark.input_len",
        ),
        (
            'base = "d.toml"\n[matrix]\n"topology.prefill_nodes" = [2]\n'
            '[[exclude]]\n"topology.decode_nodes" = 2',
            "exclude[0].topology.decode_nodes",
            "topology.decode_nodes is not a [matrix] or [[zip]] key, so no point could match;"
            " the keys are: topology.prefill_nodes",
        ),
        (
            'base = "d.toml"\n[[exclude]]\n"topology.nodes" = 2',
            "exclude[0].topology.nodes",
            "not a run spec field a campaign can set",
        ),
        (
            'base = "d.toml"\n[[include]]\n"topolgy.prefill_nodes" = 2',
            "include[0].topolgy.prefill_nodes",
            "not a run spec field a campaign can set",
        ),
        (
            'base = "d.toml"\n[[include]]\n"run.log_dir" = "/x"',
            "include[0].run.log_dir",
            "run.log_dir cannot vary",
        ),
        ('base = "d.toml"\n[[exclude]]', "exclude[0]", "an empty exclude would drop every point"),
        ('base = "d.toml"\nmatrix = 3', "matrix", "use a table [matrix]"),
        ('base = "d.toml"\nzip = 3', "zip", "use [[zip]] tables"),
        ('base = "d.toml\n', "<toml>", "the file is not valid TOML"),
    ],
)
def test_parse_errors(text: str, field: str, fragment: str) -> None:
    with pytest.raises(CampaignError) as err:
        parse_campaign(text, default_name="sweep")
    assert err.value.field == field
    assert str(err.value).startswith("Campaign file field ")
    assert fragment in str(err.value)
    assert err.value.point is None
    assert isinstance(err.value, SpecError)


def test_an_invalid_default_name_asks_for_a_name() -> None:
    with pytest.raises(CampaignError, match=r'e\.g\. name = "demo-sweep"'):
        parse_campaign('base = "d.toml"', default_name="my sweep")


# --- expansion ----------------------------------------------------------------------------


def test_two_topologies_by_two_lengths_give_four_jobs_of_three_points() -> None:
    e = expand(parse_campaign(SWEEP, default_name="x"), DEMO)
    assert len(e.variants) == 4
    assert len(e.jobs) == 4
    assert e.points == e.points_before_merge == 12
    assert e.merged_points == 0
    assert e.duplicates == ()
    assert [(j.topology, j.workload, j.concurrencies) for j in e.jobs] == [
        ("2P+2D/2x1w/8gpn", 80, (1, 2, 4)),
        ("2P+2D/2x1w/8gpn", 160, (1, 2, 4)),
        ("4P+2D/2x1w/8gpn", 80, (1, 2, 4)),
        ("4P+2D/2x1w/8gpn", 160, (1, 2, 4)),
    ]
    assert [(j.nodes, j.gpus, j.time_limit_s) for j in e.jobs] == [
        (4, 32, 300),
        (4, 32, 300),
        (6, 48, 300),
        (6, 48, 300),
    ]
    # Each job: its counted GPUs for its whole 5-minute limit.
    assert e.gpu_hours_upper_bound == pytest.approx((32 + 32 + 48 + 48) * 300 / 3600)
    assert e.node_hours_upper_bound == pytest.approx((4 + 4 + 6 + 6) * 300 / 3600)
    first = e.jobs[0]
    assert first.key == first.recipe_id[:12]
    assert first.values == (
        ("topology.prefill_nodes", 2),
        (ISL_OSL, [64, 16]),
        ("benchmark.concurrencies", [1, 2, 4]),
    )
    spec = parse_spec(first.spec_data)
    assert (spec.benchmark.input_len, spec.benchmark.output_len) == (64, 16)
    assert spec.topology.prefill_nodes == 2
    assert spec.log_dir == "/var/tmp/llmd-runs/demo"
    # The job's dict survives being written as TOML for the daemon.
    assert load_spec(dump_toml(first.spec_data)) == spec
    # The base is never changed in place.
    assert decode_toml(DEMO_TEXT) == DEMO


def test_job_order_is_the_file_order_and_deterministic() -> None:
    one = expand(parse_campaign(SWEEP, default_name="x"), DEMO)
    two = expand(parse_campaign(SWEEP, default_name="x"), copy.deepcopy(DEMO))
    assert [j.key for j in one.jobs] == [j.key for j in two.jobs]
    # The last key varies fastest; zips come after the matrix keys.
    e = _expand(
        '[matrix]\n"topology.prefill_nodes" = [4, 2]\n'
        '[[zip]]\n"benchmark.input_len" = [64, 128]\n"benchmark.output_len" = [16, 32]\n'
    )
    assert [v.values for v in e.variants] == [
        (
            ("topology.prefill_nodes", 4),
            ("benchmark.input_len", 64),
            ("benchmark.output_len", 16),
        ),
        (
            ("topology.prefill_nodes", 4),
            ("benchmark.input_len", 128),
            ("benchmark.output_len", 32),
        ),
        (
            ("topology.prefill_nodes", 2),
            ("benchmark.input_len", 64),
            ("benchmark.output_len", 16),
        ),
        (
            ("topology.prefill_nodes", 2),
            ("benchmark.input_len", 128),
            ("benchmark.output_len", 32),
        ),
    ]


def test_excludes_drop_matching_points_and_includes_add_points_last() -> None:
    c = parse_campaign(
        SWEEP
        + '[[exclude]]\n"topology.prefill_nodes" = 4\n"benchmark.isl_osl" = [128, 32]\n'
        + '[[include]]\n"topology.prefill_nodes" = 6\n"benchmark.input_len" = 256\n',
        default_name="x",
    )
    e = expand(c, DEMO)
    assert [(j.topology, j.workload) for j in e.jobs] == [
        ("2P+2D/2x1w/8gpn", 80),
        ("2P+2D/2x1w/8gpn", 160),
        ("4P+2D/2x1w/8gpn", 80),
        ("6P+2D/2x1w/8gpn", 256 + 16),  # the include: over the base (concurrencies 1,2,4)
    ]
    assert e.jobs[-1].values == (("topology.prefill_nodes", 6), ("benchmark.input_len", 256))
    assert e.points == 12


def test_an_exclude_compares_toml_values_exactly() -> None:
    # 4.0 is not 4: nothing is dropped.
    e = _expand(
        '[matrix]\n"topology.prefill_nodes" = [2, 4]\n[[exclude]]\n"topology.prefill_nodes" = 4.0\n'
    )
    assert len(e.jobs) == 2


def test_duplicates_are_merged_and_counted() -> None:
    # The partition does not change the recipe: [a] and [b] are one configuration.
    e = expand(
        _campaign(
            '[matrix]\n"slurm.partition" = ["a", "b"]\n'
            '"benchmark.concurrencies" = [[1, 2], [2, 4], [2, 1]]\n'
        ),
        DEMO,
    )
    assert len(e.jobs) == 1
    job = e.jobs[0]
    assert job.concurrencies == (1, 2, 4)
    assert job.spec_data["slurm"] == {"time_limit": "00:05:00", "requeue": False, "partition": "a"}
    # [1,2] (a), [2,4] (a) are variants; [2,1] (a) and all of (b) repeat them.
    assert [v.values for v in e.variants] == [
        (("slurm.partition", "a"), ("benchmark.concurrencies", [1, 2])),
        (("slurm.partition", "a"), ("benchmark.concurrencies", [2, 4])),
    ]
    assert len(e.duplicates) == 4
    assert e.duplicates[0].values == (
        ("slurm.partition", "a"),
        ("benchmark.concurrencies", [2, 1]),
    )
    assert e.duplicates[0].same_as == e.variants[0].values
    assert e.points_before_merge == 12
    assert e.points == 3
    assert e.merged_points == 9  # "9 duplicate points merged"


def test_env_and_validity_keys_create_tables() -> None:
    e = _expand(
        '[matrix]\n"env.bench.LLMD_FAKE_BENCH_FAIL_CONCURRENCY" = ["2", "4"]\n'
        '"benchmark.validity.min_output_tokens" = [1]\n'
    )
    jobs = e.jobs
    assert [_table(_table(j.spec_data, "env"), "bench") for j in jobs] == [
        {"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "2"},
        {"LLMD_FAKE_BENCH_FAIL_CONCURRENCY": "4"},
    ]
    assert jobs[0].recipe_id != jobs[1].recipe_id  # the environment is configuration


def test_no_matrix_is_the_base_alone() -> None:
    e = expand(_campaign(""), DEMO)
    assert len(e.jobs) == 1
    assert e.jobs[0].values == ()
    assert e.jobs[0].spec_data == DEMO


@pytest.mark.parametrize(
    ("text", "field", "point", "fragment"),
    [
        (
            '[matrix]\n"topology.prefill_nodes" = [2, 0]',
            "topology.prefill_nodes",
            (("topology.prefill_nodes", 0),),
            "Campaign file field 'topology.prefill_nodes' at point {topology.prefill_nodes = 0}:"
            " Run spec field 'topology.prefill_nodes' has invalid value 0: use an integer from"
            " 1 to 1024.",
        ),
        (
            '[matrix]\n"topology.prefill_nodes" = [3]\n"benchmark.isl_osl" = [[64, 16]]',
            "topology.prefill_workers",
            (("topology.prefill_nodes", 3), (ISL_OSL, [64, 16])),
            "at point {topology.prefill_nodes = 3, benchmark.isl_osl = [64, 16]}: Run spec"
            " field 'topology.prefill_workers' has invalid value 2: prefill_nodes (3) must be"
            " divisible by it",
        ),
        (
            '[[include]]\n"benchmark.concurrencies" = []',
            "benchmark.concurrencies",
            (("benchmark.concurrencies", []),),
            "list at least one concurrency",
        ),
        (
            '[matrix]\n"slurm.time_limit" = ["00:00:30"]',
            "slurm.time_limit",
            (("slurm.time_limit", "00:00:30"),),
            "Slurm's minimum is 1 minute",
        ),
    ],
)
def test_an_invalid_point_names_its_values_and_field(
    text: str, field: str, point: tuple[tuple[str, object], ...], fragment: str
) -> None:
    with pytest.raises(CampaignError) as err:
        _expand(text)
    assert err.value.field == field
    assert err.value.point == point
    assert str(err.value).startswith("Campaign file field ")
    assert fragment in str(err.value)


def test_a_base_value_that_is_not_a_table_is_named() -> None:
    base = copy.deepcopy(DEMO)
    base["env"] = "oops"
    with pytest.raises(CampaignError, match="the base spec's env must be a table"):
        expand(_campaign('[matrix]\n"env.common.X" = ["1"]'), base)


@pytest.mark.parametrize(
    ("text", "max_points", "fragment"),
    [
        # 3 combinations x 3 concurrencies = 9 points, counted once the specs are built.
        (
            '[matrix]\n"topology.prefill_nodes" = [2, 4, 6]',
            8,
            "Campaign file field 'matrix' has invalid value '9 points': the campaign expands"
            " to at least 9 points, more than --max-points allows (8; points are (recipe,"
            " concurrency) pairs counted before duplicates are merged); remove matrix values"
            " or raise --max-points.",
        ),
        # 101 x 100 combinations: refused at the 10001st, before any spec is built.
        (
            '[matrix]\n"engine.port" = '
            + str(list(range(9000, 9101)))
            + '\n"benchmark.input_len" = '
            + str(list(range(1, 101))),
            10_000,
            "the campaign expands to at least 10001 points, more than --max-points allows (10000;",
        ),
        # More than 100 combinations per allowed point are not even looked at.
        (
            '[matrix]\n"engine.port" = '
            + str(list(range(9000, 9040)))
            + '\n"benchmark.input_len" = '
            + str(list(range(1, 41))),
            10,
            "the campaign matrix has 1600 combinations before excludes, more than"
            " --max-points allows (10;",
        ),
    ],
)
def test_too_many_points_are_refused(text: str, max_points: int, fragment: str) -> None:
    with pytest.raises(CampaignError) as err:
        _expand(text, max_points=max_points)
    assert err.value.field == "matrix"
    assert fragment in str(err.value)
    assert "--max-points" in str(err.value)


def test_exactly_max_points_is_allowed() -> None:
    e = _expand('[matrix]\n"topology.prefill_nodes" = [2, 4, 6]', max_points=9)
    assert e.points == 9
    # Excluded combinations do not count.
    e = _expand(
        '[matrix]\n"topology.prefill_nodes" = [2, 4, 6]\n[[exclude]]\n"topology.prefill_nodes" = 6',
        max_points=6,
    )
    assert e.points == 6


def test_the_daemons_bound_caps_what_the_client_asks_for() -> None:
    text = '[matrix]\n"topology.prefill_nodes" = [2, 4, 6]'  # 9 points
    with pytest.raises(CampaignError) as err:
        _expand_limit(text, PointLimit(1_000_000_000, daemon=8))
    assert (
        "more than this daemon allows ([limits] campaign_max_points = 8; points are (recipe,"
        " concurrency) pairs counted before duplicates are merged); remove matrix values or"
        " split the campaign into smaller ones" in str(err.value)
    )
    with pytest.raises(CampaignError) as err:
        _expand_limit(text, PointLimit(None, daemon=8))  # no --max-points: the daemon's
    assert "campaign_max_points = 8;" in str(err.value)
    with pytest.raises(CampaignError) as err:  # the client asked for less
        _expand_limit(text, PointLimit(4, daemon=8))
    assert "more than --max-points allows (4;" in str(err.value)
    assert "raise --max-points (this daemon allows up to 8)." in str(err.value)
    assert _expand_limit(text, PointLimit(None, daemon=9)).points == 9
    assert PointLimit(1_000_000_000, daemon=10_000).points == 10_000


def _expand_limit(text: str, limit: PointLimit) -> Expansion:
    return expand(_campaign(text), DEMO, max_points=limit)


def test_combinations_are_counted_without_building_any() -> None:
    axes = "\n".join(f'"env.common.X{i}" = {list(range(10))}' for i in range(12))
    vast = _campaign(f'[matrix]\n{axes}\n[[include]]\n"env.common.X0" = 3')
    assert combinations(vast) == 10**12 + 1  # counted, not built
    with pytest.raises(CampaignError, match="matrix has 1000000000000 combinations"):
        expand(vast, DEMO, max_points=PointLimit(None, daemon=10_000))


def test_excludes_drop_the_same_combinations_by_one_key_or_several() -> None:
    text = """
[matrix]
"topology.prefill_nodes" = [2, 4, 6]
"benchmark.input_len" = [64, 128]
"benchmark.output_len" = [16, 32]
[[exclude]]
"topology.prefill_nodes" = 4
[[exclude]]
"benchmark.input_len" = 128
"benchmark.output_len" = 32
[[exclude]]
"topology.prefill_nodes" = 6
"benchmark.input_len" = 64
"benchmark.output_len" = 16
[[exclude]]
"topology.prefill_nodes" = 8
"""
    kept = [dict(v.values) for v in _expand(text).variants]
    assert [(k["topology.prefill_nodes"], k["benchmark.input_len"], k["benchmark.output_len"])
            for k in kept] == [
        (2, 64, 16), (2, 64, 32), (2, 128, 16), (6, 64, 32), (6, 128, 16)
    ]  # fmt: skip
    # An exclude of a value every row has matches every combination: nothing is left.
    every = '[matrix]\n"benchmark.input_len" = [64]\n[[exclude]]\n"benchmark.input_len" = 64'
    assert _expand(every).variants == ()


def test_too_many_excludes_are_refused_before_any_is_checked() -> None:
    many = "".join(f'[[exclude]]\n"benchmark.input_len" = {i}\n' for i in range(101))
    with pytest.raises(CampaignError, match="at most 100 \\[\\[exclude\\]\\] tables"):
        _campaign(f'[matrix]\n"benchmark.input_len" = {list(range(200))}\n{many}')
    # 100 x 2000 combinations against 100 excludes of two keys: refused, not examined.
    pairs = "".join(
        f'[[exclude]]\n"benchmark.input_len" = {i}\n"benchmark.output_len" = {i}\n'
        for i in range(1, 101)
    )
    axes = (
        f'"benchmark.input_len" = {list(range(1, 101))}\n'
        f'"benchmark.output_len" = {list(range(1, 2001))}\n'
    )
    with pytest.raises(CampaignError) as err:
        expand(_campaign(f"[matrix]\n{axes}{pairs}"), DEMO, max_points=PointLimit(None, 10_000))
    assert err.value.field == "exclude" and "10000000 checks" in str(err.value)


def test_an_expansion_stops_when_asked_between_points() -> None:
    text = '[matrix]\n"topology.prefill_nodes" = [2, 4, 6]'
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # once the counting and the first point were done

    with pytest.raises(ExpansionStopped) as err:
        expand(_campaign(text), DEMO, stop=stop)
    assert (err.value.built, err.value.combinations) == (1, 3)
    assert "stopped after 1 points of at most 3: its client went away" in str(err.value)
    with pytest.raises(ExpansionStopped):  # already while combinations are counted
        expand(_campaign(text), DEMO, stop=lambda: True)


# --- recipe id ----------------------------------------------------------------------------


def test_recipe_id_is_the_schema_and_the_fingerprint() -> None:
    spec = parse_spec(DEMO)
    rid = recipe_id(spec)
    assert len(rid) == 64
    assert rid != recipe_fingerprint(spec)
    assert RECIPE_ID_SCHEMA == 1
    assert recipe_id(parse_spec(copy.deepcopy(DEMO))) == rid


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("benchmark", "concurrencies", [8, 16]),
        ("slurm", "partition", "gpu"),
        ("slurm", "account", "team"),
        ("slurm", "time_limit", "01:00:00"),
        ("run", "log_dir", "/var/tmp/elsewhere"),
        ("benchmark", "point_timeout_s", 600),
    ],
)
def test_recipe_id_ignores_where_and_how_long(table: str, key: str, value: object) -> None:
    data = _with(table, key, value)
    assert recipe_id(parse_spec(data)) == recipe_id(parse_spec(DEMO))


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("benchmark", "input_len", 65),
        ("benchmark", "output_len", 17),
        ("topology", "prefill_nodes", 4),
        ("model", "served_name", "other/model"),
    ],
)
def test_recipe_id_changes_with_the_configuration(table: str, key: str, value: object) -> None:
    data = _with(table, key, value)
    assert recipe_id(parse_spec(data)) != recipe_id(parse_spec(DEMO))


# --- job_spec -----------------------------------------------------------------------------


def test_job_spec_restricts_the_concurrencies() -> None:
    job = expand(parse_campaign(SWEEP, default_name="x"), DEMO).jobs[0]
    data = job_spec(job, [4, 1])
    assert parse_spec(data).benchmark.concurrencies == (1, 4)
    assert _table(job.spec_data, "benchmark")["concurrencies"] == [1, 2, 4]
    for bad in ([], [8]):
        with pytest.raises(ValueError, match=f"job {job.key} runs concurrencies"):
            job_spec(job, bad)
