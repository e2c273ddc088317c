"""README.md is run, not read: every fenced block in it is checked against the code.

- Every ```toml block is parsed and validated by the loader of each kind of file it can be
  part of, decided by its top-level keys: the daemon's config (`load_config`; a fragment
  is a config of its own, the rest at their defaults), a run spec (`parse_spec`; a
  fragment's tables replace the demo spec's, deploy/llm-d/demo.toml) and a campaign file
  (`parse_campaign`, then expanded as the daemon expands it; a fragment is added to a
  campaign over the demo spec). A block that fits none fails, so a new kind of block
  cannot slip through unchecked.
- Every ```sh block's `llmd-supervisor ...` line parses with the CLI's own argparse
  parser, in every form its synopsis allows (each `[optional]` part, each `a|b`
  alternative); placeholders (RUN, SPEC.toml, N) stand as values. Every `deploy/...` or
  `tests/...` script it names exists, is executable and knows each `--option` given to it.
- A block of another language fails: the test would not know how to run it.
"""

from __future__ import annotations

import argparse
import copy
import re
import shlex
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmd_supervisor.cli.main import build_parser
from llmd_supervisor.core import config as daemon_config
from llmd_supervisor.core.campaign.expand import (
    CAMPAIGN_KEYS,
    expand,
    expand_script,
    parse_campaign,
)
from llmd_supervisor.core.spec.runspec import SPEC_FIELDS, parse_spec
from tests.devcluster import REPO

README = REPO / "README.md"
LLM_D = REPO / "deploy" / "llm-d"
DEMO_SPEC = LLM_D / "demo.toml"
# ```text blocks are output shown, not run; ``` with no language likewise.
LANGUAGES = ("toml", "sh", "")
# What a script campaign's block stands on: a batch script of its own (the README's
# campaign names InferenceX's job.slurm, beside the campaign file).
STUB_SCRIPT = "#!/bin/bash\nsrun true\n"


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    def __str__(self) -> str:
        return f"README.md line {self.line} (```{self.lang})"


def blocks() -> list[Block]:
    found, lines = [], README.read_text().splitlines(keepends=True)
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"README.md line {i + 1}: a fence that is never closed"
        found.append(Block(i + 1, fence.group(1), "".join(lines[i + 1 : end])))
        i = end + 1
    return found


def of(lang: str) -> list[Block]:
    return [b for b in blocks() if b.lang == lang]


def ids(bs: list[Block]) -> list[str]:
    return [f"line{b.line}" for b in bs]


def test_every_block_is_of_a_language_this_test_checks() -> None:
    unknown = [str(b) for b in blocks() if b.lang not in LANGUAGES]
    assert not unknown, f"teach tests/unit/test_readme.py to check these: {unknown}"
    assert len(of("toml")) >= 8 and len(of("sh")) >= 15  # the walk found the blocks


# --- TOML ---------------------------------------------------------------------------------


def _as_config(block: Block, data: Mapping[str, object]) -> None:
    """The block is a daemon config (its absent tables at their defaults)."""
    daemon_config.load_config(block.text, source=str(block))


def _as_spec(block: Block, data: Mapping[str, object]) -> None:
    """The block's tables, in place of the demo spec's, make a valid run spec."""
    spec = dict(tomllib.loads(DEMO_SPEC.read_text()))
    spec.update(copy.deepcopy(dict(data)))
    parse_spec(spec)


def _as_campaign(block: Block, data: Mapping[str, object], tmp_path: Path) -> None:
    """The block is a campaign file (or, without base or script, part of one over the
    demo spec), and it expands as the daemon expands it."""
    text = block.text
    if "base" not in data and "script" not in data:
        text = f'base = "{DEMO_SPEC.name}"\n{text}'
    campaign = parse_campaign(text, default_name="readme")
    if campaign.script is None:
        assert campaign.base is not None
        base = tomllib.loads((LLM_D / campaign.base).read_text())  # as the README says
        expansion = expand(campaign, base)
    else:
        (tmp_path / campaign.script).write_text(STUB_SCRIPT)
        expansion = expand_script(
            campaign, STUB_SCRIPT, script_name=campaign.script, campaign_dir=str(tmp_path)
        )
    assert expansion.jobs, f"{block}: the campaign expands to no job"


CONFIG_KEYS = frozenset(daemon_config._TOP)  # the loader's own list of tables
SPEC_KEYS = frozenset(SPEC_FIELDS)
CAMPAIGN_FILE_KEYS = frozenset(CAMPAIGN_KEYS)


def kinds(data: Mapping[str, object]) -> list[str]:
    """Every kind of file a block with these top-level keys can be (part of)."""
    keys = set(data)
    fits = [("config", CONFIG_KEYS), ("spec", SPEC_KEYS), ("campaign", CAMPAIGN_FILE_KEYS)]
    return [name for name, allowed in fits if keys <= allowed]


