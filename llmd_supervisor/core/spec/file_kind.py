"""Which of the two TOML files a user hands the CLI this is: a run spec (`submit`, `render`)
or a campaign file (`campaign submit`), told by its top-level keys; and the sentence that
says which command takes it when it was given to the other. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.errors import SpecError

__all__ = ["Kind", "kind_of", "wrong_kind"]

Kind = Literal["run spec", "campaign file"]

# Top-level keys only one of the two has (both may have `notify`; `env` is a spec's).
_CAMPAIGN_ONLY: Final = frozenset(
    {"name", "base", "script", "cluster", "limits", "launcher", "matrix", "zip", "exclude",
     "include"}
)  # fmt: skip
_RUN_ONLY: Final = frozenset(
    {"run", "topology", "model", "container", "engine", "benchmark", "retry", "router",
     "sidecar", "slurm", "env", "recipe", "standins"}
)  # fmt: skip


def kind_of(document: Mapping[str, object]) -> Kind | None:
    """What the decoded TOML `document` is, or None when its keys do not say."""
    keys = set(document)
    campaign, run = keys & _CAMPAIGN_ONLY, keys & _RUN_ONLY
    if campaign and not run:
        return "campaign file"
    if run and not campaign:
        return "run spec"
    return None


def wrong_kind(text: str, path: str, expected: Kind) -> str | None:
    """The sentence for a file of the other kind than `expected` (naming the command that
    takes it), or None when it is not one (a file that is not TOML is the parser's to say)."""
    try:
        found = kind_of(decode_toml(text))
    except SpecError:
        return None
    if found is None or found == expected:
        return None
    if found == "campaign file":
        return (
            f"{path} is a campaign file, not a run spec: submit it with `llmd-supervisor"
            f" campaign submit {path}` (with --dry-run it lists its points)."
        )
    return (
        f"{path} is a run spec, not a campaign file: submit it with `llmd-supervisor submit"
        f" {path}` (`llmd-supervisor render {path}` prints its batch script)."
    )
