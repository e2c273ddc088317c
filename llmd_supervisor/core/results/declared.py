"""What a benchmark result file says of its own deployment, in InferenceX's names (pure).

A job the daemon did not render (`submit --script`, `adopt`) has no run spec to say what
it measured. Its benchmark client can say it: ``vllm bench serve`` and InferenceX's
``benchmark_serving.py`` save every ``--metadata KEY=VALUE`` as a string key of the result
(``--metadata hw=h200 framework=vllm precision=fp8 isl=1024 osl=1024 prefill_tp=8
decode_tp=8 prefill_num_workers=2 decode_num_workers=1``), and both save the model they
asked for as ``model_id``, which is where InferenceX's aggregate takes its ``model`` from.
`declared` reads the keys named as InferenceX's aggregate names its deployment fields
(``utils/process_result.py``; ``tests/data/inferencex-agg/SOURCE.md``), each as the type
the aggregate has. A value of the wrong shape is not read: the field stays unknown, as
the file did not say it (it is the job's word on its deployment, not a measurement).
The GPUs of each role are `core.results.gpus.declared_roles`'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final, cast

from llmd_supervisor.core.results.gpus import RoleGpus

if TYPE_CHECKING:  # the result parser's child imports this module: it starts fast
    from llmd_supervisor.core.protocol.runs import DeclaredDeployment

__all__ = [
    "DECLARED_BOOLS",
    "DECLARED_INTS",
    "DECLARED_TEXTS",
    "Declared",
    "declared",
    "declared_again",
    "known_deployment",
]

# The deployment fields of InferenceX's aggregate a result file may declare, by type.
DECLARED_TEXTS: Final = (
    "hw",
    "image",
    "infmax_model_prefix",
    "framework",
    "precision",
    "spec_decoding",
    "recipe_fingerprint",
    "kv_p2p_transfer",
)
# "true" or "false", a string in the aggregate as InferenceX's *_DP_ATTN environment has it.
DECLARED_FLAG_TEXTS: Final = ("prefill_dp_attention", "decode_dp_attention")
DECLARED_BOOLS: Final = ("disagg", "is_multinode")
DECLARED_INTS: Final = (
    "isl",
    "osl",
    *(
        f"{role}_{key}"
        for role in ("prefill", "decode")
        for key in ("tp", "pp", "dcp_size", "pcp_size", "ep", "num_workers")
    ),
)
MODEL_KEY: Final = "model_id"  # the client's own key; the aggregate's `model`
TEXT_MAX: Final = 200
INT_MAX: Final = 1_000_000

Declared = tuple[tuple[str, str | int | bool], ...]  # (aggregate field, value), sorted


def declared(doc: Mapping[str, object]) -> Declared:
    """The deployment fields `doc` declares, with InferenceX's names and types, sorted by
    name; `model` from its ``model_id``."""
    readers: list[tuple[str, str, Callable[[object], str | int | bool | None]]] = [
        ("model", MODEL_KEY, _text),
        *((key, key, _text) for key in DECLARED_TEXTS),
        *((key, key, _flag_text) for key in DECLARED_FLAG_TEXTS),
        *((key, key, _flag) for key in DECLARED_BOOLS),
        *((key, key, _int) for key in DECLARED_INTS),
    ]
    got: dict[str, str | int | bool] = {}
    for field, key, read in readers:
        value = read(doc.get(key))
        if value is not None:
            got[field] = value
    return tuple(sorted(got.items()))


def _flag_text(value: object) -> str | None:
    flag = _flag(value)
    return None if flag is None else "true" if flag else "false"


def known_deployment(
    each: Iterable[Declared], roles: RoleGpus | None, nodes: int | None
) -> DeclaredDeployment:
    """A foreign job's deployment as far as it is known, in InferenceX's names: each field
    its result files (`each`, one per file) declare alike (one they declare differently
    is unknown); else `disagg` true when the roles' GPUs are known with a prefill GPU,
    and `is_multinode` whether the job had more than one of its `nodes` (None: unknown).
    Nothing else is guessed: what no one says is left out."""
    seen: dict[str, set[str | int | bool]] = {}
    for fields in each:
        for key, value in fields:
            seen.setdefault(key, set()).add(value)
    known: dict[str, str | int | bool] = {
        key: values.pop() for key, values in seen.items() if len(values) == 1
    }
    if "disagg" not in seen and roles is not None and roles.prefill >= 1:
        known["disagg"] = True
    if "is_multinode" not in seen and nodes:
        known["is_multinode"] = nodes > 1
    return cast("DeclaredDeployment", dict(sorted(known.items())))


def declared_again(value: object) -> Declared | None:
    """`declared`'s answer as JSON gives it back (pairs as lists), if it is one exactly:
    what `declared` makes of those fields again; None for anything else."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(pair, list | tuple) and len(pair) == 2 and isinstance(pair[0], str)
        for pair in value
    ):
        return None
    pairs = [(str(k), v) for k, v in value]
    doc = {(MODEL_KEY if k == "model" else k): v for k, v in pairs}
    again = declared(doc)
    return again if len(doc) == len(pairs) and list(again) == pairs else None


def _text(value: object) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= TEXT_MAX and value.isprintable():
        return value
    return None


def _flag(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def _int(value: object) -> int | None:
    if isinstance(value, str) and 0 < len(value) < 10 and value.isdigit() and value.isascii():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT_MAX:
        return None
    return value
