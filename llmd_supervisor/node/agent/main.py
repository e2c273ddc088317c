"""The agent's command line: ``agent.py --config config.json`` (one task per node)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import List, Optional

from .. import common as shared
from . import stop
from .config import ConfigError, load_config
from .hooks import load_faults
from .run import Agent


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="llm-d node agent (one per node, under srun).")
    parser.add_argument(
        "--config", required=True, help="agent config JSON written by the batch script"
    )
    parser.add_argument(
        "--hosts",
        default=os.environ.get("LLMD_HOSTS", ""),
        help="comma-separated host per rank (default: expand SLURM_JOB_NODELIST)",
    )
    parser.add_argument("--rank", type=int, default=None, help="override SLURM_PROCID")
    parser.add_argument("--job-id", default=None, help="override SLURM_JOB_ID")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Run this node's agent; its exit status (see the package docstring)."""
    signal.signal(signal.SIGTERM, stop.EARLY_TERM.on_sigterm)
    try:
        args = parse_args(argv)
        cfg = load_config(args.config)
        rank = args.rank if args.rank is not None else int(os.environ["SLURM_PROCID"])
        job_id = args.job_id or os.environ["SLURM_JOB_ID"]
        if not re.fullmatch(r"[0-9A-Za-z_.-]+", job_id):
            raise ConfigError("bad job id %r" % job_id)
        nnodes = int(cfg["prefill_nodes"]) + int(cfg["decode_nodes"])
        if args.hosts:
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        else:
            hosts = shared.expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
        if len(hosts) != nnodes:
            raise ConfigError("%d hosts %r for %d nodes (P+D)" % (len(hosts), hosts, nnodes))
        node_dir = os.path.join(str(cfg["log_dir"]), job_id, shared.NODE_DIR)
        agent = Agent(cfg, rank, job_id, hosts, load_faults(cfg, node_dir, rank))
    except (ConfigError, KeyError, ValueError) as exc:
        print("llmd-agent: configuration error: %s" % (exc,), file=sys.stderr, flush=True)
        return shared.RC_CONFIG
    signal.signal(signal.SIGTERM, agent.term.on_sigterm)
    if stop.EARLY_TERM.received:
        agent.term.on_sigterm(signal.SIGTERM, None)
    return agent.run()
