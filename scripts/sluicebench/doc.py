"""Rewriting the marked sections of docs/benchmark-runs.md.

A section is the lines between a start and an end marker line (HTML comments, invisible in the
rendered Markdown). Everything outside the markers is left byte for byte as it was.
"""

from __future__ import annotations

from pathlib import Path


def section(doc: Path, start: str, end: str) -> str | None:
    """The text between the markers (without them), or None if they are not there."""
    if not doc.exists():
        return None
    lines = doc.read_text().split("\n")
    try:
        i = lines.index(start)
        j = lines.index(end, i + 1)
    except ValueError:
        return None
    return "\n".join(lines[i + 1:j])


def replace_section(doc: Path, start: str, end: str, body: str) -> None:
    """Puts BODY between the markers, adding the markers at the end of DOC if missing."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else "# Benchmark runs\n"
    lines = text.split("\n")
    if start not in lines or end not in lines[lines.index(start) + 1:]:
        if lines and lines[-1] == "":
            lines.pop()
        lines += ["", start, end, ""]
    i = lines.index(start)
    j = lines.index(end, i + 1)
    lines[i + 1:j] = body.rstrip("\n").split("\n")
    # Written in place (not renamed over), like the shell scripts did, so the file keeps its
    # inode and permissions.
    doc.write_text("\n".join(lines))
