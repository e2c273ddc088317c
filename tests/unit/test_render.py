"""The rendered sbatch script: options, srun line, syntax, and what it does when run.

The execution tests run the script with bash and a fake ``srun`` on PATH (it records its
argv and exits with a chosen rc); no Slurm is involved. What the script carries for the
node directory is read by unpacking its archive here, never by grepping its text.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.cli.main import main
from llmd_supervisor.core.campaign.expand import expand, parse_campaign
from llmd_supervisor.core.render.agent_config import agent_config, stop_timeout_s
from llmd_supervisor.core.render.script import bundled_node_sources, render_sbatch
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec, parse_spec
from llmd_supervisor.core.spec.toml_write import dump_toml
from llmd_supervisor.errors import SpecError
from llmd_supervisor.node import AGENT_FILES, NODE_FILES, STANDIN_FILES
from llmd_supervisor.node.common import RC_NODE_FILES
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(30)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "llm-d"
DEMO = tomllib.loads((DEPLOY / "demo.toml").read_text())

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_SRUN_ARGV"
sleep "${FAKE_SRUN_SLEEP:-0}"
exit "${FAKE_SRUN_RC:-0}"
"""


def spec_with(**tables: dict[str, Any]) -> RunSpec:
    data = copy.deepcopy(DEMO)
    for name, values in tables.items():
        data.setdefault(name, {}).update(values)
    return parse_spec(data)


def sbatch_lines(script: str) -> list[str]:
    return [ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH")]


def _archive_lines(script: str) -> tuple[int, int]:
    """(first, end) indices of the archive's base64 lines in the script's lines."""
    lines = script.splitlines()
    (start,) = [i for i, ln in enumerate(lines) if ln.startswith("base64 -d > ")]
    delim = lines[start].split("<<'", 1)[1].removesuffix("'")
    return start + 1, lines.index(delim, start + 1)


def archive_of(script: str) -> bytes:
    """The node files' archive the script carries (its base64 heredoc, decoded)."""
    first, end = _archive_lines(script)
    return base64.b64decode("".join(script.splitlines()[first:end]), validate=True)


def unpacked(script: str) -> dict[str, bytes]:
    """Every file of the script's archive by its path in the node directory."""
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(archive_of(script)), mode="r:gz") as tar:
        for member in tar.getmembers():
            handle = tar.extractfile(member)
            if handle is not None:
                files[member.name] = handle.read()
    return files


def bash_syntax_ok(script: str, tmp: Path) -> None:
    path = tmp / "job.sbatch"
    path.write_text(script)
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_demo_sbatch_options() -> None:
    script = render_sbatch(spec_with(), job_name="llmd-demo-1")
    assert script.startswith("#!/bin/bash\n#SBATCH ")
    assert sbatch_lines(script) == [
        "--job-name=llmd-demo-1",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--output=/var/tmp/llmd-runs/demo/%x-%j.out",
        "--error=/var/tmp/llmd-runs/demo/%x-%j.err",
        "--signal=B:TERM@10",
        "--no-requeue",
        "--time=00:05:00",
        "--export=ALL",
    ]


def test_optional_sbatch_options() -> None:
    spec = spec_with(
        slurm={
            "partition": "gpu",
            "account": "bench",
            "requeue": True,
            "extra_args": ["--exclusive", "--mem=0"],
        },
        topology={"gpus_per_node": 8},
    )
    opts = sbatch_lines(render_sbatch(spec, job_name="j"))
    assert "--requeue" in opts and "--no-requeue" not in opts
    assert opts[-5:] == [
        "--partition=gpu",
        "--account=bench",
        "--gpus-per-node=8",
        "--exclusive",
        "--mem=0",
    ]


def test_sbatch_options_come_before_any_command() -> None:
    # sbatch stops reading #SBATCH lines at the first command.
    lines = render_sbatch(spec_with(), job_name="j").splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(not ln.startswith("#SBATCH") for ln in lines[first_cmd:])


def test_srun_line_and_no_scancel() -> None:
    script = render_sbatch(spec_with(), job_name="j")
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert srun == [
        "srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --kill-on-bad-exit=1 --signal=TERM@10"
        ' python3 "$NODE_DIR/agent.py" --config "$NODE_DIR/config.json" &'
    ]
    assert "scancel" not in script
    assert 'exit "$rc"' in script
    assert "trap " in script


