"""The documents say what the code does: the generated flag table, the README's program and its test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_flag_table_is_up_to_date():
    """docs/server.md's flag table is what scripts/gen_server_docs.py makes from ServerArgs."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_server_docs.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_readme_span_program_is_the_example_file():
    """The README shows examples/span_program.py (below its docstring), the program its first command runs."""
    shown = re.search(r"## Spans\n.*?```python\n(.*?)```", README, re.S).group(1)
    source = (ROOT / "examples" / "span_program.py").read_text()
    assert source.split('"""', 2)[2].lstrip("\n") == shown


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m pytest")]
    assert ci and ci[-1] in README
