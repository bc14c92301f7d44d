"""`--help` tells each flag's default: its value where it has one, what happens where the value is chosen later."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_pic.launch_server import build_parser
from sglang_pic.server_args import ServerArgs, _arg
from sglang_pic.server_flags import flag_sections


def flag_helps() -> dict[str, str]:
    """Each flag's help text as --help prints it, with argparse's line wrapping undone."""
    return {a.dest: " ".join(a.help.split()) for a in build_parser()._actions if a.dest != "help"}


def test_help_never_shows_a_none_default():
    helps = flag_helps()
    assert "(default: None)" not in " ".join(build_parser().format_help().split())
    for f in dataclasses.fields(ServerArgs):
        if f.default is None:
            assert "default:" in helps[f.name] and "None" not in helps[f.name], f.name


def test_help_shows_real_defaults():
    helps = flag_helps()
    assert helps["port"].endswith("(default: 30000)")
    assert helps["mem_fraction_static"].endswith("(default: 0.85)")
    assert helps["ssep_marker"].endswith("(default: <|ssep|>)")
    assert "(default:" not in helps["disable_radix_cache"]  # an on/off flag is off unless given


def test_a_none_default_must_say_what_happens():
    with pytest.raises(ValueError, match="default: ..."):
        _arg(None, "The tokenizer folder.")


def test_help_groups_flags_by_section():
    """`--help` shows the sections of docs/server.md's flag table (both come from server_flags.flag_sections)."""
    sections = flag_sections()
    groups = {g.title: [a.dest for a in g._group_actions] for g in build_parser()._action_groups[2:]}
    assert list(groups) == list(dict.fromkeys(sections.values()))
    assert {dest: title for title, dests in groups.items() for dest in dests} == sections
    assert "Position-independent caching:" in build_parser().format_help()