def test_pyxis_and_docker_srun_lines() -> None:
    pyxis = spec_with(
        container={"kind": "pyxis", "squash_file": "/img/v.sqsh", "mounts": ["/c:/d:ro"]}
    )
    line = next(
        ln for ln in render_sbatch(pyxis, job_name="j").splitlines() if ln.startswith("srun ")
    )
    assert "--container-image=/img/v.sqsh" in line
    assert (
        "--container-mounts=/var/tmp/llmd-runs/demo:/var/tmp/llmd-runs/demo,"
        "/var/tmp/llmd-models/stand-in:/var/tmp/llmd-models/stand-in:ro,/c:/d:ro"
    ) in line
    docker = spec_with(container={"kind": "docker", "image": "vllm/vllm-openai:v0.9"})
    line = next(
        ln for ln in render_sbatch(docker, job_name="j").splitlines() if ln.startswith("srun ")
    )
    assert " docker run --rm --init --network=host " in line
    assert "-e SLURM_PROCID" in line and "-e SLURM_JOB_NODELIST" in line
    assert ' vllm/vllm-openai:v0.9 python3 "$NODE_DIR/agent.py"' in line


@pytest.mark.parametrize("name", ["", "a b", "x;y", "$(id)", "-x", "a/b", "n" * 129])
def test_bad_job_name(name: str) -> None:
    with pytest.raises(SpecError) as info:
        render_sbatch(spec_with(), job_name=name)
    assert info.value.field == "job_name"


def test_rendered_scripts_pass_bash_syntax_check(tmp_path: Path) -> None:
    bash_syntax_ok(render_sbatch(spec_with(), job_name="a"), tmp_path)
    for path in DEPLOY.glob("*.toml"):
        if path.name.startswith("campaign-"):  # a campaign file: every job it expands to
            campaign = parse_campaign(path.read_text(), default_name="c")
            assert campaign.base is not None, path
            base = tomllib.loads((path.parent / campaign.base).read_text())
            specs = [load_spec(dump_toml(j.spec_data)) for j in expand(campaign, base).jobs]
            assert len(specs) == 4, path
        else:
            specs = [parse_spec(tomllib.loads(path.read_text()))]
        for spec in specs:
            bash_syntax_ok(render_sbatch(spec, job_name="b"), tmp_path)


def test_agent_config_values() -> None:
    cfg = agent_config(spec_with())
    assert cfg["prefill_nodes"] == 2 and cfg["decode_nodes"] == 2
    assert cfg["grace_s"] == 10 and cfg["stop_timeout_s"] == stop_timeout_s(10) == 7.5
    assert cfg["bench"]["request_rate"] == "inf"
    assert stop_timeout_s(1) == 0.5 and stop_timeout_s(120) == 90.0


