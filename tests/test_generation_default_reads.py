"""Below admission nothing reads a generation default (issue 28 item 1): the loops and stages
read the resolved request (its fields, its ``node_params`` as each node's ``resolve`` filled
them), never ``ctx.defaults.<generation default>``. A node's defaults reach it only through
``Stage.resolve(ctx, state, produced, defaults)`` at admission.

What a loop or stage may still read from its context's defaults are model facts, listed here
with why: none of them is a value a request sets."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "omniloop"
SCANNED = [*sorted((SRC / "pipeline" / "loops").glob("*.py")), *sorted((SRC / "pipeline" / "stages").glob("*.py")),
           *sorted((SRC / "models" / "families").glob("*/loop*.py")),
           *sorted((SRC / "models" / "families").glob("*/stages.py")),
           *sorted((SRC / "models" / "omni").glob("*.py"))]  # the omni families' shared thinker / talker loops

# ``ctx.defaults`` read -> why it is a model fact, not a request default
MODEL_FACTS = {
    # the checkpoint's stop tokens, served context, prefill chunk and KV block size (TextDefaults'
    # fields other than ``sampling``, which admission resolves: resolve_sampling / a node's resolve)
    "ctx.defaults.text_or_default()": "an AR loop's stop tokens and context are the checkpoint's",
    # the text encoder's token budget, read by cost estimates only (no request field sets it)
    "ctx.defaults.max_sequence_length": "the text encoder's token budget (cost estimates)",
    # LTX-2's refine node runs the distilled stage's own sigmas (STAGE_2_SIGMAS: part of the weights)
    "ctx.defaults.sigmas": "LTX-2's refine stage's distilled schedule",
    # LTX-2's re-compression of a conditioning image (the release's preprocessing, LTX-2.0 .. 2.3)
    "ctx.defaults.family_as(LTX2Defaults).image_crf": "LTX-2's conditioning-image preprocessing",
}
ALLOWED_FILES = {
    "ctx.defaults.text_or_default()": {"pipeline/loops/ar.py", "models/families/qwen2_5_omni/stages.py",
                                       "models/families/qwen3_omni/stages.py", "models/omni/thinker.py"},
    "ctx.defaults.max_sequence_length": {f"models/families/{f}/stages.py"
                                         for f in ("wan", "ltx2", "flux", "flux2", "far", "stable_audio")},
    "ctx.defaults.sigmas": {"models/families/ltx2/loop.py"},
    "ctx.defaults.family_as(LTX2Defaults).image_crf": {"models/families/ltx2/stages.py"},
}
READ = re.compile(r"ctx\.defaults\b(?:\.\w+(?:\([^()]*\))?)*")


def _reads() -> list[tuple[str, int, str]]:
    out = []
    for path in SCANNED:
        rel = path.relative_to(SRC).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in READ.finditer(code):
                out.append((rel, n, m.group(0)))
    return out


def _allowed(rel: str, expr: str) -> bool:
    return any(expr.startswith(fact) and rel in ALLOWED_FILES[fact] for fact in MODEL_FACTS)


def test_the_scan_covers_the_loops_and_stages():
    names = {p.relative_to(SRC).as_posix() for p in SCANNED}
    assert {"pipeline/loops/denoise.py", "pipeline/loops/chunk.py", "pipeline/stages/text.py",
            "models/families/ltx2/loop.py", "models/families/cosmos3/stages.py"} <= names
    assert _reads(), "the pattern finds the model-fact reads that remain"


def test_no_loop_or_stage_reads_a_generation_default():
    bad = [f"{rel}:{n}: {expr}" for rel, n, expr in _reads() if not _allowed(rel, expr)]
    assert not bad, ("loops and stages read the resolved request, not generation defaults (resolve them in the "
                     "node's Stage.resolve at admission):\n" + "\n".join(bad))


def test_a_text_loops_sampling_defaults_are_resolved_not_read():
    for path in SCANNED:
        assert "ctx.defaults.text_or_default().sampling" not in path.read_text(), (
            f"{path.relative_to(SRC)} reads TextDefaults.sampling below admission (resolve it in Stage.resolve)")
