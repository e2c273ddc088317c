"""A campaign's points against the archive: proving them and checking old proofs (I/O).

A point (recipe id, concurrency) is verified by a `succeeded` run whose archived
``results.json`` row for that concurrency is valid; the proof is the archived result
file's name and sha256 (`verified_of`). A rendered run's result files are
``results/c<N>.json``; a `--script` run's keep their path below its log directory
(``results/results/ix_c4.json``). A proof is still good only while that file
exists with the same sha256 (`still_good`): an archive pruned or edited by hand does not
keep saving GPU-hours. Both read the daemon's own archive (bounded reads).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Final

from llmd_supervisor.adapters.journal.campaign_store import VerifiedPoint
from llmd_supervisor.core.run.layout import RESULTS
from llmd_supervisor.errors import ControlError
from llmd_supervisor.supervision.control.views import results_table_of

__all__ = ["archived_result", "proof_of", "still_good", "verified_of"]

RESULT_FILE_MAX: Final = 64 << 20  # an archived result file larger than this proves nothing


def _sha256(path: Path) -> str | None:
    """The file's sha256, None when it is missing, not a regular file or too large."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            size = 0
            while chunk := f.read(1 << 20):
                size += len(chunk)
                if size > RESULT_FILE_MAX:
                    return None
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def archived_result(archive: Path, proof: VerifiedPoint) -> bytes | None:
    """The proof's archived result file's bytes while it still has the proof's sha256
    (None: missing, not a regular file, too large or changed). Read once, bounded: the
    bytes judged again are the bytes whose digest was checked."""
    try:
        with (archive / proof.result_file).open("rb") as f:
            data = f.read(RESULT_FILE_MAX + 1)
    except OSError:
        return None
    if len(data) > RESULT_FILE_MAX or hashlib.sha256(data).hexdigest() != proof.sha256:
        return None
    return data


def verified_of(
    archive_dir: Path,
    *,
    recipe_id: str,
    concurrencies: Iterable[int],
    run_id: str,
    campaign_id: str,
    now: datetime,
) -> list[VerifiedPoint]:
    """The proofs a succeeded run's archive gives for `concurrencies` (valid rows only). A
    concurrency with more than one row (a `--script` run whose result patterns matched
    another job's files too) proves nothing: which file is the run's own is not known."""
    try:
        table = results_table_of(archive_dir / "results.json")
    except ControlError:
        return []
    if table is None:
        return []
    rows = Counter(row["concurrency"] for row in table["points"])
    wanted = {c for c in concurrencies if rows[c] == 1}
    out = []
    for row in table["points"]:
        conc, relative = row["concurrency"], row["file"]  # results/c<N>.json
        folder, _, name = relative.partition("/")
        if conc not in wanted or not row["valid"] or folder != RESULTS or not _below(name):
            continue
        digest = _sha256(archive_dir / relative)
        if digest is not None:
            out.append(VerifiedPoint(recipe_id, conc, run_id, campaign_id, relative, digest, now))
    return out


def preferred(
    proofs: Sequence[VerifiedPoint], owner_uid: int, owners: Mapping[str, int]
) -> list[VerifiedPoint]:
    """One point's proofs in the order a campaign of `owner_uid` tries them for reuse: its
    owner's own runs' first, then the others' (`owners`: run id to its owner), each oldest
    first (the ledger's order)."""
    return sorted(proofs, key=lambda p: owners.get(p.run_id) != owner_uid)


def proof_of(
    proofs: Mapping[tuple[str, int], Sequence[VerifiedPoint]],
    recipe_id: str,
    concurrency: int,
    *,
    ran: bool,
    run_id: str | None,
    owner_uid: int,
    owners: Mapping[str, int],
) -> VerifiedPoint | None:
    """The ledger's proof a campaign job's point shows: a point the job ran itself (`ran`),
    only its own run's; a point it reused, the first in `preferred` order (the ledger keeps
    every run's proof, some of them other users' runs the job's owner may not see)."""
    found = proofs.get((recipe_id, concurrency), ())
    if ran:
        return next((p for p in found if p.run_id == run_id), None)
    ordered = preferred(found, owner_uid, owners)
    return ordered[0] if ordered else None


def _below(name: str) -> bool:
    """`name` is a relative path that stays below its folder (no '', '.' or '..' part)."""
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in name.split("/"))


def still_good(points: Sequence[VerifiedPoint], archive_of: dict[str, Path]) -> list[bool]:
    """For each proof: its run is known (`archive_of`: run id to archive directory) and its
    archived result file still has the recorded sha256."""
    out = []
    for p in points:
        archive = archive_of.get(p.run_id)
        out.append(archive is not None and _sha256(archive / p.result_file) == p.sha256)
    return out
