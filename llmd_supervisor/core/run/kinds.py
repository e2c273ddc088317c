"""The kind of a run, modelled once (pure): a spec the daemon renders, a user's own batch
script, or a job submitted without the daemon and adopted.

A run's kind is chosen once, when it is accepted, and journaled in the run's ``kind``
column (schema version 10; older rows were filled from their stored spec text). Everything
that differs between the kinds is answered here, so that no other module asks which kind
of spec it holds: the run's name, its log directory and what the agent watches there, the
rank whose view makes the marker, its retry policy, its node count, GPUs and partition, the
spec a benchmark's files are judged by, and the spec file its archive keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

from llmd_supervisor.core.run.retry_policy import RetryPolicy
from llmd_supervisor.core.spec import foreign as foreign_spec
from llmd_supervisor.core.spec.foreign import ForeignSpec, Watch
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec
from llmd_supervisor.errors import SpecError

__all__ = [
    "KIND_NAMES",
    "NO_RETRY",
    "Adopted",
    "OwnScript",
    "Rendered",
    "RunKind",
    "kind_of",
    "load_kind",
]

# A job the daemon did not render is never retried (its script is the user's).
NO_RETRY: Final = RetryPolicy(infrastructure=0)


class RunKind(ABC):
    """What differs between the kinds of run; `column` is its value in the journal."""

    column: ClassVar[str]

    @property
    @abstractmethod
    def spec(self) -> RunSpec | ForeignSpec:
        """The spec as accepted (phases that read only common fields use it as it is)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """What `list` calls the run ("" for a spec without a name)."""

    @property
    @abstractmethod
    def log_dir(self) -> str: ...

    @property
    def watch(self) -> Watch | None:
        """What the agent watches in a job the daemon did not write (None: its own)."""
        return None

    @property
    def coordinator_rank(self) -> int:
        """The rank that writes the marker (a foreign job's: the first node's view)."""
        return 0

    @property
    def retry(self) -> RetryPolicy:
        return NO_RETRY

    @property
    def nodes(self) -> int | None:
        """The nodes the run asks for (None: its script's own options say)."""
        return None

    @property
    def gpus_per_node(self) -> int:
        return 0

    @property
    def partition(self) -> str | None:
        return None

    @property
    def notify(self) -> Sequence[str]:
        """The destinations the spec names for its events."""
        return ()

    @property
    def rendered(self) -> RunSpec | None:
        """The spec the daemon rendered (benchmark files are judged by it), else None."""
        return None

    @property
    def foreign(self) -> ForeignSpec | None:
        """The foreign spec (its script, batch logs, result files), else None."""
        return None

    @abstractmethod
    def archived_spec(self, text: str) -> tuple[str, str]:
        """The spec file the archive keeps, (file name, text), from the journaled `text`:
        a foreign spec without its environment's values."""


@dataclass(frozen=True)
class Rendered(RunKind):
    """A run spec the daemon validated and renders into its own batch script."""

    column: ClassVar[str] = "spec"
    run_spec: RunSpec

    @property
    def spec(self) -> RunSpec:
        return self.run_spec

    @property
    def name(self) -> str:
        return self.run_spec.name

    @property
    def log_dir(self) -> str:
        return self.run_spec.log_dir

    @property
    def coordinator_rank(self) -> int:
        return self.run_spec.topology.coordinator_rank

    @property
    def retry(self) -> RetryPolicy:
        return self.run_spec.retry

    @property
    def nodes(self) -> int | None:
        return self.run_spec.topology.nodes

    @property
    def gpus_per_node(self) -> int:
        return self.run_spec.topology.gpus_per_node

    @property
    def partition(self) -> str | None:
        return self.run_spec.slurm.partition

    @property
    def notify(self) -> Sequence[str]:
        return self.run_spec.notify

    @property
    def rendered(self) -> RunSpec:
        return self.run_spec

    def archived_spec(self, text: str) -> tuple[str, str]:
        return ("spec.toml", text)


@dataclass(frozen=True)
class OwnScript(RunKind):
    """A user's own batch script, submitted as it is (`submit --script`)."""

    column: ClassVar[str] = "script"
    foreign_spec: ForeignSpec

    @property
    def spec(self) -> ForeignSpec:
        return self.foreign_spec

    @property
    def name(self) -> str:
        return self.foreign_spec.name()

    @property
    def log_dir(self) -> str:
        return self.foreign_spec.watch.log_dir

    @property
    def watch(self) -> Watch:
        return self.foreign_spec.watch

    @property
    def foreign(self) -> ForeignSpec:
        return self.foreign_spec

    def archived_spec(self, text: str) -> tuple[str, str]:
        return ("foreign.json", foreign_spec.dump(self.foreign_spec, with_env_values=False))


@dataclass(frozen=True)
class Adopted(OwnScript):
    """A job submitted without the daemon, adopted by its job id (`adopt`)."""

    column: ClassVar[str] = "adopted"


_KINDS: Final[dict[str, type[RunKind]]] = {k.column: k for k in (Rendered, OwnScript, Adopted)}
KIND_NAMES: Final = tuple(_KINDS)


def kind_of(spec: RunSpec | ForeignSpec) -> RunKind:
    """The kind of a spec just admitted (the one place that asks which spec it is)."""
    if isinstance(spec, RunSpec):
        return Rendered(spec)
    return Adopted(spec) if spec.kind == "adopt" else OwnScript(spec)


def load_kind(column: str, text: str) -> RunKind:
    """The run's kind from its journaled ``kind`` column and spec text; SpecError if the
    text is not (any longer) a valid spec of that kind."""
    if column == Rendered.column:
        return Rendered(load_spec(text))
    if column not in _KINDS:
        raise SpecError("kind", column[:40], f"one of {', '.join(KIND_NAMES)}")
    spec = foreign_spec.load(text)
    kind = kind_of(spec)
    if kind.column != column:
        raise SpecError("kind", column, f"the stored spec is of kind {kind.column!r}")
    return kind
