"""Text nodes of the LTX-2.3 templates: ``TextGenerateLTX2Prompt`` (the prompt rewritten by the
model's Gemma 3 text encoder run as a causal LM) and ``PreviewAny`` (a value displayed, nothing
saved), registered beside ``nodes.py``'s.

Behaviour read from ComfyUI's comfy_extras (nodes_textgen.py, nodes_preview_any.py), written
anew. The generated text is known only when the prompt runs, so it is a ``GeneratedText``
value: the ``CLIPTextEncode`` it reaches asks the LTX-2 pipeline's ``enhance_prompt`` node
(``families/ltx2/enhance.py``) to rewrite the prompt before encoding it."""

from __future__ import annotations

from typing import Any

from omniloop.workflows.errors import node_error
from omniloop.workflows.values import GeneratedText, Preview
from omniloop.workflows.vocabulary import NodeCall, i, node

# the dynamic combo's widgets when sampling is on (ComfyUI's order)
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "presence_penalty")


def _textgen_layout(values: list[Any]) -> list[str]:
    """``prompt, max_length, sampling_mode, [its widgets], thinking, use_default_template``; a
    front end that adds ``control_after_generate`` after the seed gives one value more."""
    if len(values) < 3 or values[2] != "on":
        return ["prompt", "max_length", "sampling_mode", "thinking", "use_default_template"]
    dynamic = [f"sampling_mode.{n}" for n in _SAMPLING]
    if len(values) == 13:
        dynamic.insert(6, "control_after_generate")
    return ["prompt", "max_length", "sampling_mode", *dynamic, "thinking", "use_default_template"]


@node("TextGenerateLTX2Prompt", [
    i("clip", "CLIP"), i("prompt", "STRING", "", multiline=True),
    i("image", "IMAGE", optional=True), i("video", "IMAGE", optional=True), i("audio", "AUDIO", optional=True),
    i("max_length", "INT", 512, min=1, max=32768),
    i("sampling_mode", "COMBO", "on", options=("on", "off")),
    i("sampling_mode.temperature", "FLOAT", 0.7, min=0.01, max=2.0, optional=True),
    i("sampling_mode.top_k", "INT", 64, min=0, max=1000, optional=True),
    i("sampling_mode.top_p", "FLOAT", 0.95, min=0.0, max=1.0, optional=True),
    i("sampling_mode.min_p", "FLOAT", 0.05, min=0.0, max=1.0, optional=True),
    i("sampling_mode.repetition_penalty", "FLOAT", 1.05, min=0.0, max=5.0, optional=True),
    i("sampling_mode.seed", "INT", 0, min=0, max=2**64 - 1, optional=True),
    i("sampling_mode.presence_penalty", "FLOAT", 0.0, min=0.0, max=5.0, optional=True),
    i("thinking", "BOOLEAN", False, optional=True), i("use_default_template", "BOOLEAN", True, optional=True),
], ["STRING"], output_names=("generated_text",), category="text", widget_layout=_textgen_layout)
def text_generate_ltx2_prompt(call: NodeCall) -> tuple[Any, ...]:
    """The prompt rewritten by the LTX-2 text encoder (Gemma 3) with Lightricks' system prompt."""
    prompt = call.get("prompt", "")
    if not isinstance(prompt, str) or not prompt.strip():
        raise node_error(call.id, call.class_type, "required_input_missing", "prompt: write the prompt to enhance",
                         "pass a non-empty prompt", "prompt")
    for name in ("video", "audio"):
        if call.get(name) is not None:
            raise node_error(call.id, call.class_type, "invalid_input_type", f"{name}: Gemma 3 reads text (and an "
                             "image) here; video and audio are not supported", f"disconnect {name}", name)
    deviations = []
    if call.get("image") is not None:
        deviations.append("image: the image-to-video system prompt is used, but the image itself is not shown to "
                          "Gemma (its vision tower does not run here)")
    if not call.get("use_default_template", True):
        deviations.append("use_default_template=false: the enhancement always uses its system prompt")
    sampling = call["sampling_mode"]
    params: dict[str, Any] = {"max_length": int(call["max_length"]), "sampling": sampling}
    if sampling == "on":
        for name in _SAMPLING:
            value = call.get(f"sampling_mode.{name}")
            if value is not None:
                params[name] = value
        deviations.append("sampling on: the tokens are drawn from our generator seeded with the node's seed (the "
                          "same distribution as ComfyUI, other draws); sampling_mode off is exact")
    return (GeneratedText(call.id, prompt, tuple(params.items()), call["clip"], tuple(deviations)),)


@node("PreviewAny", [i("source", "*")], ["STRING"], output_node=True, category="utils")
def preview_any(call: NodeCall) -> tuple[Any, ...]:
    """A value displayed (reported with the compiled workflow; generated text: the request's
    ``enhanced_prompt`` output), nothing saved."""
    value = call["source"]
    call.context.preview(Preview(call.id, value))
    return (value.prompt if isinstance(value, GeneratedText) else str(value),)
