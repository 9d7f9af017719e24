"""Relative links in the project's Markdown: each must lead to a file that exists and, when it names a
heading (``file.md#anchor``), to a heading of that file, with the anchor GitHub makes from its title."""

from __future__ import annotations

import os
import re

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, colons...) dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The anchors of the headings of ``path``; a repeated title gets ``-1``, ``-2``... as on GitHub."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for line in FENCE.sub("", open(path).read()).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = _slug(match.group(1))
            found.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
            repeats[slug] = repeats.get(slug, 0) + 1
    return found


def broken_links(path: str) -> list[str]:
    """The relative links of the Markdown file ``path`` that lead nowhere."""
    broken = []
    for target in LINK.findall(FENCE.sub("", open(path).read())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(linked):
            broken.append(target)
        elif anchor and linked.endswith(".md") and anchor not in anchors(linked):
            broken.append(target)
    return broken
