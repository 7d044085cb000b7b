"""Model families: one folder each, registering itself on import.

A family folder (``models/families/<name>/``) has fixed file roles: ``model.py`` (the
network), ``vae.py``, ``weights.py`` (checkpoint key mapping), ``spec.py`` (its
``ModelSpec`` registration), ``presets.py``. Its ``__init__.py`` imports ``spec`` so
importing the package registers the family; nothing outside the folder names it.

Families outside this package register through the ``omniloop.families`` entry-point
group: an entry point names a module (or an object in one) whose import calls
``register_model_spec``. ``discover_families`` imports both kinds once.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
from importlib.metadata import entry_points
from pathlib import Path

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omniloop.families"
CARD_FILE = "family.json"  # each built-in family's card (models/catalog.py reads it for listings)
_discovered = False


def import_family_of(class_name: str) -> bool:
    """Import only the built-in family whose card (``family.json``) lists ``class_name``;
    -> whether one does. Loading one checkpoint then imports one family, not all of them
    (Cosmos3's import alone pulls in torch._dynamo: seconds on a small CPU)."""
    for card in sorted(Path(__path__[0]).glob(f"*/{CARD_FILE}")):
        layouts = json.loads(card.read_text())["layouts"]
        if any(class_name in layout["diffusers_classes"] for layout in layouts):
            importlib.import_module(f"{__name__}.{card.parent.name}")
            return True
    return False


def discover_families() -> None:
    """Import every built-in family package and every ``omniloop.families`` entry point.

    A built-in family that fails to import is an error (it is part of this package); a
    third-party entry point that fails is logged and skipped, so one broken plug-in does
    not take the built-in families down with it.
    """
    global _discovered
    if _discovered:
        return
    _discovered = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception:
            logger.exception("family entry point %r (%s) failed to load; skipped", ep.name, ep.value)
