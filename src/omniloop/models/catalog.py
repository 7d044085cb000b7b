"""What this omniloop can load, read without importing torch or a family (``omniloop models``,
the CLI's checks before loading).

* The built-in models: name -> packaged directory (manifest layout, ``models/manifest.py``).
* Each built-in family's card: ``models/families/<name>/family.json`` declares the family's
  name and, per layout it loads, the ``model_index.json`` class names and a one-line
  description. It says what the family's ``ModelSpec`` registrations say (a test holds them
  equal); the card exists so that listing families does not import every family (and torch).
  Families from ``omniloop.families`` entry points have no card: they are listed by importing them.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from omniloop.models.families import CARD_FILE  # torch-free: json and pkgutil only
from omniloop.models.manifest import MANIFEST_FILE

DEFAULT_MODEL = "shapes-t2v"  # the embedded default: what --model / from_pretrained() mean when not given
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
# name -> packaged model directory (manifest layout). Trained by omniloop.train.recipes
# (docs/training.md); a directory holding only its manifest fails at load naming the missing file.
BUILTIN_MODELS: dict[str, Path] = {
    "shapes-t2v": BUILTIN_DIR / "shapes-t2v",
    "shapes-t2v-4step": BUILTIN_DIR / "shapes-t2v-4step",
}
# the interactive shapes world (causal, action-conditioned: sessions and /play), once its
# GPU-trained weights are installed (scripts/train_interactive.py install)
INTERACTIVE_MODEL = "shapes-interactive"
if (BUILTIN_DIR / INTERACTIVE_MODEL / MANIFEST_FILE).is_file():
    BUILTIN_MODELS[INTERACTIVE_MODEL] = BUILTIN_DIR / INTERACTIVE_MODEL

FAMILIES_DIR = Path(__file__).resolve().parent / "families"


def resolve_model_path(model: str | Path) -> Path:
    if isinstance(model, str) and model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]
    path = Path(model).expanduser()
    if not path.exists():
        names = sorted(BUILTIN_MODELS)
        # the one name it begins ("shapes-t2v-4" -> shapes-t2v-4step), else the nearest ("shapes" -> shapes-t2v)
        starts = [n for n in names if n.startswith(str(model))]
        guess = starts if len(starts) == 1 else difflib.get_close_matches(str(model), names, n=1, cutoff=0.6)
        raise FileNotFoundError(
            f"model {str(model)!r} is neither a directory nor a built-in model name"
            + (f" (built-in: {names})" if names else "") + (f"; did you mean {guess[0]!r}?" if guess else "")
        )
    if not path.is_dir():
        raise ValueError(f"model path {path} is a file; pass the checkpoint directory holding model_index.json")
    return path


@dataclass(frozen=True)
class LayoutCard:
    """One checkpoint layout a family loads: what one of its ``ModelSpec``\\ s declares."""

    family: str
    diffusers_classes: tuple[str, ...]  # model_index.json _class_name values ("omniloop:<family>": our manifest)
    description: str


def builtin_family_cards() -> list[LayoutCard]:
    """Every built-in family's layouts, from the ``family.json`` of each family folder."""
    cards = []
    for card_file in sorted(FAMILIES_DIR.glob(f"*/{CARD_FILE}")):
        data = json.loads(card_file.read_text())
        for layout in data["layouts"]:
            cards.append(LayoutCard(data["family"], tuple(layout["diffusers_classes"]), layout["description"]))
    return cards


def family_cards() -> list[LayoutCard]:
    """The built-in cards and, when ``omniloop.families`` entry points are installed, the
    layouts those plug-ins register (importing them: only then is torch loaded), sorted as
    ``registered_specs`` sorts (family, classes)."""
    from omniloop.models import families  # its discovery's view of the entry points (tests may replace it)

    cards = builtin_family_cards()
    if families.entry_points(group=families.ENTRY_POINT_GROUP):
        from omniloop.models.model_spec import registered_specs

        known = {c.diffusers_classes for c in cards}
        cards += [LayoutCard(s.family, s.diffusers_classes, s.description)
                  for s in registered_specs() if s.diffusers_classes not in known]
    return sorted(cards, key=lambda c: (c.family, c.diffusers_classes))
