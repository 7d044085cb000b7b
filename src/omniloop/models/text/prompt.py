"""Prompt normalization shared by text encoders (Wan's ``prompt_clean``)."""

from __future__ import annotations

import html
import re
from typing import Callable


def _ftfy_fix() -> Callable[[str], str] | None:
    """ftfy repairs mojibake; Wan's reference pipeline runs it on every prompt."""
    try:
        import ftfy
    except ImportError:  # pragma: no cover - ftfy is a dependency; keep working without it
        return None
    return ftfy.fix_text


_FIX_TEXT = _ftfy_fix()


def clean_prompt(text: str) -> str:
    """ftfy fix, double HTML unescape, collapse whitespace (as Wan / diffusers do)."""
    if _FIX_TEXT is not None:
        text = _FIX_TEXT(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()
