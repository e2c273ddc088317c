"""Admitting a run: its spec validated, and its log directory checked where the cluster's
commands run, before anything is journaled or submitted."""

from __future__ import annotations

from collections.abc import Mapping

from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.routing import check_named
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.foreign import ForeignSpec
from llmd_supervisor.core.spec.log_dirs import check_canonical, check_log_dir
from llmd_supervisor.core.spec.runspec import RunSpec, check_daemon_dirs, load_spec
from llmd_supervisor.errors import SlurmCommandError, SpecError
from llmd_supervisor.supervision.cluster.clusters import Cluster


async def admit(
    config: Config, clusters: Mapping[str, Cluster], spec_toml: str, cluster: str | None
) -> RunSpec:
    """The validated spec, as `submit` (and a dry run) accepts it: SpecError unless its
    directories keep clear of the daemon's own, and its log directory is allowed
    (`core.spec.log_dirs`) and, resolved where the cluster's commands run (``realpath -m``),
    is itself: no link on its way; and unless every destination its ``[notify]`` names
    is configured in the daemon (the owner's side is checked at submission)."""
    spec = load_spec(spec_toml)
    check_named(spec.notify, None, config.events)
    await _check_log_dir(config, clusters, spec.log_dir, cluster)
    own = (str(config.state_dir), str(config.archive_root))
    check_daemon_dirs(spec, (*own, str(config.socket_path.parent)))
    return spec


async def admit_foreign(
    config: Config,
    clusters: Mapping[str, Cluster],
    spec_json: str,
    cluster: str | None,
    kind: str,
) -> ForeignSpec:
    """The validated foreign spec of `kind` (script or adopt), as `admit` checks a run
    spec's log directory; `--export-env` only where sbatch runs on this machine."""
    spec = foreign_spec.load(spec_json)
    if spec.kind != kind:
        raise SpecError("kind", spec.kind, f"this request takes a {kind!r} spec")
    cluster_cfg = config.cluster(cluster)
    if spec.env is not None and cluster_cfg.login_host is not None:
        raise SpecError(
            "--export-env",
            cluster_cfg.login_host,
            f"cluster {cluster_cfg.name!r} runs sbatch on its login host over SSH, where "
            "the environment would show in the command line; run the daemon (or the "
            "user service) on the login node, or set the variables in the script",
        )
    await _check_log_dir(config, clusters, spec.watch.log_dir, cluster, field="--log-dir")
    return spec


async def _check_log_dir(
    config: Config,
    clusters: Mapping[str, Cluster],
    log_dir: str,
    cluster: str | None,
    *,
    field: str = "run.log_dir",
) -> None:
    client = clusters[config.cluster(cluster).name].client
    own = (str(config.state_dir), str(config.archive_root))
    check_log_dir(log_dir, config.log_roots, own, field=field)
    argv = ["realpath", "-m", "--", log_dir]
    result = await client.runner.run(argv, time_limit=client.timeout)
    if not result.ok:
        raise SlurmCommandError(result.argv, result.returncode, result.stderr)
    check_canonical(log_dir, result.stdout.strip(), field=field)
