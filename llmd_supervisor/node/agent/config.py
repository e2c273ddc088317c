"""The agent's config: loading ``config.json`` (written by the batch script) and filling
in the defaults (one table, ``common.AGENT_DEFAULTS`` and its siblings, which the renderer
writes from too)."""

from __future__ import annotations

from typing import Any, Dict

from .. import common as shared
from .files import read_json

REQUIRED = ("log_dir", "prefill_nodes", "decode_nodes", "engine", "bench", "grace_s")


class ConfigError(Exception):
    """The config file or the Slurm environment is unusable."""


def with_defaults(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """`cfg` with every optional key the agent reads set (to its default when absent)."""
    out: Dict[str, Any] = dict(shared.AGENT_DEFAULTS)
    out.update(cfg)
    grace = float(out["grace_s"])
    out.setdefault("stop_timeout_s", shared.stop_timeout_s(grace))
    out.setdefault("exit_linger_s", shared.exit_linger_s(float(out["stop_timeout_s"])))
    out.setdefault("prefill_workers", 1)
    out.setdefault("decode_workers", 1)
    engine: Dict[str, Any] = dict(shared.ENGINE_DEFAULTS)
    engine.update(out["engine"])
    out["engine"] = engine
    bench: Dict[str, Any] = dict(shared.BENCH_DEFAULTS)
    bench.update(out["bench"])
    out["bench"] = bench
    env: Dict[str, Any] = out.get("env") or {}
    out["env"] = {t: dict(env.get(t) or {}) for t in ("common", "prefill", "decode", "bench")}
    return out


def load_config(path: str) -> Dict[str, Any]:
    """The agent's config from `path`, defaults filled in; ConfigError when unusable."""
    cfg = read_json(path)
    if cfg is None:
        raise ConfigError("cannot read config %s" % path)
    if cfg.get("version") != shared.CONFIG_VERSION:
        raise ConfigError(
            "config %s has version %r; this agent knows only version %d (render the batch "
            "script with the llmd-supervisor that ships this agent)"
            % (path, cfg.get("version"), shared.CONFIG_VERSION)
        )
    for key in REQUIRED:
        if key not in cfg:
            raise ConfigError("config %s lacks %r" % (path, key))
    if not isinstance(cfg["engine"], dict) or not isinstance(cfg["bench"], dict):
        raise ConfigError("config %s: engine and bench must be objects" % path)
    return with_defaults(cfg)