@pytest.mark.parametrize("block", of("toml"), ids=ids(of("toml")))
def test_toml_block_is_valid_for_every_file_it_can_be_part_of(block: Block, tmp_path: Path) -> None:
    data = tomllib.loads(block.text)
    found = kinds(data)
    assert found, (
        f"{block}: top-level keys {sorted(data)} fit neither the daemon config"
        f" ({sorted(CONFIG_KEYS)}), a run spec ({sorted(SPEC_KEYS)}) nor a campaign file"
        f" ({sorted(CAMPAIGN_FILE_KEYS)})"
    )
    for kind in found:
        try:
            if kind == "config":
                _as_config(block, data)
            elif kind == "spec":
                _as_spec(block, data)
            else:
                _as_campaign(block, data, tmp_path)
        except Exception as exc:  # any refusal fails the README, naming the block
            pytest.fail(f"{block} as a {kind} file: {type(exc).__name__}: {exc}")


def test_a_block_of_no_known_file_is_refused() -> None:
    """The walk above cannot wave a new kind of block through."""
    assert kinds({"dashboard": {}}) == ["config"]
    assert kinds({"recipe": {}}) == ["spec"]
    assert kinds({"notify": {}}) == ["spec", "campaign"]
    assert kinds({"name": "x", "base": "demo.toml", "matrix": {}}) == ["campaign"]
    assert kinds({"recipe": {}, "journal": {}}) == []
    assert kinds({"nonsense": {}}) == []


# --- shell --------------------------------------------------------------------------------

SCRIPT = re.compile(r"(?<![\w./-])((?:deploy|tests)/[\w./-]*[\w-])")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # N, S, PCT: a typed option's stand-in value
UNTYPED = (None, str, Path)  # options whose placeholder value stands as it is


def logical_lines(text: str) -> Iterator[str]:
    """A block's command lines: backslash continuations and a synopsis's indented
    `[--option ...]` lines joined to their command; comment lines dropped."""
    out: list[str] = []
    pending = False
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if out and (pending or (raw[:1].isspace() and stripped[:1] in "[-")):
            out[-1] += " " + stripped.rstrip("\\").strip()
        else:
            out.append(stripped.rstrip("\\").strip())
        pending = stripped.endswith("\\")
    yield from out


@dataclass(frozen=True)
class Group:
    alternatives: tuple[tuple[str, ...], ...]  # `[a | b c]`: ("a",), ("b", "c")


Item = str | Group


def synopsis_items(words: list[str]) -> list[Item]:
    """Words with `[...]` parts as groups (`|` separating their alternatives); `...`
    (more of the same) dropped."""
    items: list[Item] = []
    group: list[list[str]] | None = None
    for word in words:
        if group is None and word.startswith("["):
            group, word = [[]], word[1:]
        if group is None:
            if word != "...":
                items.append(word)
            continue
        closes = word.endswith("]")
        word = word[:-1] if closes else word
        if word == "...":
            pass
        elif word == "|":
            group.append([])
        elif word:
            group[-1].append(word)
        if closes:
            items.append(Group(tuple(tuple(a) for a in group)))
            group = None
    assert group is None, f"an unclosed [ in {' '.join(words)}"
    return items


def forms(items: list[Item]) -> list[list[str]]:
    """The command lines a synopsis stands for: without any optional part, then with each
    optional alternative alone; each `a|b` word's every choice."""

    def line(chosen: Mapping[int, tuple[str, ...]], picks: Mapping[int, str]) -> list[str]:
        out: list[str] = []
        for i, item in enumerate(items):
            if isinstance(item, Group):
                out += chosen.get(i, ())
            else:
                out.append(picks.get(i, item.split("|")[0]))
        return out

    result = [line({}, {})]
    for i, item in enumerate(items):
        if isinstance(item, Group):
            result += [line({i: alt}, {}) for alt in item.alternatives]
        elif "|" in item:
            result += [line({}, {i: choice}) for choice in item.split("|")[1:]]
    return result


def commands(text: str) -> Iterator[list[str]]:
    """Each command line of a block as words, `cmd a | cmd b` as two (a pipe into another
    program keeps its first part only)."""
    for logical in logical_lines(text):
        words = shlex.split(logical, comments=True)
        part: list[str] = []
        depth = 0
        for word in words:
            depth += word.count("[") - word.count("]")
            if word == "|" and depth == 0:
                yield part
                part = []
            else:
                part.append(word)
        yield part


def _choices(parser: argparse.ArgumentParser) -> Mapping[str, argparse.ArgumentParser]:
    """A parser's subcommands by name ({} for a leaf)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subs[0].choices if subs else {}


def _subparser(words: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command `words` start with."""
    parser = build_parser()
    for word in words:
        if word not in _choices(parser):
            break
        parser = _choices(parser)[word]
    return parser


