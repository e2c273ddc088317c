"""`LocalRunner` under an exported environment (`submit --script --export-env`, script
campaigns): the job gets that environment, but which cluster sbatch talks to stays the
daemon's choice."""

from __future__ import annotations

import pytest

from llmd_supervisor.adapters.slurm.runner import LocalRunner


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        ({}, "/etc/daemon/slurm.conf"),  # the daemon's own environment
        ({"SLURM_CONF": "/etc/configured/slurm.conf"}, "/etc/configured/slurm.conf"),
    ],
)
async def test_an_exported_environment_keeps_the_daemons_slurm_conf(
    monkeypatch: pytest.MonkeyPatch, configured: dict[str, str], expected: str
) -> None:
    monkeypatch.setenv("SLURM_CONF", "/etc/daemon/slurm.conf")
    runner = LocalRunner(configured)
    exported = {"PATH": "/nonexistent", "IX_MODEL": "m", "SLURM_CONF": "/tmp/client.conf"}
    got = await runner.run(["env"], time_limit=30, env=exported)
    lines = set(got.stdout.splitlines())
    assert f"SLURM_CONF={expected}" in lines and "IX_MODEL=m" in lines
    assert "SLURM_UMASK=0077" in lines
