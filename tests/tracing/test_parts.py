"""The parts registry is the one description of a part: the phase tables, the words and the
docs' table all come from it."""

from __future__ import annotations

from pathlib import Path

from tracing.diagnosis import DECODE_PARTS, TTFT_PARTS
from tracing.parts import BY_KEY, PARTS, docs_table
from tracing.words import WHAT

DOCS = Path(__file__).resolve().parents[2] / "docs" / "diagnosis.md"


def test_the_docs_table_is_the_registrys() -> None:
    text = DOCS.read_text()
    start = text.index("| part | TTFT | decode | from |")
    end = text.find("\n\n", start)
    assert text[start:end] == docs_table(), "regenerate it: python -m tracing.parts"
    for key in ("between_steps", "unattributed", "preempted"):
        assert f"| `{key}` |" in text[start:end]


def test_every_part_has_words_and_a_phase() -> None:
    assert set(WHAT) == set(BY_KEY)
    assert set(TTFT_PARTS) | set(DECODE_PARTS) == set(BY_KEY)
    for part in PARTS:
        assert part.phases, part.key
        assert part.what and part.source, part.key
    assert list(TTFT_PARTS)[-1] == list(DECODE_PARTS)[-1] == "unattributed"