def _run_script(
    script: str,
    tmp: Path,
    *,
    rc: int = 0,
    sleep: float = 0,
    term_once_srun_runs: bool = False,
    restarts: int = 0,
) -> tuple[int, str, list[str]]:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "srun"
    fake.write_text(FAKE_SRUN)
    fake.chmod(0o755)
    job = tmp / "job.sbatch"
    job.write_text(script)
    argv_file = tmp / "srun.argv"
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "99",
        "SLURM_JOB_NODELIST": "node[1-4]",
        "FAKE_SRUN_ARGV": str(argv_file),
        "FAKE_SRUN_RC": str(rc),
        "FAKE_SRUN_SLEEP": str(sleep),
        "SLURM_RESTART_COUNT": str(restarts),
    }
    proc = subprocess.Popen(
        ["bash", str(job)],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        if term_once_srun_runs:  # the batch shell waits on srun (its trap is set)
            wait_until(
                lambda: (
                    (argv_file.is_file() and argv_file.stat().st_size > 0)
                    or proc.poll() is not None
                ),
                what="the fake srun started by the batch script",
            )
            proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@grace does
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    argv = argv_file.read_text().splitlines() if argv_file.exists() else []
    return proc.returncode, out, argv


def test_script_unpacks_node_files_and_exits_with_srun_rc(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # Shell metacharacters in argv and env values are data: they must reach the agent's
    # config verbatim and never run.
    pwned = tmp_path / "PWNED"
    evil = f"$(touch {pwned})`touch {pwned}`;touch {pwned}"
    spec = spec_with(
        run={"log_dir": str(log_dir)},
        engine={"prefill_command": ["python3", evil.replace("{", "{{").replace("}", "}}")]},
        env={"decode": {"EVIL": evil}},
    )
    rc, out, argv = _run_script(render_sbatch(spec, job_name="t"), tmp_path, rc=7)

    assert rc == 7, out
    assert "srun exited with rc 7" in out
    assert not pwned.exists()
    node_dir = log_dir / "99" / "node"
    for name in NODE_FILES:
        assert (node_dir / name).read_bytes() == bundled_node_sources()[name].encode(), name
    written = sorted(str(p.relative_to(node_dir)) for p in node_dir.rglob("*") if p.is_file())
    assert written == sorted([*NODE_FILES, "config.json"])  # and no archive left behind
    config = json.loads((node_dir / "config.json").read_text())
    assert config == json.loads(json.dumps(agent_config(spec)))
    # The config holds the [env] values (tokens); the script runs under umask 077, and
    # the archive's 0644/0755 are unpacked under it.
    assert stat.S_IMODE((node_dir / "config.json").stat().st_mode) == 0o600
    for path in (log_dir / "99", node_dir, *node_dir.rglob("*")):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    assert config["env"]["decode"]["EVIL"] == evil
    assert argv[-4:] == [
        "python3",
        f"{node_dir}/agent.py",
        "--config",
        f"{node_dir}/config.json",
    ]
    assert "--kill-on-bad-exit=1" in argv and "--signal=TERM@10" in argv


def test_requeued_job_rewrites_a_stale_config_privately(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    node_dir = log_dir / "99" / "node"
    node_dir.mkdir(parents=True)
    stale = node_dir / "config.json"
    stale.write_text("{}")
    stale.chmod(0o644)  # e.g. left by an earlier attempt of the same job id
    spec = spec_with(run={"log_dir": str(log_dir)}, env={"common": {"TOKEN": "s3cret"}})
    rc, out, _ = _run_script(render_sbatch(spec, job_name="t"), tmp_path, rc=0)
    assert rc == 0, out
    assert json.loads(stale.read_text())["env"]["common"]["TOKEN"] == "s3cret"
    assert stat.S_IMODE(stale.stat().st_mode) == 0o600


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_marker_left_under_this_job_id_is_set_aside_never_taken(
    tmp_path: Path, restarts: int
) -> None:
    # Job ids start again at 1 after a cluster's state is reset: the log directory can hold
    # another job's marker and job directory under this id (or, after a requeue, the
    # earlier attempt's marker). The node agents must never see them as this attempt's.
    log_dir = tmp_path / "logs"
    (log_dir / "99" / "bench").mkdir(parents=True)
    (log_dir / "99" / "bench" / "c1.json").write_text("{}")
    (log_dir / ".bench_done.99").write_text('{"rc": 0}')
    rc, out, _ = _run_script(
        render_sbatch(spec_with(run={"log_dir": str(log_dir)}), job_name="t"),
        tmp_path,
        restarts=restarts,
    )
    assert rc == 0, out
    assert not (log_dir / ".bench_done.99").exists()
    (marker,) = log_dir.glob(".bench_done.99.stale-*")
    assert marker.read_text() == '{"rc": 0}'
    assert f"set aside {log_dir}/.bench_done.99" in out
    old_results = list(log_dir.glob("99.stale-*/bench/c1.json"))
    # A first attempt's job directory is another job's; a requeued job keeps its own.
    assert len(old_results) == (1 if restarts == 0 else 0)
    assert (log_dir / "99" / "bench" / "c1.json").exists() == (restarts == 1)


def test_script_sets_umask_077_and_exports_only_sbatch_environment() -> None:
    script = render_sbatch(spec_with(), job_name="t")
    lines = script.splitlines()
    assert "umask 077" in lines and "umask 022" not in lines
    first_write = next(i for i, ln in enumerate(lines) if ln.startswith(("cat >", "base64 -d")))
    assert lines.index("umask 077") < first_write
    assert sbatch_lines(script).count("--export=ALL") == 1


def test_batch_shell_survives_term_and_keeps_srun_rc(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    spec = spec_with(run={"log_dir": str(log_dir)})
    start = time.monotonic()
    rc, out, _ = _run_script(
        render_sbatch(spec, job_name="t"), tmp_path, rc=5, sleep=2, term_once_srun_runs=True
    )
    assert rc == 5, out
    assert "batch shell got SIGTERM" in out
    assert time.monotonic() - start >= 1.9  # it waited for srun instead of dying


def test_cli_render_prints_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(DEPLOY / "demo.toml"), "--job-name", "llmd-x-1"]) == 0
    out = capsys.readouterr().out
    assert out == render_sbatch(spec_with(), job_name="llmd-x-1")


def test_cli_render_default_job_name_comes_from_the_spec(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same spec renders the same bytes (README); the daemon names submitted runs."""
    import hashlib

    names = set()
    for _ in range(2):
        assert main(["render", str(DEPLOY / "demo.toml")]) == 0
        (line,) = [
            ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("#SBATCH --job-")
        ]
        names.add(line)
    digest = hashlib.sha256((DEPLOY / "demo.toml").read_bytes()).hexdigest()[:8]
    assert names == {f"#SBATCH --job-name=llmd-demo-{digest}"}


def test_cli_render_bad_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((DEPLOY / "demo.toml").read_text().replace("requeue = false", "requeue = 1"))
    assert main(["render", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "'slurm.requeue'" in captured.err and "true or false" in captured.err
    assert main(["render", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml does not exist; check the path." in capsys.readouterr().err
    assert main(["render", str(DEPLOY / "demo.toml"), "--job-name", "a;b"]) == 2
    assert "'job_name'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "module",
    [
        "llmd_supervisor.core.spec.runspec",
        "llmd_supervisor.core.render.script",
        "llmd_supervisor.core.render.node_archive",
    ],
)
def test_spec_and_render_import_no_io_machinery(module: str) -> None:
    # -I ignores PYTHONPATH: the checkout under test goes first on the path by hand.
    probe = (
        "import importlib, json, sys; sys.path.insert(0, sys.argv[2]);"
        " importlib.import_module(sys.argv[1]); print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe, module, str(DEPLOY.parents[1])],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    forbidden = {"anyio", "asyncssh", "sqlite3", "subprocess", "socket", "asyncio", "structlog"}
    assert forbidden.isdisjoint(json.loads(out))


@pytest.mark.parametrize(
    ("example", "expected"),
    [
        (
            "example-vllm-pyxis.toml",
            "--container-image=/lustre/images/vllm-openai-v0.33.0.sqsh --container-mounts="
            "/lustre/llmd/runs/llama70b-pd:/lustre/llmd/runs/llama70b-pd,"
            "/lustre/models/Llama-3.3-70B-Instruct:/lustre/models/Llama-3.3-70B-Instruct:ro,"
            "/lustre/cache/hf:/root/.cache/huggingface --container-workdir="
            "/lustre/llmd/runs/llama70b-pd --container-writable --container-remap-root"
            ' python3 "$NODE_DIR/agent.py"',
        ),
        (
            "example-vllm-docker.toml",
            "docker run --rm --init --network=host --ipc=host --gpus=all",
        ),
    ],
)
def test_gpu_examples_render(example: str, expected: str) -> None:
    spec = parse_spec(tomllib.loads((DEPLOY / example).read_text()))
    script = render_sbatch(spec, job_name="llmd-x")
    (srun,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert expected in srun
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --exclusive" in script
    if spec.container.kind.value == "docker":
        # RDMA's narrow options (the RDMA devices, pinning memory, no memlock limit), not
        # --privileged: every device and capability of the node, given to the job's code.
        assert (
            " -e SLURMD_NODENAME --device=/dev/infiniband --cap-add=IPC_LOCK --ulimit=memlock=-1"
            ' --shm-size=32G vllm/vllm-openai:v0.33.0 python3 "$NODE_DIR/agent.py"'
        ) in srun
        assert "--privileged" not in script


# The demo's batch script before the stand-ins became opt-in (every script carried them,
# with 51 LLMD_FAKE_ lines), measured: 168,962 bytes; the examples' were 170,085 (pyxis)
# and 170,248 (docker). With the agent's readable source in heredocs, a production script
# was still about 121 KB; with it as one gzip'd tar (base64: about 45 KB for 112 KB of
# source), about 54 KB. Without the source's prose (`core.render.node_source`: 81 KB of code,
# 27 KB encoded) it is about 38 KB: issue 3.3's quarter.
DEMO_RENDER_BYTES_BEFORE = 168_962
PRODUCTION_MAX_BYTES = DEMO_RENDER_BYTES_BEFORE // 4
SCRIPT_AROUND_MAX = 8192  # the #SBATCH lines, the heredocs' framing, the srun line
EXAMPLES = sorted(DEPLOY.glob("example-vllm-*.toml"))


def _example(path: Path, log_dir: Path | None = None) -> RunSpec:
    data = tomllib.loads(path.read_text())
    if log_dir is not None:
        data["run"]["log_dir"] = str(log_dir)
        data["container"] = {"kind": "none", "python": sys.executable}
    return parse_spec(data)


def _written(script: str) -> list[str]:
    """The node directory's files the script writes: its archive's, and the heredocs'
    (``cat > "$NODE_DIR/..."``), sorted."""
    heredocs = [
        ln.split('"$NODE_DIR/', 1)[1].split('"', 1)[0]
        for ln in script.splitlines()
        if ln.startswith('cat > "$NODE_DIR/')
    ]
    return sorted([*unpacked(script), *heredocs])


def _table(script: str) -> dict[str, tuple[int, str]]:
    """The script's table of its node files: path -> (bytes, sha256)."""
    lines = script.splitlines()
    head = lines.index(
        "# The node files, unpacked into $NODE_DIR before anything runs (path, bytes, sha256):"
    )
    table: dict[str, tuple[int, str]] = {}
    for line in lines[head + 1 :]:
        if not line.startswith("#   "):
            break
        path, size, digest = line.removeprefix("#   ").split()
        table[path] = (int(size), digest)
    return table


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_a_production_script_carries_the_agent_and_no_stand_in(path: Path) -> None:
    spec = _example(path)
    assert not spec.standins
    script = render_sbatch(spec, job_name="prod")
    files = unpacked(script)
    assert "LLMD_FAKE_" not in script
    assert not [name for name, data in files.items() if b"LLMD_FAKE_" in data]
    assert _written(script) == sorted([*AGENT_FILES, "config.json"])
    sources = bundled_node_sources()
    for name in STANDIN_FILES:  # not one line of stand-in code either
        longest = max(sources[name].splitlines(), key=len).encode()
        assert longest not in script.encode(), name
        assert not [n for n, data in files.items() if longest in data], name
    archive = archive_of(script)
    config = len(json.dumps(agent_config(spec), indent=1, sort_keys=True).encode())
    table = sum(len(ln) + 1 for ln in script.splitlines() if ln.startswith("#   "))
    size = len(script.encode())
    encoded = len(base64.encodebytes(archive))
    assert size <= encoded + config + table + SCRIPT_AROUND_MAX, (size, encoded, config)
    assert size <= PRODUCTION_MAX_BYTES, size


def test_the_demo_script_carries_the_stand_ins() -> None:
    spec = spec_with()
    assert spec.standins and agent_config(spec)["standins"] is True
    script = render_sbatch(spec, job_name="demo")
    assert _written(script) == sorted([*NODE_FILES, "config.json"])
    assert any(b"LLMD_FAKE_" in data for data in unpacked(script).values())


@pytest.mark.parametrize("standins", [False, True])
def test_the_archive_holds_the_bundled_files_and_the_table_says_which(standins: bool) -> None:
    spec = spec_with() if standins else _example(EXAMPLES[0])  # the demo opts in
    script = render_sbatch(spec, job_name="t")
    files = unpacked(script)
    sources = bundled_node_sources()
    assert files == {name: sources[name].encode() for name in files}
    assert sorted(files) == sorted(NODE_FILES if standins else AGENT_FILES)
    assert _table(script) == {
        name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()
    }
    digest = hashlib.sha256(archive_of(script)).hexdigest()
    assert f"NODE_FILES_SHA256={digest}" in script.splitlines()
    # The heredoc's delimiter has a "_", which base64 never writes: no line of the
    # archive can end the heredoc early.
    first, end = _archive_lines(script)
    delim = script.splitlines()[end]
    assert "_" in delim and delim not in script.splitlines()[first:end]


def test_the_archive_is_deterministic() -> None:
    spec = _example(EXAMPLES[0])
    script = render_sbatch(spec, job_name="t")
    assert render_sbatch(spec, job_name="t") == script
    archive = archive_of(script)
    assert archive[:2] == b"\x1f\x8b" and archive[4:8] == b"\0\0\0\0"  # gzip, mtime 0
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive)), mode="r:") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert [m.name for m in members if m.isdir()] == ["llmd_node", "llmd_node/agent"]
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", ""), m.name
        assert m.mode == (0o755 if m.isdir() else 0o644), m.name
        assert m.isdir() or m.isfile(), m.name


