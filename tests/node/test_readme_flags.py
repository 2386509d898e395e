"""README's inference-node flag table against `inference-node serve`: every flag it lists
exists among the operator's flags (`--help`, not the developer ones `--help-all` adds), reads
the environment variable it names and has the default it documents; the README points to
both listings for the rest. The max_tokens limits it describes are checked through gRPC in
tests/security/test_node_limits.py."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from inference_node.cli import serve_parser
from lora_common.envargs import env_name

README = Path(__file__).resolve().parents[2] / "README.md"
# Defaults written in words: what the parser holds for each.
WORDED_DEFAULTS = {"none": None, "unset": None, "off": False, "embedded smollm2": None, "caching on": True,
                   "tier on": True, "the host dialled": None}


def readme_rows() -> list[tuple[list[str], list[str], str]]:
    text = README.read_text()
    section = text.split("## inference-node flags", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `--") or len(cells) < 4:
            continue
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        envs = re.findall(r"`([A-Z0-9_]+)`", cells[1])
        rows.append((flags, envs, cells[2]))
    return rows


def serve_actions(show_hidden: bool = False) -> dict[str, argparse.Action]:
    """The serve command's flags: those `--help` lists, or with show_hidden every one."""
    return {flag: action for action in serve_parser(show_hidden)._actions for flag in action.option_strings
            if flag.startswith("--") and flag not in ("--help", "--help-all")
            and (show_hidden or action.help != argparse.SUPPRESS)}


def documented_default(cell: str) -> object:
    quoted = re.match(r"`([^`]*)`", cell)
    if quoted:
        return quoted.group(1)
    key = re.sub(r"\s*\(.*\)$", "", cell).lower()  # "unset (plaintext)": the word is the default
    assert key in WORDED_DEFAULTS, f"README default {cell!r} is neither `quoted` nor a known word"
    return WORDED_DEFAULTS[key]


def same_default(parsed: object, documented: object) -> bool:
    if documented is None or isinstance(documented, bool):
        return parsed is documented
    if isinstance(parsed, bool) or parsed is None:
        return False
    if isinstance(parsed, (int, float)):
        return float(parsed) == float(documented)
    return str(parsed) == documented


ROWS = readme_rows()


def test_the_table_is_found() -> None:
    assert len(ROWS) > 20


@pytest.mark.parametrize("flags, envs, default", ROWS, ids=[", ".join(r[0]) for r in ROWS])
def test_each_documented_flag_exists_with_its_env_and_default(flags, envs, default) -> None:
    actions = serve_actions()
    assert len(flags) == len(envs), f"{flags}: one env variable per flag"
    for flag, env in zip(flags, envs):
        assert flag in actions, f"README lists {flag}, which `inference-node serve` does not have"
        assert env == env_name(flag, "INFERENCE_NODE")
        assert env in actions[flag].help
        assert same_default(actions[flag].default, documented_default(default)), \
            f"{flag}: README says {default!r}, the parser's default is {actions[flag].default!r}"


def test_the_table_holds_operator_flags_and_points_to_both_listings() -> None:
    """A row for a developer option would put it back on the operator's page; the flags the
    table leaves out are one --help away."""
    documented = {flag for flags, _, _ in ROWS for flag in flags}
    assert documented <= set(serve_actions())
    text = README.read_text()
    assert "`inference-node serve --help`" in text and "`--help-all`" in text and "`--tune KEY=VALUE`" in text


def test_every_flag_has_help_text() -> None:
    for flag, action in serve_actions(show_hidden=True).items():
        assert action.help and not action.help.startswith(" ["), f"{flag} has no help text"
