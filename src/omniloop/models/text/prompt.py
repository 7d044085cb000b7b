"""Prompt normalization shared by text encoders (Wan's ``prompt_clean``)."""

from __future__ import annotations

import html
import re

try:  # ftfy repairs mojibake; Wan's reference pipeline runs it on every prompt.
    import ftfy
except ImportError:  # pragma: no cover - ftfy is a dependency; keep working without it
    ftfy = None


def clean_prompt(text: str) -> str:
    """ftfy fix, double HTML unescape, collapse whitespace (as Wan / diffusers do)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()
