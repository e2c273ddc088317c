"""Render a validated run spec into a self-contained sbatch script (pure).

The script carries the node agent (``node.AGENT_FILES``), and the stand-ins
(``node.STANDIN_FILES``) only when the spec opts in (``[standins] enabled = true``), as one
gzip'd tar (`core.render.node_archive`), base64-encoded in a quoted heredoc, with a table of
every file's path, size and sha256 in comments above it; the agent's JSON config follows
as a readable quoted heredoc (no expansion, no quoting concerns for its content). At job
start the batch shell checks the archive's sha256 (a mismatch exits with
``RC_NODE_FILES`` before anything is unpacked), unpacks it with ``base64 -d`` and
``tar -xzf`` (coreutils and tar: the batch shell runs outside any container, so no
python3 is assumed there) into ``<log_dir>/<job_id>/node/`` on the shared file system --
the log directory must be shared anyway, since the completion marker lives there -- and
runs one ``srun`` task per node. The script exits with srun's rc and never calls
``scancel``.

Secrets stay private: the job's variables come only from the spec's ``[env]`` tables (in
``config.json``, mode 0600, read by the agent). ``--export=ALL`` hands the job exactly
sbatch's own environment, which the daemon keeps small (PATH, HOME, USER, LOGNAME, LANG,
LC_ALL, TZ, SLURM_CONF: see ``adapters/slurm/runner.py``). Not ``--export=NONE``: the batch shell
and every step would lose PATH; not a list of names: Slurm 22.05 then loads the user's
login environment (``su -``) into the batch shell. The script runs under ``umask 077``
(srun passes it to every task), so nothing the job writes is readable by other users.

The batch shell traps TERM (``--signal=B:TERM@<grace>`` before the time limit) and keeps
waiting for srun: the tasks receive their own TERM from srun's ``--signal=TERM@<grace>``
or from ``scancel --signal=TERM``, and the job's exit status stays srun's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from functools import cache
from importlib import resources

from llmd_supervisor import __version__
from llmd_supervisor.core.render.agent_config import agent_config
from llmd_supervisor.core.render.node_archive import NodeArchive, check_path, pack
from llmd_supervisor.core.render.node_source import without_prose
from llmd_supervisor.core.run.layout import batch_log_patterns
from llmd_supervisor.core.spec.runspec import JOB_NAME_RE, ContainerKind, RunSpec
from llmd_supervisor.errors import SpecError
from llmd_supervisor.node import AGENT_FILES, NODE_FILES, STANDIN_FILES
from llmd_supervisor.node import common as shared

# Variables the agent reads inside a docker container (docker run does not inherit env).
DOCKER_PASS_ENV: tuple[str, ...] = (
    "SLURM_PROCID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_STEP_ID",
    "SLURMD_NODENAME",
)


@cache
def bundled_node_sources() -> Mapping[str, str]:
    """Every file a batch script may carry, by its path in the node directory
    (``node.NODE_FILES``), read once from this package without its prose (constant data;
    `core.render.node_source`: same code, same line numbers)."""
    pkg = resources.files("llmd_supervisor")
    return {
        dest: without_prose(pkg.joinpath(*src.split("/")).read_text(encoding="utf-8"))
        for dest, src in NODE_FILES.items()
    }


def node_files(spec: RunSpec) -> tuple[str, ...]:
    """The node directory's files the batch script of `spec` writes: the agent's, and the
    stand-ins' only when the spec opts in."""
    return tuple(AGENT_FILES) + (tuple(STANDIN_FILES) if spec.standins else ())


def sbatch_options(spec: RunSpec, *, job_name: str) -> list[str]:
    """The ``#SBATCH`` options, in order (values already validated as shell-inert)."""
    if not JOB_NAME_RE.fullmatch(job_name):
        raise SpecError(
            "job_name", job_name, "use letters, digits and . _ - (at most 128 characters)"
        )
    s = spec.slurm
    opts = [
        f"--job-name={job_name}",
        f"--nodes={spec.topology.nodes}",
        "--ntasks-per-node=1",
        f"--output={batch_log_patterns(spec.log_dir)[0]}",
        f"--error={batch_log_patterns(spec.log_dir)[1]}",
        f"--signal=B:TERM@{spec.sigterm_grace_s}",
        "--requeue" if s.requeue else "--no-requeue",
        f"--time={s.time_limit}",
        "--export=ALL",
    ]
    if s.partition:
        opts.append(f"--partition={s.partition}")
    if s.account:
        opts.append(f"--account={s.account}")
    if spec.topology.gpus_per_node:
        opts.append(f"--gpus-per-node={spec.topology.gpus_per_node}")
    opts.extend(s.extra_args)
    return opts


