"""The run spec's ``[benchmark]`` table and its ``[benchmark.validity]`` (pure, no I/O).

    [benchmark]  command, input_len, output_len, concurrencies, prompts_multiplier,
                 request_rate, point_timeout_s, result_format = "vllm" | "inferencex"
    [benchmark.validity]  min_completed_fraction (0 < x <= 1, default 0.95),
                          min_output_tokens (>= 0, default 1),
                          max_failed (>= 0, default: what the fraction leaves)

Every invalid value raises :class:`~llmd_supervisor.errors.SpecError` naming the field,
the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from llmd_supervisor.core.results.evidence import FORMATS, ResultFormat, Validity
from llmd_supervisor.core.spec.fields import (
    check_keys,
    command_field,
    int_field,
    list_field,
    num_field,
    shown,
)
from llmd_supervisor.errors import SpecError

__all__ = ["BENCHMARK_KEYS", "VALIDITY_KEYS", "Benchmark", "parse_benchmark", "parse_validity"]

BENCHMARK_KEYS: Final = (
    "command",
    "concurrencies",
    "input_len",
    "output_len",
    "prompts_multiplier",
    "request_rate",
    "point_timeout_s",
    "result_format",
    "validity",
)
VALIDITY_KEYS: Final = ("min_completed_fraction", "min_output_tokens", "max_failed")
MAX_PROMPTS: Final = 1_000_000_000


@dataclass(frozen=True)
class Benchmark:
    command: tuple[str, ...]
    concurrencies: tuple[int, ...]
    input_len: int = 1024
    output_len: int = 256
    prompts_multiplier: int = 10
    request_rate: float = math.inf
    point_timeout_s: float = 3600.0
    result_format: ResultFormat = "vllm"
    validity: Validity = field(default_factory=Validity)

    def num_prompts(self, concurrency: int) -> int:
        """Requests the point at `concurrency` sends: concurrency x prompts_multiplier.

        The node agent computes the ``{num_prompts}`` placeholder the same way
        (``node/agent/run.py``); the validity gate measures completions against it.
        """
        return concurrency * self.prompts_multiplier

    def expected_prompts(self) -> dict[int, int]:
        """concurrency -> prompts requested, for every configured point (the gate's input)."""
        return {c: self.num_prompts(c) for c in self.concurrencies}


def parse_benchmark(t: Mapping[str, object], placeholders: frozenset[str]) -> Benchmark:
    """Validate the ``[benchmark]`` table (keys already checked by the caller)."""
    raw = list_field(t, "benchmark.concurrencies", required=True)
    if not raw:
        raise SpecError("benchmark.concurrencies", raw, "list at least one concurrency")
    concs: list[int] = []
    for i, c in enumerate(raw):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 100000:
            raise SpecError(
                f"benchmark.concurrencies[{i}]", c, "each concurrency is an integer 1..100000"
            )
        concs.append(c)
    if len(set(concs)) != len(concs):
        raise SpecError("benchmark.concurrencies", raw, "remove the duplicate concurrencies")
    rate_raw = t.get("request_rate", "inf")
    if rate_raw == "inf":
        rate = math.inf
    elif isinstance(rate_raw, int | float) and not isinstance(rate_raw, bool) and rate_raw > 0:
        rate = float(rate_raw)
        if not math.isfinite(rate):
            rate = math.inf
    else:
        raise SpecError(
            "benchmark.request_rate", rate_raw, "use a positive number of requests/s or 'inf'"
        )
    fmt = t.get("result_format", "vllm")
    if fmt not in FORMATS:
        raise SpecError(
            "benchmark.result_format",
            shown(fmt),
            "use 'vllm' (vllm bench serve --save-result) or 'inferencex' (InferenceX's "
            "benchmark_serving.py, which writes no 'failed' key)",
        )
    validity = t.get("validity", {})
    if not isinstance(validity, Mapping):
        raise SpecError("benchmark.validity", shown(validity), "use a table [benchmark.validity]")
    return Benchmark(
        command=command_field(t, "benchmark.command", placeholders),
        concurrencies=tuple(concs),
        input_len=int_field(t, "benchmark.input_len", default=1024, lo=1, hi=10_000_000),
        output_len=int_field(t, "benchmark.output_len", default=256, lo=1, hi=10_000_000),
        prompts_multiplier=int_field(
            t, "benchmark.prompts_multiplier", default=10, lo=1, hi=100000
        ),
        request_rate=rate,
        point_timeout_s=num_field(
            t, "benchmark.point_timeout_s", default=3600.0, lo=1.0, hi=604800.0
        ),
        result_format="inferencex" if fmt == "inferencex" else "vllm",
        validity=parse_validity(validity),
    )


def parse_validity(t: Mapping[str, object]) -> Validity:
    """Validate ``[benchmark.validity]`` (an empty table gives the defaults)."""
    check_keys("benchmark.validity", t, VALIDITY_KEYS)
    fld = "benchmark.validity.min_completed_fraction"
    frac = t.get("min_completed_fraction", 0.95)
    if (
        isinstance(frac, bool)
        or not isinstance(frac, int | float)
        or not math.isfinite(frac)
        or not 0 < frac <= 1
    ):
        raise SpecError(
            fld,
            shown(frac),
            "use a fraction of the requests sent, greater than 0 and at most 1 (default 0.95)",
        )
    min_out = t.get("min_output_tokens", 1)
    if isinstance(min_out, bool) or not isinstance(min_out, int) or min_out < 0:
        raise SpecError(
            "benchmark.validity.min_output_tokens",
            shown(min_out),
            "use an integer >= 0: the fewest output tokens a point must produce (default 1)",
        )
    max_failed = t.get("max_failed")
    if max_failed is not None and (
        isinstance(max_failed, bool)
        or not isinstance(max_failed, int)
        or not 0 <= max_failed <= MAX_PROMPTS
    ):
        raise SpecError(
            "benchmark.validity.max_failed",
            shown(max_failed),
            "use an integer >= 0 (failed requests a point may have), or leave it out to allow"
            " what min_completed_fraction leaves",
        )
    return Validity(
        min_completed_fraction=float(frac),
        min_output_tokens=min_out,
        max_failed=max_failed,
    )