def with_values(argv: list[str]) -> list[str]:
    """`argv` with a placeholder value of a typed option (`--rank N`, `--max-regression
    PCT`) made a number."""
    options = {s: a for a in _subparser(argv)._actions for s in a.option_strings}
    out = list(argv)
    for i in range(1, len(out)):
        action = options.get(out[i - 1])
        typed = action is not None and action.type not in UNTYPED
        if typed and PLACEHOLDER.fullmatch(out[i]):
            out[i] = "1"
    return out


def cli_lines() -> list[tuple[Block, list[str]]]:
    found = []
    top = set(_choices(build_parser()))
    for block in of("sh"):
        for words in commands(block.text):
            while words[:1] == ["sudo"]:  # sudo -u USER llmd-supervisor ...
                words = words[3:] if words[1:2] == ["-u"] else words[1:]
            if words[:1] == ["llmd-supervisor"]:
                found.append((block, words[1:]))
            elif words[:1] and words[0] in top:  # `nodes [--json] | nodes release NODE`
                found.append((block, words))
    return found


@pytest.mark.parametrize(
    ("block", "words"),
    cli_lines(),
    ids=[f"line{b.line}-{'_'.join(w[:2])}" for b, w in cli_lines()],
)
def test_every_llmd_supervisor_line_parses_in_every_form(
    block: Block, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for form in forms(synopsis_items(words)):
        argv = with_values(form)
        if argv[:1] == ["submit"] and "--" in argv:  # sbatch's own, as main() cuts them
            argv = argv[: argv.index("--")]
        try:
            build_parser(argv[0]).parse_args(argv)
        except SystemExit:
            err = capsys.readouterr().err.strip().splitlines()[-1:]
            pytest.fail(f"{block}: `llmd-supervisor {' '.join(form)}` does not parse: {err}")


def test_the_synopsis_reader_sees_options_alternatives_and_pipes() -> None:
    items = synopsis_items(["results", "RUN", "[RUN", "...]", "[--json", "|", "--csv]"])
    assert forms(items) == [
        ["results", "RUN"],
        ["results", "RUN", "RUN"],
        ["results", "RUN", "--json"],
        ["results", "RUN", "--csv"],
    ]
    assert forms(synopsis_items(["campaign", "status|wait", "ID"])) == [
        ["campaign", "status", "ID"],
        ["campaign", "wait", "ID"],
    ]
    assert list(commands("llmd-supervisor nodes [--json] | nodes release NODE  # x\n")) == [
        ["llmd-supervisor", "nodes", "[--json]"],
        ["nodes", "release", "NODE"],
    ]
    joined = list(logical_lines("a b \\\n    c\n  # comment\nx [--y]\n    [--z N]\n"))
    assert joined == ["a b c", "x [--y] [--z N]"]
    assert with_values(["logs", "RUN", "--rank", "N"]) == ["logs", "RUN", "--rank", "1"]


def test_the_walk_finds_the_readmes_commands() -> None:
    """The CLI lines the walk found include the main usage block's (it found the block)."""
    seen = {tuple(w[:2]) for _, w in cli_lines()}
    for expected in (("submit", "SPEC.toml"), ("campaign", "submit"), ("journal", "migrate")):
        assert expected in seen, seen


def scripts() -> list[tuple[Block, str, list[str]]]:
    """Each deploy/ or tests/ script a block runs, with the options given to it."""
    found = []
    for block in of("sh"):
        for words in commands(block.text):
            for i, word in enumerate(words):
                for name in SCRIPT.findall(word):
                    options = []
                    for later in words[i + 1 :]:
                        if SCRIPT.search(later) or later in (";", "&&", "||"):
                            break
                        option = later.strip("[]").split("=")[0]
                        if option.startswith("--"):
                            options.append(option)
                    found.append((block, name, options))
    return found


@pytest.mark.parametrize(
    ("block", "name", "options"), scripts(), ids=[f"line{b.line}-{n}" for b, n, _ in scripts()]
)
def test_every_script_named_exists_is_executable_and_takes_its_options(
    block: Block, name: str, options: list[str]
) -> None:
    path = REPO / name
    assert path.is_file(), f"{block}: {name} does not exist"
    assert path.stat().st_mode & 0o111, f"{block}: {name} is not executable"
    text = path.read_text()
    for option in options:
        assert option in text, f"{block}: {name} does not know {option}"


def test_every_client_command_takes_json_and_socket() -> None:
    """README, Using it: "Every client command takes `--json` and `--socket`"."""
    assert "Every client command takes `--json` and `--socket`" in README.read_text()
    missing = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for word, child in _choices(parser).items():
            walk(child, f"{name} {word}".strip())
        if not _choices(parser):
            options = {s for a in parser._actions for s in a.option_strings}
            if "--socket" in options and "--json" not in options:
                missing.append(name)

    walk(build_parser(), "")
    assert not missing, f"client commands without --json: {missing}"