def srun_argv(spec: RunSpec) -> list[str]:
    """The srun command line; ``$NODE_DIR`` is expanded by the batch shell."""
    n = spec.topology.nodes
    grace = spec.sigterm_grace_s
    argv = [
        "srun",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        f"--signal=TERM@{grace}",
    ]
    c = spec.container
    agent = ['"$NODE_DIR/agent.py"', "--config", '"$NODE_DIR/config.json"']
    mounts = [f"{spec.log_dir}:{spec.log_dir}", f"{spec.model.path}:{spec.model.path}:ro"]
    mounts.extend(c.mounts)
    if c.kind is ContainerKind.PYXIS:
        assert c.squash_file is not None
        argv += [
            f"--container-image={shlex.quote(c.squash_file)}",
            f"--container-mounts={shlex.quote(','.join(mounts))}",
            f"--container-workdir={shlex.quote(spec.log_dir)}",
        ]
        argv += [shlex.quote(a) for a in c.extra_args]
        argv += [shlex.quote(c.python), *agent]
    elif c.kind is ContainerKind.DOCKER:
        assert c.image is not None
        argv += ["docker", "run", "--rm", "--init", "--network=host", "--ipc=host"]
        if spec.topology.gpus_per_node:
            argv.append("--gpus=all")
        for m in mounts:
            argv += ["-v", shlex.quote(m)]
        for var in DOCKER_PASS_ENV:
            argv += ["-e", var]
        if c.user is not None:
            argv.append(f"--user={c.user}")
        argv += [shlex.quote(a) for a in c.extra_args]
        argv += [shlex.quote(c.image), shlex.quote(c.python), *agent]
    else:
        argv += [shlex.quote(c.python), *agent]
    return argv


def _heredoc(target: str, name: str, content: str) -> str:
    if not content.endswith("\n"):
        content += "\n"
    digest = hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]
    delim = f"LLMD_EOF_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}_{digest}"
    if delim in content.splitlines():  # cannot happen short of a hash collision
        raise ValueError(f"heredoc delimiter {delim} occurs in {name}")
    return f"cat > {target} <<'{delim}'\n{content}{delim}\n"


def _q_node(path: str) -> str:
    """A path in the node directory as the batch shell spells it (the paths are ours:
    letters, digits, ``_``, ``.`` and ``/``)."""
    return f'"$NODE_DIR/{check_path(path)}"'


def node_archive(spec: RunSpec, sources: Mapping[str, str] | None = None) -> NodeArchive:
    """The archive of `node_files` of `spec` the batch script carries (by default the
    files shipped with this package)."""
    sources = bundled_node_sources() if sources is None else sources
    files = node_files(spec)
    missing = [n for n in files if n not in sources]
    if missing:
        raise ValueError(f"node sources lack {', '.join(missing)}")
    return pack({name: sources[name] for name in files})


# The archive while the batch shell checks and unpacks it (removed once unpacked).
_ARCHIVE_TMP = _q_node(".node_files.tar.gz")


def _node_files_part(archive: NodeArchive) -> list[str]:
    """The script's lines that carry the node files: their table, the archive (base64, in
    a heredoc whose delimiter has a ``_``, which base64 never writes) and its unpacking."""
    width = max(len(f.path) for f in archive.files)
    delim = f"LLMD_EOF_NODE_FILES_{archive.sha256[:16]}"
    encoded = base64.encodebytes(archive.data).decode("ascii")  # lines of 76 characters
    rc = shared.RC_NODE_FILES
    return [
        "# The node files, unpacked into $NODE_DIR before anything runs (path, bytes, sha256):",
        *(f"#   {f.path:<{width}} {f.size:>7}  {f.sha256}" for f in archive.files),
        f"# They travel as one gzip'd tar of {len(archive.data)} bytes, base64 below; to list",
        "# it from a saved script: awk '/^LLMD_EOF_NODE_FILES_/{f=0} f; /^base64 -d /{f=1}'"
        " job.sbatch | base64 -d | tar -tvzf -",
        f"NODE_FILES_SHA256={archive.sha256}",
        f"base64 -d > {_ARCHIVE_TMP} <<'{delim}'",
        encoded + delim,
        "b64_rc=$?",
        f"got=$(sha256sum < {_ARCHIVE_TMP}); got=${{got%% *}}",
        'if [ "$b64_rc" != 0 ] || [ "$got" != "$NODE_FILES_SHA256" ]; then',
        "  echo \"llmd: job $JOB_ID: the node files' archive in this batch script is damaged"
        " (base64 -d rc $b64_rc, sha256 ${got:-unknown}, expected $NODE_FILES_SHA256);"
        f' nothing unpacked, no node agent started (exit {rc})" >&2',
        f"  rm -f -- {_ARCHIVE_TMP}",
        f"  exit {rc}",
        "fi",
        # -m: the files get the time they were unpacked, not the archive's mtime 0; the
        # modes are the archive's under this shell's umask 077, the owner is the job's user.
        f'tar -xzmf {_ARCHIVE_TMP} -C "$NODE_DIR" --no-same-owner --no-same-permissions || {{',
        '  echo "llmd: job $JOB_ID: could not unpack the node files into $NODE_DIR" >&2',
        "  exit 1",
        "}",
        f"rm -f -- {_ARCHIVE_TMP}",
        "",
    ]