def test_the_listing_command_in_the_script_reads_its_archive(tmp_path: Path) -> None:
    script = render_sbatch(_example(EXAMPLES[0]), job_name="t")
    (line,) = [ln for ln in script.splitlines() if "awk '" in ln]
    command = line.split(": ", 1)[1].replace("tar -tvzf -", "cat")
    (tmp_path / "job.sbatch").write_text(script)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, timeout=20, check=True
    )
    assert proc.stdout == archive_of(script)


def _damage(script: str, how: str) -> str:
    lines = script.splitlines(keepends=True)
    first, end = _archive_lines(script)
    middle = (first + end) // 2
    text = lines[middle]
    if how == "flipped":  # still base64, other bytes
        lines[middle] = ("B" if text[10] == "A" else "A").join((text[:10], text[11:]))
    elif how == "not-base64":
        lines[middle] = text[:10] + "*" + text[11:]
    else:  # a line lost
        del lines[middle]
    return "".join(lines)


@pytest.mark.parametrize("how", ["flipped", "not-base64", "lost"])
def test_a_damaged_archive_stops_the_job_before_anything_runs(tmp_path: Path, how: str) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    script = render_sbatch(_example(EXAMPLES[0], log_dir), job_name="t")
    damaged = _damage(script, how)
    assert damaged != script
    rc, out, argv = _run_script(damaged, tmp_path)
    assert rc == RC_NODE_FILES == 65, out
    digest = hashlib.sha256(archive_of(script)).hexdigest()
    assert "llmd: job 99: the node files' archive in this batch script is damaged" in out
    assert f"expected {digest}); nothing unpacked, no node agent started (exit 65)" in out
    assert argv == []  # srun never ran
    assert list((log_dir / "99" / "node").iterdir()) == []


def test_a_production_script_unpacks_a_runnable_agent(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    spec = _example(EXAMPLES[0], log_dir)
    rc, out, argv = _run_script(render_sbatch(spec, job_name="t"), tmp_path, rc=0)
    assert rc == 0, out
    node_dir = log_dir / "99" / "node"
    written = sorted(str(p.relative_to(node_dir)) for p in node_dir.rglob("*") if p.is_file())
    assert written == sorted([*AGENT_FILES, "config.json"])
    assert argv[-4:] == [
        sys.executable,
        f"{node_dir}/agent.py",
        "--config",
        f"{node_dir}/config.json",
    ]
    # srun would run this: the launcher finds its package in the node directory (here a
    # bad rank makes it stop at its configuration check, exit 64, before any engine).
    hosts = ",".join(f"node{i}" for i in range(spec.topology.nodes))
    proc = subprocess.run(
        [*argv[-4:], "--rank", "99", "--job-id", "99", "--hosts", hosts],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
        env={"PATH": os.environ["PATH"]},
    )
    assert proc.returncode == 64, proc.stderr
    assert "configuration error" in proc.stderr and "SLURM_PROCID 99" in proc.stderr
