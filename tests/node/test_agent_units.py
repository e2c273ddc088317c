"""Pure pieces of the node agent: hostlists, templates, roles, marker I/O, health timeouts."""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmd_supervisor.node import AGENT_FILES, NODE_FILES, NODE_PACKAGE, common, marker_format
from llmd_supervisor.node.agent import config, health, marker, templates, topology
from tests.node.conftest import PACKAGE_SRC

pytestmark = [pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("a[1-2],b3,c[7]", ["a1", "a2", "b3", "c7"]),
        ("gpu-[1-2]-ib", ["gpu-1-ib", "gpu-2-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("", []),
    ],
)
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert common.expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(expr: str) -> None:
    with pytest.raises(ValueError):
        common.expand_hostlist(expr)


def test_expand_template() -> None:
    values = {"port": "8000", "host": "node1"}
    assert templates.expand_template("{host}:{port}", values) == "node1:8000"
    assert templates.expand_template('{{"a": {port}}}', values) == '{"a": 8000}'
    with pytest.raises(config.ConfigError):
        templates.expand_template("{nope}", values)
    with pytest.raises(config.ConfigError):
        templates.expand_template("{port", values)


def test_environment_values_expand_known_placeholders_only_and_lazily() -> None:
    looked: list[str] = []

    def ip() -> str:
        looked.append("ip")
        return "10.77.0.12"

    values = templates.Values({"rank": "3", "host_ip": ip})
    assert templates.expand_known('{"kv_role": "kv_consumer"} {rank} {nope}', values) == (
        '{"kv_role": "kv_consumer"} 3 {nope}'
    )
    assert looked == []  # the address is looked for only when a value names it
    assert templates.expand_known("{host_ip}:{host_ip}", values) == "10.77.0.12:10.77.0.12"
    assert looked == ["ip"]


def test_the_node_address_is_one_of_its_own_interfaces() -> None:
    ip, iface = health.node_address("localhost")
    assert iface and health.interface_of(ip) == iface
    assert health.interface_of("192.0.2.254") == ""  # TEST-NET-1: held by no interface


def _cfg(p: int, d: int, pw: int, dw: int) -> dict[str, int]:
    return {"prefill_nodes": p, "decode_nodes": d, "prefill_workers": pw, "decode_workers": dw}


def test_roles_2p2d() -> None:
    cfg = _cfg(2, 2, 2, 1)
    roles = [topology.Role(r, cfg) for r in range(4)]
    assert [r.name for r in roles] == ["prefill", "prefill", "coordinator", "decode"]
    assert [r.is_leader for r in roles] == [True, True, True, False]
    assert [r.leader_rank for r in roles] == [0, 1, 2, 2]
    assert topology.leader_ranks(cfg, "prefill") == [0, 1]
    assert topology.leader_ranks(cfg, "decode") == [2]
    with pytest.raises(config.ConfigError):
        topology.Role(4, cfg)


def test_roles_4p4d_groups_of_two() -> None:
    cfg = _cfg(4, 4, 2, 2)
    roles = [topology.Role(r, cfg) for r in range(8)]
    assert [r.group for r in roles] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r.group_rank for r in roles] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert roles[4].is_coordinator and not roles[6].is_coordinator
    assert topology.leader_ranks(cfg, "decode") == [4, 6]


def test_publish_and_read_marker(tmp_path: Path) -> None:
    assert marker.read_marker(str(tmp_path), "7") is None
    written = marker.publish_marker(str(tmp_path), "7", 2, 0, "ok")
    raw = json.loads((tmp_path / ".bench_done.7").read_text())
    assert raw == written
    assert set(raw) == {"rc", "job_id", "rank", "reason", "finished_at"}
    assert raw["job_id"] == "7" and raw["rc"] == 0 and raw["rank"] == 2
    reading = marker.read_marker(str(tmp_path), "7")
    assert reading is not None and reading.ok
    assert (reading.rc, reading.rank, reading.reason) == (0, 2, "ok")
    assert marker.marker_exit(reading) == (0, "marker rc=0 from rank 2")
    assert marker.read_marker(str(tmp_path), "8") is None
    # A marker younger than the simulated lag is not seen yet.
    assert marker.read_marker(str(tmp_path), "7", min_age_s=60) is None
    assert [p.name for p in tmp_path.iterdir()] == [".bench_done.7"]


def _marker(**fields: object) -> str:
    value: dict[str, object] = {
        "rc": 0,
        "job_id": "9",
        "rank": 1,
        "reason": "x",
        "finished_at": "2026-12-03T07:00:00+00:00",
    }
    value.update(fields)
    return json.dumps({k: v for k, v in value.items() if v is not ...})


def test_read_marker_waits_for_a_torn_or_empty_one_and_ignores_another_jobs(
    tmp_path: Path,
) -> None:
    path = tmp_path / ".bench_done.9"
    for text in ("", '{"rc": 0, "job_', "7", _marker(job_id="10")):
        path.write_text(text)
        assert marker.read_marker(str(tmp_path), "9") is None, text
    path.write_text("7\n")  # InferenceX's plain integer
    reading = marker.read_marker(str(tmp_path), "9")
    assert reading is not None and marker.marker_exit(reading) == (7, "marker rc=7 (plain integer)")


