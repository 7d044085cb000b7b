"""What an omni checkpoint folder (a transformers ``Qwen2_5OmniForConditionalGeneration`` /
``Qwen3OmniMoeForConditionalGeneration`` save) holds beside the weights, read the same way by
both families: the tokenizer, the processor's feature extractor and image processor, and the
thinker's sampling defaults. Each ``load_*`` has the ``WeightSpec.load`` signature."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.model_spec import LoadOptions

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
GENERATION_CONFIG_FILE = "generation_config.json"
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"  # the processor's WhisperFeatureExtractor (+ image keys)


def load_tokenizer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {root}: expected one of {list(TOKENIZER_FILES)} next to config.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def load_feature_extractor(root: Path, index: Mapping[str, Any], options: LoadOptions):
    """The processor's ``WhisperFeatureExtractor`` (``preprocessor_config.json``), or None: then
    audio inputs are refused at admission."""
    if not (root / PREPROCESSOR_CONFIG_FILE).is_file():
        return None
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(str(root))


def load_image_processor(root: Path, index: Mapping[str, Any], options: LoadOptions):
    """The processor's image processor (the ``Qwen2VLImageProcessor`` keys of ``preprocessor_config.json``),
    or None: then images are refused at admission."""
    path = root / PREPROCESSOR_CONFIG_FILE
    if not path.is_file() or "image_processor_type" not in json.loads(path.read_text()):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(root))


def load_generation(root: Path, index: Mapping[str, Any], options: LoadOptions) -> dict[str, Any]:
    """The thinker's sampling defaults from ``generation_config.json``: transformers samples
    only when it says ``do_sample: true`` (absent, its default is greedy)."""
    path = root / GENERATION_CONFIG_FILE
    gen: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if not gen.get("do_sample"):
        return {"temperature": 0.0}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if gen.get(k) is not None}
