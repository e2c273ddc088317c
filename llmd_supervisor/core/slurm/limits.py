"""A user's submit limit from `sacctmgr` (pure): how many jobs Slurm lets the account the
daemon submits as have pending or running at once.

Two queries, both ``--noheader --parsable2`` with explicit formats (the order below):

    sacctmgr show assoc where user=U format=qos,defaultqos,maxsubmit
    sacctmgr show qos format=name,maxsubmitpu

The limit is the lowest of every association's ``MaxSubmit`` and the ``MaxSubmitPU`` of
the QOS its jobs get (the association's default QOS; with none, each QOS it may use, the
lowest counting). Empty fields mean "no limit". Captured on the dev cluster (22.05 and
24.11 print alike): ``tests/data/slurm-qos-refusal/SOURCE.md``. Anything unreadable gives
None (unknown): the campaign then relies on sbatch's refusal (`campaign_run.qos_refusal`).
"""

from __future__ import annotations

from typing import Final

__all__ = ["ASSOC_FORMAT", "QOS_FORMAT", "submit_limit"]

ASSOC_FORMAT: Final = "qos,defaultqos,maxsubmit"
QOS_FORMAT: Final = "name,maxsubmitpu"


def _count(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def submit_limit(assoc_text: str, qos_text: str) -> int | None:
    """The lowest submit limit the two answers give, or None when they give none."""
    per_qos: dict[str, int | None] = {}
    for line in qos_text.splitlines():
        fields = line.split("|")
        if len(fields) >= 2 and fields[0].strip():
            per_qos[fields[0].strip()] = _count(fields[1])
    limits: list[int] = []
    for line in assoc_text.splitlines():
        fields = line.split("|")
        if len(fields) < 3:
            continue
        qos_list, default, max_submit = fields[0], fields[1].strip(), fields[2]
        names = [default] if default else [q.strip() for q in qos_list.split(",") if q.strip()]
        limits += [n for n in (per_qos.get(q) for q in names) if n is not None]
        own = _count(max_submit)
        if own is not None:
            limits.append(own)
    return min(limits) if limits else None
