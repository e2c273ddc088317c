"""The spec's ``[recipe]`` table: how a run is named in published numbers (pure, no I/O).

Nothing here changes what runs. These are the values InferenceX's aggregate carries
beside the measurements (``utils/process_result.py``; see
``tests/data/inferencex-agg/SOURCE.md``) that the rest of the spec cannot say: the
hardware, the framework, the precision, and each role's parallelism. All are optional;
what is not declared is null in ``results --format inferencex-agg`` (a role's TP defaults
to the GPUs of one of its workers, i.e. pure tensor parallelism)::

    [recipe]
    hw = "gb200"                 # InferenceX's runner type
    framework = "llmd-vllm"
    precision = "fp4"
    model_prefix = "dsv4"        # infmax_model_prefix
    image = "vllm/vllm-openai:v0.33.0"  # default container.image (pyxis runs a squash file)
    spec_decoding = "none"       # default "none"
    prefill_tp = 1               # default: the GPUs of one prefill worker
    prefill_ep = 8               # default 1
    prefill_dp_attention = true  # default false
    prefill_pp = 1               # default 1
    decode_tp = 8                # and decode_ep, decode_dp_attention, decode_pp
    kv_p2p_transfer = "nixl"     # only in the aggregate when declared
    router_name = "llm-d-router" # with router_version: the aggregate's router object
    router_version = "0.9.0"
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from llmd_supervisor.core.spec.container import IMAGE_RE
from llmd_supervisor.core.spec.fields import int_field, pattern_field
from llmd_supervisor.errors import SpecError

__all__ = ["RECIPE_KEYS", "Recipe", "RoleParallelism", "parse_recipe"]

# A label as InferenceX's configs spell them ("gb200", "llmd-vllm", "fp4", "0.9.0").
LABEL_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_ROLE_KEYS: Final = ("tp", "pp", "ep", "dp_attention")
RECIPE_KEYS: Final = (
    "hw",
    "framework",
    "precision",
    "model_prefix",
    "image",
    "spec_decoding",
    "kv_p2p_transfer",
    "router_name",
    "router_version",
    *(f"{role}_{key}" for role in ("prefill", "decode") for key in _ROLE_KEYS),
)
_HINT: Final = "use letters, digits and . _ + - (at most 64 characters), e.g. 'gb200'"


@dataclass(frozen=True)
class RoleParallelism:
    """One role's engine parallelism as declared (tp None: the GPUs of one worker)."""

    tp: int | None = None
    pp: int = 1
    ep: int = 1
    dp_attention: bool = False


@dataclass(frozen=True)
class Recipe:
    hw: str | None = None
    framework: str | None = None
    precision: str | None = None
    model_prefix: str | None = None
    image: str | None = None  # the published image name, when not container.image
    spec_decoding: str = "none"
    kv_p2p_transfer: str | None = None
    router_name: str | None = None
    router_version: str | None = None
    prefill: RoleParallelism = RoleParallelism()
    decode: RoleParallelism = RoleParallelism()


def _label(t: Mapping[str, object], key: str) -> str | None:
    return pattern_field(t, f"recipe.{key}", LABEL_RE, _HINT)


def _role(t: Mapping[str, object], role: str) -> RoleParallelism:
    tp = None
    if t.get(f"{role}_tp") is not None:
        tp = int_field(t, f"recipe.{role}_tp", lo=1, hi=4096)
    dp = t.get(f"{role}_dp_attention", False)
    if not isinstance(dp, bool):
        raise SpecError(f"recipe.{role}_dp_attention", dp, "use true or false (default false)")
    return RoleParallelism(
        tp=tp,
        pp=int_field(t, f"recipe.{role}_pp", default=1, lo=1, hi=4096),
        ep=int_field(t, f"recipe.{role}_ep", default=1, lo=1, hi=4096),
        dp_attention=dp,
    )


def parse_recipe(t: Mapping[str, object]) -> Recipe:
    """Validate the ``[recipe]`` table (keys already checked by the caller)."""
    name, version = _label(t, "router_name"), _label(t, "router_version")
    if (name is None) != (version is None):
        raise SpecError(
            "recipe.router_version" if name else "recipe.router_name",
            None,
            "give router_name and router_version together (InferenceX's router object has both)",
        )
    return Recipe(
        hw=_label(t, "hw"),
        framework=_label(t, "framework"),
        precision=_label(t, "precision"),
        model_prefix=_label(t, "model_prefix"),
        image=pattern_field(
            t, "recipe.image", IMAGE_RE, "use a registry reference like 'vllm/vllm-openai:v0.9'"
        ),
        spec_decoding=_label(t, "spec_decoding") or "none",
        kv_p2p_transfer=_label(t, "kv_p2p_transfer"),
        router_name=name,
        router_version=version,
        prefill=_role(t, "prefill"),
        decode=_role(t, "decode"),
    )
