"""The GPUs a run's throughputs are divided by, as InferenceX divides them (pure).

InferenceX's ``utils/process_result.py`` (``tests/data/inferencex-agg/SOURCE.md``)
divides a multi-node (disaggregated) run's total tokens/s by all its GPUs, its output
tokens/s by the decode GPUs and its input tokens/s (total - output) by the prefill GPUs;
a single-node run's three by its GPUs. `per_gpu` is that division; `RoleGpus` the split
it needs, from the spec's topology (`core.spec.recipe.role_gpus`) or from what a result file
declares (`declared_roles`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["ROLE_GPU_KEYS", "PerGpu", "RoleGpus", "declared_roles", "per_gpu"]

# A result file may say its roles' GPUs itself (``vllm bench serve --metadata
# num_prefill_gpu=8 num_decode_gpu=16``): InferenceX's names for them in its aggregate.
ROLE_GPU_KEYS: Final = ("num_prefill_gpu", "num_decode_gpu")
MAX_GPUS: Final = 1_000_000


@dataclass(frozen=True)
class RoleGpus:
    """The GPUs of each role of a disaggregated run (InferenceX's PREFILL_GPUS and
    DECODE_GPUS: GPUs per node x the role's nodes)."""

    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class PerGpu:
    """A point's throughputs per GPU (tokens/s); None where the denominator is unknown."""

    total: float | None = None
    output: float | None = None
    input: float | None = None


def per_gpu(total_tps: float, output_tps: float, gpus: int | RoleGpus | None) -> PerGpu:
    """Total and output tokens/s (and input = total - output) per GPU, as InferenceX's
    process_result.py divides them.

    The roles' GPUs known (its multi-node case): total / (prefill + decode GPUs), output /
    decode GPUs (all GPUs when there is none), input / prefill GPUs. A total alone (its
    single-node case): all three / the total. None, 0 or no prefill GPU: every value None.
    """
    input_tps = max(0.0, total_tps - output_tps)
    if isinstance(gpus, RoleGpus):
        if gpus.prefill < 1 or gpus.decode < 0:
            return PerGpu()
        output_gpus = gpus.decode if gpus.decode > 0 else gpus.total
        return PerGpu(total_tps / gpus.total, output_tps / output_gpus, input_tps / gpus.prefill)
    if gpus is None or gpus < 1:
        return PerGpu()
    return PerGpu(total_tps / gpus, output_tps / gpus, input_tps / gpus)


def declared_roles(doc: Mapping[str, object]) -> RoleGpus | None:
    """The roles' GPUs a result file declares (`ROLE_GPU_KEYS`): both keys, integers or
    their digits as ``--metadata`` writes them, at least one prefill GPU.

    None otherwise: they are the job's word on its deployment, not a measurement, so a
    bad one leaves the per-GPU numbers of a run without other GPU counts unknown rather
    than its point invalid.
    """
    got = []
    for key in ROLE_GPU_KEYS:
        value = doc.get(key)
        if isinstance(value, str) and len(value) < 10 and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPUS:
            return None
        got.append(value)
    return RoleGpus(got[0], got[1]) if got[0] >= 1 else None
