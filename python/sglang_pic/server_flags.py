"""How ServerArgs' fields become command-line flags and docs/server.md's table: each one's help with its default, and
the section the `# Section.` comment above it in ServerArgs names. `--help` and the docs table share them."""

from __future__ import annotations

import dataclasses
import inspect
import re

from sglang_pic.server_args import ServerArgs


def flag_help(f: dataclasses.Field) -> str:
    """A field's help with its default value appended, unless the help already says what the default is (every
    None default does) or the field is an on/off flag."""
    text = f.metadata.get("help", "")
    if "default:" in text or isinstance(f.default, bool) or f.default in (None, ""):
        return text
    return f"{text} (default: {f.default})"


FIRST_SECTION = "Model and API"


def flag_sections() -> dict[str, str]:
    """Field name -> its section: the `# Section.` comment above it in ServerArgs (FIRST_SECTION before the first
    one). It groups `--help` and the flag table of docs/server.md alike."""
    current, out = FIRST_SECTION, {}
    for line in inspect.getsource(ServerArgs).splitlines():
        comment = re.fullmatch(r"    # (.+)\.", line)
        field_line = re.match(r"    (\w+): ", line)
        if comment:
            current = comment.group(1)
        elif field_line:
            out[field_line.group(1)] = current
    return out
