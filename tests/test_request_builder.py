"""The one request builder (request/builder.py): diffusers' aliases, conflicting values refused
naming both names, errors naming the field as the caller spelled it, one validated request.
No checkpoint: the front ends' use of it is covered by tests/serve, tests/api, tests/fleet."""

from __future__ import annotations

import pytest

from omniloop.request import (
    ALIASES, DiffusionParams, FieldError, Fields, ImagePart, OutputSpec, SamplingParams, TaskType, TextPart,
    build_request, generation_fields,
)
from omniloop.request.builder import aliases_of


def test_aliases_map_diffusers_names_to_ours():
    assert ALIASES["num_inference_steps"] == "steps" and ALIASES["guidance"] == "guidance_scale"
    fields = generation_fields({"num_inference_steps": 4, "guidance": 3.5, "seed": 1})
    assert fields.values == {"steps": 4, "guidance_scale": 3.5, "seed": 1}
    assert fields.names == {"steps": "num_inference_steps", "guidance_scale": "guidance", "seed": "seed"}
    assert aliases_of(("steps", "seed")) == {"num_inference_steps": "steps"}


def test_an_alias_agreeing_with_its_field_is_one_value():
    assert generation_fields({"steps": 4, "num_inference_steps": 4}).diffusion().steps == 4


@pytest.mark.parametrize("given", [{"steps": 2, "num_inference_steps": 3}, {"num_inference_steps": 3, "steps": 2}])
def test_conflicting_alias_is_refused_naming_both(given):
    # whatever the order given, the field's own name is the one at fault, the alias named beside it
    with pytest.raises(FieldError, match=r"^steps: 2 disagrees with num_inference_steps=3; pass one of them$") as e:
        generation_fields(given)
    assert e.value.field == "steps" and e.value.code == "invalid_value"


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown generation parameter\(s\) \['guidence_scale'\]; accepted: "
                                         r"\[.*'guidance_scale'"):
        generation_fields({"guidence_scale": 3.0})


def test_errors_name_the_field_as_the_caller_spelled_it():
    fields = Fields()
    fields.put_flat({"num_inference_steps": 0}, prefix="nvext.")
    with pytest.raises(FieldError, match=r"^nvext\.num_inference_steps: Input should be greater than or equal to 1"):
        build_request(TaskType.T2V, "a cat", fields)
    seconds = Fields()
    seconds.put_flat({"seconds": -1.0}, {"seconds": "duration_s"})
    with pytest.raises(FieldError, match=r"^seconds: Input should be greater than 0") as e:
        seconds.diffusion()
    assert e.value.field == "seconds"


@pytest.mark.parametrize("prompt,got", [("", "an empty string"), ("  ", "only whitespace")])
def test_the_prompt_rule_is_require_prompts(prompt, got):
    with pytest.raises(FieldError, match=rf"^prompt: pass a non-empty text prompt \(got {got}\)$"):
        build_request(TaskType.T2V, prompt)


def test_build_request_puts_prompt_parts_and_options_on_one_request():
    image = ImagePart(b64="aGk=", role="first_frame")
    fields = generation_fields({"num_inference_steps": 3, "height": 32, "width": 48})
    request = build_request("i2v", "a cat", fields, parts=[image], outputs=OutputSpec(stream=True),
                            node_params={"denoise": {"x": 1}}, request_id="r1", model="wan",
                            scheduling={"priority": 5})
    assert request.task is TaskType.I2V and request.request_id == "r1" and request.model == "wan"
    assert request.inputs == [TextPart(text="a cat"), image] and request.priority == 5
    assert request.diffusion == DiffusionParams(steps=3, height=32, width=48)
    assert request.outputs.stream and request.node_params == {"denoise": {"x": 1}}
    # already-built parameters pass through; a conversation brings its own text parts
    chat = build_request(TaskType.REASON, None, parts=[TextPart(text="hi", role="user")],
                         sampling=SamplingParams(max_tokens=4))
    assert chat.prompt == "hi" and chat.sampling.max_tokens == 4


def test_request_level_fields_are_checked_by_name():
    with pytest.raises(FieldError, match=r"^priority: Input should be less than or equal to 100"):
        build_request(TaskType.T2V, "a cat", scheduling={"priority": 1000})
    sampling = Fields()
    sampling.put_flat({"max_completion_tokens": 0}, {"max_completion_tokens": "max_tokens"})
    with pytest.raises(FieldError, match=r"^max_completion_tokens: Input should be greater than or equal to 1"):
        build_request(TaskType.REASON, "hi", sampling=sampling)


# -- loop knobs: a model's KnobTable, derived from its loops' schemas (no checkpoint needed) ------

def test_the_knob_table_routes_flat_knobs_to_their_nodes_and_refuses_others():
    from omniloop.pipeline.loops.denoise import DenoiseParams
    from omniloop.request import KnobTable, LoopKnob

    table = KnobTable("m", {"guidance_scale_2": (LoopKnob("denoise", "guidance_scale_2"),)}, {"denoise": DenoiseParams})
    fields = generation_fields({"num_inference_steps": 2, "guidance_scale_2": 3.0}, knobs=table)
    assert (fields.values, fields.knobs) == ({"steps": 2}, {"guidance_scale_2": 3.0})
    request = build_request(TaskType.T2V, "a cat", fields, node_params={"denoise": {"shift": 5.0}}, knobs=table)
    assert request.node_params == {"denoise": {"shift": 5.0, "guidance_scale_2": 3.0}}
    with pytest.raises(FieldError, match=r"^guidance_scale_2: 3.0 disagrees with node_params\['denoise'\]"
                                         r"\.guidance_scale_2=2.0; pass one of them$"):
        table.route({"guidance_scale_2": 3.0}, {"denoise": {"guidance_scale_2": 2.0}})
    with pytest.raises(FieldError, match=r"^guidance_scale_2: Input should be greater than or equal to 0"):
        table.route({"guidance_scale_2": -1.0})
    with pytest.raises(FieldError, match=r"^stg_scale: unknown generation parameter\(s\) \['stg_scale'\]: not a knob "
                                         r"of 'm''s loops \(its loop knobs: guidance_scale_2\)") as e:
        generation_fields({"stg_scale": 2.0}, knobs=table)
    assert e.value.fields == ("stg_scale",)


@pytest.mark.parametrize("name", ["guidance_scale_2", "first_chunk_guidance_scale", "first_chunk_steps"])
def test_a_loop_knob_that_was_a_shared_field_says_where_it_goes_now(name):
    with pytest.raises(ValueError, match=rf"{name} is the .* knob now, not a shared DiffusionParams field: pass it flat "
                                         rf"\(generate_video\({name}=...\), the wire field '{name}', the CLI's --knob "
                                         rf"{name}=...\) or in OmniRequest.node_params\[<loop node>\]"):
        DiffusionParams(**{name: 3})
