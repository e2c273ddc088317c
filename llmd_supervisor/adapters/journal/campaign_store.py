"""Campaigns in the run journal: the campaign, its jobs and the ledger of verified points.

Shares the journal's database and its guarantees (one transaction per call, JournalError
naming the database and the operation; `adapters.journal.store`). A campaign is journaled with
all its jobs in one transaction, so a crash while it is being expanded leaves either the
whole campaign or nothing. A job's run id is chosen before its run exists and journaled
with the job (`set_job`); the run's own journal row follows, so after a crash the run id
says whether the job was submitted (DESIGN.md section 12: exactly once per point).

The ledger `verified_points` is shared by every campaign: (recipe id, concurrency) to each
run whose archived result proved it, with the result's sha256. Every run's proof is kept
(one per run): a user who may not see the run that proved a point first runs it once and
reuses its own proof from then on (`supervision.campaign.runner`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from llmd_supervisor.adapters.journal.db import Db
from llmd_supervisor.adapters.journal.rows import decode_json, iso, parse_time
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.adapters.outbox.rows import insert_outgoing
from llmd_supervisor.core.events.outbox import Outgoing
from llmd_supervisor.errors import JournalConflict, JournalError

__all__ = ["CampaignStore", "Proofs", "StoredCampaign", "StoredJob", "VerifiedPoint"]

_C_COLUMNS: Final = (
    "campaign_id, name, owner_uid, cluster, state, reason, file_text, base_text, settings, "
    "created_at, updated_at"
)
_J_COLUMNS: Final = (
    "campaign_id, job_key, seq, recipe_id, topology, concurrencies, to_run, matrix_values, "
    "nodes, gpus, workload, time_limit_s, spec_toml, state, run_id, submissions, reason, updated_at"
)
_P_COLUMNS: Final = "recipe_id, concurrency, run_id, campaign_id, result_file, sha256, verified_at"


@dataclass(frozen=True)
class StoredCampaign:
    campaign_id: str
    name: str
    owner_uid: int
    cluster: str
    state: str  # core.campaign.lifecycle.CampaignState's value
    reason: str
    file_text: str
    base_text: str
    settings: Mapping[str, object]  # limits, rerun
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class StoredJob:
    campaign_id: str
    job_key: str
    seq: int  # the expansion's order
    recipe_id: str
    topology: str
    concurrencies: tuple[int, ...]  # every point of the job
    to_run: tuple[int, ...]  # the points its run runs (the others were verified before)
    matrix_values: tuple[tuple[str, object], ...]
    nodes: int
    gpus: int
    workload: int
    time_limit_s: int
    spec_toml: str  # the job's spec, every point; the run's spec keeps `to_run`
    state: str  # core.campaign.admission.JobState's value
    run_id: str | None  # its current run
    submissions: int  # runs made for it (a QOS refusal makes another)
    reason: str
    updated_at: datetime


@dataclass(frozen=True)
class VerifiedPoint:
    recipe_id: str
    concurrency: int
    run_id: str
    campaign_id: str | None
    result_file: str  # relative to the run's archive
    sha256: str
    verified_at: datetime


Proofs = tuple[VerifiedPoint, ...]  # one point's proofs, one per run, oldest first


class CampaignStore:
    """The campaign tables of `journal`."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    @property
    def _path(self) -> str:
        return self._journal.location

    async def insert(self, campaign: StoredCampaign, jobs: Sequence[StoredJob]) -> None:
        """Journal a new campaign and all its jobs at once; JournalConflict if the id is taken."""
        operation = f"insert campaign {campaign.campaign_id}"
        path = self._journal.location
        c = campaign
        row = (
            c.campaign_id,
            c.name,
            c.owner_uid,
            c.cluster,
            c.state,
            c.reason,
            c.file_text,
            c.base_text,
            json.dumps(dict(c.settings), sort_keys=True),
            iso(c.created_at, path, operation),
            iso(c.updated_at, path, operation),
        )
        job_rows = [_job_row(j, path, operation) for j in jobs]

        def work(conn: Db) -> None:
            taken = conn.execute(
                "SELECT 1 FROM campaigns WHERE campaign_id = ?", (c.campaign_id,)
            ).fetchone()
            if taken is not None:
                raise JournalConflict(
                    self._path,
                    operation,
                    c.campaign_id,
                    f"the journal already holds campaign {c.campaign_id}",
                )
            conn.execute(f"INSERT INTO campaigns ({_C_COLUMNS}) VALUES ({_marks(11)})", row)
            conn.executemany(
                f"INSERT INTO campaign_jobs ({_J_COLUMNS}) VALUES ({_marks(18)})", job_rows
            )

        await self._journal.write(operation, work)

    async def set_state(
        self, campaign_id: str, state: str, reason: str, outgoing: Sequence[Outgoing] = ()
    ) -> None:
        """Set the campaign's state, with the outbound events it makes (its
        campaign.finished) in the same transaction."""
        operation = f"set campaign {campaign_id} {state}"
        now = iso(datetime.now(UTC), self._journal.location, operation)

        def work(conn: Db) -> None:
            cur = conn.execute(
                "UPDATE campaigns SET state = ?, reason = ?, updated_at = ? WHERE campaign_id = ?",
                (state, reason, now, campaign_id),
            )
            if cur.rowcount != 1:
                raise JournalError(
                    self._path, operation, f"the journal holds no campaign {campaign_id}"
                )
            insert_outgoing(conn, outgoing, self._path, operation)

        await self._journal.write(operation, work)

    async def set_job(
        self,
        campaign_id: str,
        job_key: str,
        *,
        state: str,
        reason: str,
        run_id: str | None = None,
        to_run: Sequence[int] | None = None,
    ) -> None:
        """A job's new state and reason (and, once, its run id and the points it runs)."""
        operation = f"set campaign {campaign_id} job {job_key} {state}"
        now = iso(datetime.now(UTC), self._journal.location, operation)
        sets = ["state = ?", "reason = ?", "updated_at = ?"]
        params: list[object] = [state, reason, now]
        if run_id is not None:  # a new run for the job
            sets += ["run_id = ?", "submissions = submissions + 1"]
            params.append(run_id)
        if to_run is not None:
            sets.append("to_run = ?")
            params.append(json.dumps(sorted(to_run)))

        def work(conn: Db) -> None:
            cur = conn.execute(
                f"UPDATE campaign_jobs SET {', '.join(sets)} WHERE campaign_id = ? AND job_key = ?",
                (*params, campaign_id, job_key),
            )
            if cur.rowcount != 1:
                raise JournalError(
                    self._path, operation, f"campaign {campaign_id} has no job {job_key}"
                )

        await self._journal.write(operation, work)

    async def campaigns(self, *, owner_uid: int | None = None) -> list[StoredCampaign]:
        """Every campaign (of `owner_uid`), oldest first."""
        where, params = ("owner_uid = ?", (owner_uid,)) if owner_uid is not None else ("TRUE", ())
        operation = "list campaigns"

        def work(conn: Db) -> list[StoredCampaign]:
            rows = conn.execute(
                f"SELECT {_C_COLUMNS} FROM campaigns WHERE {where} "
                "ORDER BY created_at, campaign_id",
                params,
            ).fetchall()
            return [self._campaign(r, operation) for r in rows]

        return await self._journal.read(operation, work)

    async def get(self, campaign_id: str) -> StoredCampaign | None:
        operation = f"read campaign {campaign_id}"

        def work(conn: Db) -> StoredCampaign | None:
            row = conn.execute(
                f"SELECT {_C_COLUMNS} FROM campaigns WHERE campaign_id = ?", (campaign_id,)
            ).fetchone()
            return None if row is None else self._campaign(row, operation)

        return await self._journal.read(operation, work)

    async def jobs(self, campaign_id: str) -> list[StoredJob]:
        """The campaign's jobs in expansion order."""
        operation = f"read campaign {campaign_id}'s jobs"

        def work(conn: Db) -> list[StoredJob]:
            rows = conn.execute(
                f"SELECT {_J_COLUMNS} FROM campaign_jobs WHERE campaign_id = ? ORDER BY seq",
                (campaign_id,),
            ).fetchall()
            return [self._job(r, operation) for r in rows]

        return await self._journal.read(operation, work)

    async def verified(self, recipe_ids: Iterable[str]) -> dict[tuple[str, int], Proofs]:
        """The ledger's proofs of the points of these recipes, oldest first per point."""
        ids = sorted(set(recipe_ids))
        operation = f"read the verified points of {len(ids)} recipes"

        def work(conn: Db) -> dict[tuple[str, int], Proofs]:
            out: dict[tuple[str, int], Proofs] = {}
            for start in range(0, len(ids), 500):  # SQLite's bound-parameter limit
                chunk = ids[start : start + 500]
                rows = conn.execute(
                    f"SELECT {_P_COLUMNS} FROM verified_points "
                    f"WHERE recipe_id IN ({_marks(len(chunk))}) "
                    "ORDER BY recipe_id, concurrency, verified_at, run_id",
                    chunk,
                ).fetchall()
                for r in rows:
                    p = self._point(r, operation)
                    key = (p.recipe_id, p.concurrency)
                    out[key] = (*out.get(key, ()), p)
            return out

        return await self._journal.read(operation, work)

    async def add_verified(self, points: Sequence[VerifiedPoint]) -> int:
        """Add proofs to the ledger, beside the other runs' proofs of the same points (a
        run's proof of a point is recorded once). Returns how many were new."""
        operation = f"record {len(points)} verified points"
        path = self._journal.location
        rows = [
            (
                p.recipe_id,
                p.concurrency,
                p.run_id,
                p.campaign_id,
                p.result_file,
                p.sha256,
                iso(p.verified_at, path, operation),
            )
            for p in points
        ]

        def work(conn: Db) -> int:
            return conn.executemany(
                f"INSERT INTO verified_points ({_P_COLUMNS}) VALUES ({_marks(7)}) "
                "ON CONFLICT DO NOTHING",
                rows,
            )

        return await self._journal.write(operation, work)

    async def forget_verified(self, keys: Sequence[tuple[str, int, str]]) -> None:
        """Drop proofs, each named by (recipe id, concurrency, run id): a result whose run
        is gone or whose file no longer matches its sha256. Other runs' proofs stay."""
        operation = f"forget {len(keys)} verified points"

        def work(conn: Db) -> None:
            conn.executemany(
                "DELETE FROM verified_points"
                " WHERE recipe_id = ? AND concurrency = ? AND run_id = ?",
                keys,
            )

        await self._journal.write(operation, work)

    # --- rows -------------------------------------------------------------------------------

    def _campaign(self, row: Sequence[object], operation: str) -> StoredCampaign:
        path = self._journal.location
        settings = decode_json(str(row[8]), dict, path, operation)
        return StoredCampaign(
            campaign_id=str(row[0]),
            name=str(row[1]),
            owner_uid=int(str(row[2])),
            cluster=str(row[3]),
            state=str(row[4]),
            reason=str(row[5]),
            file_text=str(row[6]),
            base_text=str(row[7]),
            settings=settings,
            created_at=parse_time(str(row[9]), path, operation),
            updated_at=parse_time(str(row[10]), path, operation),
        )

    def _job(self, row: Sequence[object], operation: str) -> StoredJob:
        path = self._journal.location
        concurrencies = _ints(
            decode_json(str(row[5]), list, path, operation), self._path, operation
        )
        to_run = _ints(decode_json(str(row[6]), list, path, operation), self._path, operation)
        values = decode_json(str(row[7]), list, path, operation)
        if not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) for v in values):
            raise JournalError(self._path, operation, f"job {row[1]} has matrix values {row[7]!r}")
        return StoredJob(
            campaign_id=str(row[0]),
            job_key=str(row[1]),
            seq=int(str(row[2])),
            recipe_id=str(row[3]),
            topology=str(row[4]),
            concurrencies=concurrencies,
            to_run=to_run,
            matrix_values=tuple((str(k), v) for k, v in values),
            nodes=int(str(row[8])),
            gpus=int(str(row[9])),
            workload=int(str(row[10])),
            time_limit_s=int(str(row[11])),
            spec_toml=str(row[12]),
            state=str(row[13]),
            run_id=None if row[14] is None else str(row[14]),
            submissions=int(str(row[15])),
            reason=str(row[16]),
            updated_at=parse_time(str(row[17]), path, operation),
        )

    def _point(self, row: Sequence[object], operation: str) -> VerifiedPoint:
        return VerifiedPoint(
            recipe_id=str(row[0]),
            concurrency=int(str(row[1])),
            run_id=str(row[2]),
            campaign_id=None if row[3] is None else str(row[3]),
            result_file=str(row[4]),
            sha256=str(row[5]),
            verified_at=parse_time(str(row[6]), self._journal.location, operation),
        )


def _job_row(j: StoredJob, path: str, operation: str) -> tuple[object, ...]:
    return (
        j.campaign_id,
        j.job_key,
        j.seq,
        j.recipe_id,
        j.topology,
        json.dumps(list(j.concurrencies)),
        json.dumps(list(j.to_run)),
        json.dumps([[k, v] for k, v in j.matrix_values]),
        j.nodes,
        j.gpus,
        j.workload,
        j.time_limit_s,
        j.spec_toml,
        j.state,
        j.run_id,
        j.submissions,
        j.reason,
        iso(j.updated_at, path, operation),
    )


def _ints(value: list[object], path: str, operation: str) -> tuple[int, ...]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise JournalError(path, operation, f"a campaign job holds {value!r}, not integers")
    return tuple(int(str(v)) for v in value)


def _marks(n: int) -> str:
    return ", ".join("?" * n)