def render_sbatch(
    spec: RunSpec,
    *,
    job_name: str,
    node_sources: Mapping[str, str] | None = None,
) -> str:
    """Render the batch script for ``spec`` submitted under the unique ``job_name``.

    ``node_sources`` maps each file's path in the node directory (``agent.py``,
    ``llmd_node/common.py``, ``engine.py``, ...) to its text; by default the files shipped
    with this package. Only `node_files` of the spec are written: a spec without
    ``[standins] enabled = true`` gets no stand-in. Raises ``SpecError`` for a bad job
    name. The log directory must exist before submission (sbatch opens --output there).
    """
    archive = node_archive(spec, node_sources)
    config = json.dumps(agent_config(spec), indent=1, sort_keys=True)
    t = spec.topology
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in sbatch_options(spec, job_name=job_name)]
    lines += [
        "#",
        f"# llm-d run rendered by llmd-supervisor {__version__}:"
        f" {t.prefill_nodes} prefill + {t.decode_nodes} decode nodes"
        f" (coordinator = rank {t.coordinator_rank}).",
        "# Exit status: srun's, i.e. the node agents' common rc (deploy/llm-d/README.md).",
        "# Nothing here cancels the job: a finished run ends COMPLETED or FAILED by itself.",
        "",
        "set -u",
        "umask 077",
        'SRUN_PID=""',
        # Slurm TERMs this shell <grace> s before the time limit (B:TERM). The tasks get
        # their own TERM from srun --signal / scancel --signal=TERM; the shell must keep
        # waiting for srun so that the job's exit status is srun's.
        "trap 'echo \"llmd: batch shell got SIGTERM; still waiting for srun ${SRUN_PID}\" >&2'"
        " TERM",
        f"LOG_DIR={shlex.quote(spec.log_dir)}",
        'JOB_ID="${SLURM_JOB_ID:?llmd: this script must run under sbatch}"',
        f'NODE_DIR="$LOG_DIR/$JOB_ID/{shared.NODE_DIR}"',
        # A marker of this job id found now was not published by this attempt: an earlier
        # attempt's (a requeue), or another job's that had the id before the cluster's ids
        # started again at 1. So is the job directory of a first attempt. Both are set
        # aside (kept, renamed), never taken for this attempt's.
        'STALE="stale-$(date +%s)-$$"',
        f'for old in "$LOG_DIR/{shared.marker_name("$JOB_ID")}" "$LOG_DIR/$JOB_ID"; do',
        '  [ "$old" = "$LOG_DIR/$JOB_ID" ] && [ "${SLURM_RESTART_COUNT:-0}" != 0 ] && continue',
        '  if [ -e "$old" ] || [ -L "$old" ]; then',
        '    mv -- "$old" "$old.$STALE" || exit 1',
        '    echo "llmd: job $JOB_ID: set aside $old (not this attempt\'s) as $old.$STALE" >&2',
        "  fi",
        "done",
        'mkdir -p -m 700 -- "$NODE_DIR" || exit 1',
        "",
    ]
    body = ["\n".join(_node_files_part(archive))]
    # The config carries the spec's [env] values (tokens): only the job's user may read
    # it, so it is created afresh under umask 077 (a requeued job finds the old one).
    body.append('rm -f -- "$NODE_DIR/config.json"\n')
    body.append(_heredoc('"$NODE_DIR/config.json"', "config.json", config))
    tail = [
        "",
        f'echo "llmd: job $JOB_ID: starting {t.nodes} node agents on ${{SLURM_JOB_NODELIST:-?}}"',
        " ".join(srun_argv(spec)) + " &",
        "SRUN_PID=$!",
        # `wait` returns early (>128) when the trapped TERM arrives; wait again until srun
        # is really gone, then once more to collect its saved exit status.
        "while :; do",
        '  wait "$SRUN_PID"; rc=$?',
        '  if kill -0 "$SRUN_PID" 2>/dev/null; then continue; fi',
        '  wait "$SRUN_PID"; rc=$?',
        "  break",
        "done",
        'echo "llmd: job $JOB_ID: srun exited with rc $rc"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines) + "\n".join(body) + "\n".join(tail)