@pytest.mark.parametrize(
    ("text", "status"),
    [
        (_marker(rc=False), marker_format.RC_NOT_INTEGER),
        (_marker(rc=True), marker_format.RC_NOT_INTEGER),
        (_marker(rc=0.0), marker_format.RC_NOT_INTEGER),
        (_marker(rc="0"), marker_format.RC_NOT_INTEGER),
        (_marker(rc=256), marker_format.RC_NOT_INTEGER),
        ('{"rc": false, "job_id": "9"}', marker_format.MISSING_FIELDS),
        (_marker(rank=-1), marker_format.BAD_FIELD),
        (_marker(finished_at="now"), marker_format.BAD_FINISHED_AT),
        ("done\n", marker_format.NOT_JSON),
        ("[0]", marker_format.NOT_OBJECT),
    ],
)
def test_an_invalid_marker_of_the_job_ends_a_worker_with_rc_bad_marker(
    tmp_path: Path, text: str, status: str
) -> None:
    # The job's own marker, however wrong: the agent must not wait on as if there were
    # none, nor exit with what int() or exit() would make of it (see test_agent_local).
    (tmp_path / ".bench_done.9").write_text(text)
    reading = marker.read_marker(str(tmp_path), "9")
    assert reading is not None and reading.status == status, reading
    rc, why = marker.marker_exit(reading)
    assert rc == common.RC_BAD_MARKER
    assert why == f"marker {status.replace('_', ' ')}: {reading.detail}"


@pytest.mark.parametrize(
    ("value", "rc"),
    [
        (0, 0),
        (7, 7),
        (143, 143),
        (255, 255),
        (256, None),  # exit(256) is exit 0
        (-256, None),
        (-1, None),
        (2**32, None),
        (False, None),  # a bool is an int to Python: exit(False) is exit 0
        (True, None),
        (0.0, None),
        ("0", None),
        (None, None),
        ([0], None),
    ],
)
def test_a_marker_rc_is_an_exit_status_or_nothing(value: object, rc: int | None) -> None:
    assert marker_format.marker_rc(value) == rc


def test_marker_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / ".bench_done.5"
    bad: list[bytes] = []
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                continue
            try:
                seen.add(json.loads(raw)["rc"])
            except (ValueError, KeyError):
                bad.append(raw)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for rc in (1, 2, 3):  # each publication dribbles its temp file out over 0.3 s
            marker.publish_marker(str(tmp_path), "5", 2, rc, "r" * 2000, slow_s=0.3)
    finally:
        stop.set()
        t.join()
    assert bad == []
    assert seen, "the reader never saw a marker"
    assert json.loads(path.read_bytes())["rc"] == 3


def test_check_health_blackhole_hits_read_timeout() -> None:
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        port = hole.getsockname()[1]
        start = time.monotonic()
        why = health.check_health("127.0.0.1", port, "/health", 1.0, 0.5)
        elapsed = time.monotonic() - start
    assert why == "timed out"
    assert 0.4 < elapsed < 2.0


def test_check_health_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert health.check_health("127.0.0.1", port, "/health", 1.0, 1.0) != ""


@pytest.mark.parametrize("name", [*sorted(set(NODE_FILES.values())), "node/safe_read.py"])
def test_node_files_parse_as_python_39(name: str) -> None:
    # feature_version rejects syntax newer than 3.9 (match, parenthesised context managers);
    # the node suite also runs under a real 3.9 with LLMD_NODE_PYTHON.
    source = (PACKAGE_SRC / name).read_text()
    tree = ast.parse(source, feature_version=(3, 9))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert "llmd_supervisor" not in imported, "node files must be standalone scripts"
    assert not imported & {"anyio", "asyncssh", "structlog", "tomllib"}


def test_agent_refuses_a_config_version_it_does_not_know(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    cfg = {"log_dir": "/x", "prefill_nodes": 1, "decode_nodes": 1, "engine": {}, "bench": {}}
    path.write_text(json.dumps({**cfg, "grace_s": 5, "version": common.CONFIG_VERSION + 1}))
    with pytest.raises(config.ConfigError, match="knows only version 1"):
        config.load_config(str(path))
    path.write_text(json.dumps({**cfg, "grace_s": 5, "version": common.CONFIG_VERSION}))
    assert config.load_config(str(path))["version"] == common.CONFIG_VERSION


def test_say_keeps_every_line_whole_across_threads(tmp_path: Path) -> None:
    # The stand-in servers log from their request threads; `print` (two writes per line)
    # merged lines here: 9,686 of 160,000 with 8 threads.
    code = (
        "import threading\n"
        "from llmd_supervisor.standins.faults import say\n"
        "def w(i):\n"
        "    for j in range(2000):\n"
        "        say('router: request_id=%d-%d status=200' % (i, j))\n"
        "ts = [threading.Thread(target=w, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
    )
    out = tmp_path / "out.log"
    with out.open("wb") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, check=True, timeout=25)
    lines = out.read_text().splitlines()
    assert len(lines) == 16000
    assert all(line.startswith("router: request_id=") and line.count("=") == 2 for line in lines)


def test_the_batch_script_carries_every_module_of_the_agent_and_the_stand_ins() -> None:
    shipped = set(NODE_FILES.values())
    agent = {f"node/agent/{p.name}" for p in (PACKAGE_SRC / "node" / "agent").glob("*.py")}
    standins = {
        f"standins/{p.name}"
        for p in (PACKAGE_SRC / "standins").glob("*.py")
        if p.name != "__init__.py"
    }
    assert (agent | standins) - shipped == set()


def test_the_launcher_imports_the_package_the_batch_script_writes() -> None:
    launcher = (PACKAGE_SRC / AGENT_FILES["agent.py"]).read_text()
    assert f"from {NODE_PACKAGE}.agent.main import main" in launcher
    assert all(dest.startswith(NODE_PACKAGE + "/") for dest in AGENT_FILES if dest != "agent.py")
