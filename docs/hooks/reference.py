"""MkDocs hook: a reference page's ``<!-- generated: NAME -->`` line becomes what
service.reference builds from the code (the argument parsers, the metric registry, the store's
schema, the diagnosis parts, the environment variables), so the reference cannot drift."""

from __future__ import annotations

import re
from typing import Any

from service.reference import page

MARKER = re.compile(r"^<!-- generated: ([a-z]+) -->$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda m: page(m.group(1)), markdown)
