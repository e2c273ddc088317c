"""dump_toml writes what decode_toml reads back unchanged (core.spec.toml_write)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd_supervisor.core.spec.runspec import load_spec, parse_spec
from llmd_supervisor.core.spec.toml_read import decode_toml
from llmd_supervisor.core.spec.toml_write import dump_toml

DEMO_TEXT = (Path(__file__).resolve().parents[2] / "deploy/llm-d/demo.toml").read_text()


def test_the_demo_spec_round_trips() -> None:
    data = decode_toml(DEMO_TEXT)
    text = dump_toml(data)
    assert decode_toml(text) == data
    assert load_spec(text) == parse_spec(data)
    # The array of tables keeps its section form.
    assert "[[router.process]]" in text
    assert "[benchmark.validity]" in text


@pytest.mark.parametrize(
    ("data", "text"),
    [
        ({"a": 1}, "a = 1\n"),
        ({"a": True, "b": False}, "a = true\nb = false\n"),
        ({"rate": math.inf, "low": -math.inf}, "rate = inf\nlow = -inf\n"),
        ({"x": 0.5}, "x = 0.5\n"),
        ({"s": 'say "hi"\n'}, 's = "say \\"hi\\"\\n"\n'),
        ({"s": "caf\u00e9 \U0001f600"}, 's = "caf\\u00e9 \\U0001f600"\n'),
        ({"s": "del\x7f"}, 's = "del\\u007f"\n'),
        ({"dotted.key": 1, "with space": 2}, '"dotted.key" = 1\n"with space" = 2\n'),
        ({"t": {}}, "[t]\n"),
        ({"l": [], "n": [[1, 2], ["a"]]}, 'l = []\nn = [[1, 2], ["a"]]\n'),
        ({"t": {"u": {"v": 1}}}, "[t]\n\n[t.u]\nv = 1\n"),
        ({"a": [{"x": 1}, {"x": 2}]}, "[[a]]\nx = 1\n\n[[a]]\nx = 2\n"),
        ({"m": [1, {"k": "v"}]}, 'm = [1, {k = "v"}]\n'),
    ],
)
def test_exact_text(data: dict[str, object], text: str) -> None:
    assert dump_toml(data) == text
    assert decode_toml(text) == data


def test_plain_keys_come_before_tables_whatever_the_order() -> None:
    data: dict[str, object] = {"t": {"x": 1}, "a": 2, "p": [{"y": 3}], "b": "z"}
    assert dump_toml(data) == 'a = 2\nb = "z"\n\n[t]\nx = 1\n\n[[p]]\ny = 3\n'
    assert decode_toml(dump_toml(data)) == data


def test_nan_round_trips_as_nan() -> None:
    back = decode_toml(dump_toml({"x": math.nan}))["x"]
    assert isinstance(back, float)
    assert math.isnan(back)


def test_sub_tables_of_table_array_elements() -> None:
    data: dict[str, object] = {
        "router": {"port": 8080, "process": [{"name": "a", "env": {"K": "v"}}, {"name": "b"}]}
    }
    text = dump_toml(data)
    assert "[router.process.env]" in text
    assert decode_toml(text) == data


@pytest.mark.parametrize("value", [object(), b"bytes", {1, 2}, "\ud800"])
def test_values_a_spec_cannot_hold_are_refused(value: object) -> None:
    with pytest.raises(TypeError):
        dump_toml({"x": value})


# Text without lone surrogates (not Unicode scalar values; decode_toml refuses them).
_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
_keys = _text.filter(bool)
_scalars = (
    _text
    | st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
)
_arrays = st.recursive(
    st.lists(_scalars, max_size=4), lambda inner: st.lists(inner, max_size=3), max_leaves=8
)
_tables: st.SearchStrategy[dict[str, object]] = st.recursive(
    st.dictionaries(_keys, _scalars | _arrays, max_size=4),
    lambda inner: st.dictionaries(
        _keys,
        _scalars | _arrays | inner | st.lists(inner, min_size=1, max_size=3),
        max_size=4,
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(_tables)
def test_generated_data_round_trips(data: dict[str, object]) -> None:
    assert decode_toml(dump_toml(data)) == data
