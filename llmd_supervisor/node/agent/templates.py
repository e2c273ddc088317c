"""Placeholders in the spec's commands and environment values (``{host_ip}``, ...)."""

from __future__ import annotations

import re
from typing import Any, Dict, Union

from .config import ConfigError

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([a-z_]+)\}|[{}]")


class Values(object):
    """Placeholder values; a callable one is computed when first looked up (so a node
    address is looked for only when a template names it)."""

    def __init__(self, values: Dict[str, Any]) -> None:
        self._values = values

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __getitem__(self, name: str) -> str:
        value = self._values[name]
        if callable(value):
            value = self._values[name] = str(value())
        return str(value)

    def get(self, name: str, default: str) -> str:
        return self[name] if name in self._values else default

    def update(self, more: Dict[str, Any]) -> None:
        self._values.update(more)


def expand_template(template: str, values: Union[Values, Dict[str, str]]) -> str:
    """Replace ``{name}`` by ``values[name]``; ``{{``/``}}`` are literal braces."""

    def repl(m: "re.Match[str]") -> str:
        tok = m.group(0)
        if tok == "{{":
            return "{"
        if tok == "}}":
            return "}"
        name = m.group(1)
        if name is None:
            raise ConfigError("stray brace in command template %r" % template)
        if name not in values:
            raise ConfigError("unknown placeholder {%s} in command template %r" % (name, template))
        return values[name]

    return _PLACEHOLDER.sub(repl, template)


def expand_known(text: str, values: Values) -> str:
    """Replace the known ``{name}`` placeholders in an environment value; everything else
    (JSON, other braces) stays as written."""
    return re.sub(r"\{([a-z_]+)\}", lambda m: values.get(m.group(1), m.group(0)), text)
