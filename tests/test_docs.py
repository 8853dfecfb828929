"""The docs cannot drift from the code: quoted error messages exist, every page is listed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from streamer_client import errors

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*(ROOT / "streamer_service").rglob("*.py"), *(ROOT / "client" / "streamer_client").rglob("*.py")]
PLACEHOLDER = re.compile(r"<[^<>]*>")
HOLE = "\0"  # where an f-string interpolates


def _literals() -> list[str]:
    """Every string literal of the packages, adjacent literals joined, f-string holes marked."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.JoinedStr):
                found.append("".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return found


def _quoted(page: str) -> list[str]:
    """The lines of the page's ```text blocks: the messages it quotes."""
    blocks = re.findall(r"```text\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


QUOTED = _quoted("troubleshooting.md")


def test_troubleshooting_quotes_messages():
    assert len(QUOTED) >= 15


@pytest.mark.parametrize("line", QUOTED)
def test_quoted_message_is_raised_by_the_code(line):
    match = re.fullmatch(r"([A-Z]\w+Error): (.*)", line)
    message = line
    if match:
        assert match.group(1) in errors.__all__, f"{match.group(1)} is not in streamer_client.errors"
        message = match.group(2)
    # Run:ai's own words come from libstreamer at run time, not from our code.
    message = message.replace("File access error (Run:ai FILE_ACCESS_ERROR)", "<Run:ai's description>")
    literals = _literals()
    for fragment in PLACEHOLDER.split(message):
        fragment = fragment.strip(" ;:()")
        if len(fragment) < 8:  # " of ", ": " and the like join placeholders in many messages
            continue
        assert any(fragment in literal for literal in literals), f"{fragment!r} is in no message of the code"


def test_readme_lists_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"`docs/{page.name}`" in readme, f"README's documentation list lacks docs/{page.name}"
