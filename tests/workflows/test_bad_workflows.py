"""Bad workflows: each a WorkflowError in ComfyUI's shape naming the node, its class and
what to pass instead."""

from __future__ import annotations

import copy
import json

import pytest

from omniloop.workflows import ModelFolder, WorkflowError, compile_workflow

MODELS = ModelFolder.from_mapping({"served": {"img": {"path": "x"}},
                                   "files": {"checkpoints/model.safetensors": "img"}})
GOOD = {
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "model.safetensors"}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
    "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
    "3": {"class_type": "KSampler", "inputs": {"seed": 7, "steps": 3, "cfg": 4.0, "sampler_name": "euler",
                                               "scheduler": "simple", "denoise": 1.0, "model": ["4", 0],
                                               "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "out", "images": ["8", 0]}},
}


def edited(**changes):
    graph = copy.deepcopy(GOOD)
    for key, value in changes.items():
        node_id, _, name = key.partition("__")
        if name:
            graph[node_id]["inputs"][name] = value
        else:
            graph[node_id] = value
    return graph


def refused(graph, match):
    with pytest.raises(WorkflowError, match=match) as e:
        compile_workflow(graph, MODELS)
    return e.value.to_comfy()


def test_the_good_graph_compiles():
    request = compile_workflow(json.dumps(GOOD), MODELS).generations[0].request
    assert (request.prompt, request.diffusion.negative_prompt, request.diffusion.steps) == ("a red circle", "blurry", 3)
    assert (request.diffusion.width, request.diffusion.seed, request.model) == (64, 7, "img")


def test_not_json_and_not_a_graph():
    assert refused("{nope", "not JSON")["error"]["type"] == "invalid_prompt"
    refused("[1, 2]", "not a graph")
    refused({"1": {"inputs": {}}}, "no class_type")


def test_a_cycle_names_its_nodes():
    graph = edited(**{"6__clip": ["10", 0]}, **{"10": {"class_type": "ConditioningZeroOut",
                                                       "inputs": {"conditioning": ["6", 0]}}})
    refused(graph, "cycle: .*6 -> 10 -> 6|cycle: .*10 -> 6 -> 10")


def test_links_to_missing_nodes_and_outputs():
    body = refused(edited(**{"8__vae": ["99", 0]}), "links to node '99'")
    assert body["node_errors"]["8"]["class_type"] == "VAEDecode"
    body = refused(edited(**{"8__vae": ["4", 5]}), "has no output 5")
    assert body["node_errors"]["8"]["errors"][0]["extra_info"] == {"input_name": "vae"}


def test_a_type_mismatch_names_both_ends():
    body = refused(edited(**{"8__vae": ["4", 1]}), "expects VAE, node 4 .CheckpointLoaderSimple. output 1 is CLIP")
    assert body["node_errors"]["8"]["errors"][0]["type"] == "return_type_mismatch"


def test_an_unknown_class_is_refused_naming_what_is_supported():
    body = refused(edited(**{"10": {"class_type": "UpscaleModelLoader", "inputs": {}}}), "not supported")
    error = body["node_errors"]["10"]
    assert error["class_type"] == "UpscaleModelLoader" and "KSampler" in error["errors"][0]["details"]


def test_widget_values_out_of_range_or_of_the_wrong_type():
    body = refused(edited(**{"3__steps": 0}), "smaller than min")
    assert body["node_errors"]["3"]["errors"][0]["type"] == "value_smaller_than_min"
    refused(edited(**{"3__cfg": 1000.0}), "bigger than max")
    refused(edited(**{"3__steps": "many"}), "steps: pass a INT value")
    refused(edited(**{"3__sampler_name": "warp"}), "'warp' is not one of")


def test_model_names_must_be_in_the_folder_and_stay_inside_it():
    body = refused(edited(**{"4__ckpt_name": "other.safetensors"}), "'other.safetensors' not in checkpoints/")
    assert "model.safetensors" in body["node_errors"]["4"]["errors"][0]["details"]  # the files that exist
    refused(edited(**{"4__ckpt_name": "../secrets.safetensors"}), "leaves the model folder")


def test_a_required_input_missing_and_no_outputs():
    graph = edited()
    del graph["3"]["inputs"]["positive"]
    refused(graph, "Required input is missing: positive")
    refused({k: v for k, v in GOOD.items() if k != "9"}, "no outputs")


def test_an_empty_prompt_is_refused_at_the_sampler():
    body = refused(edited(**{"6__text": "  "}), "the prompt is empty")
    assert body["node_errors"]["3"]["class_type"] == "KSampler"


def test_a_ui_workflow_with_reroute_note_primitive_and_bypass():
    """UI format: links through a Reroute, a legacy PrimitiveNode feeding steps, a Note, and a
    bypassed ConditioningZeroOut passing its input through."""
    nodes = [
        {"id": 4, "type": "CheckpointLoaderSimple", "mode": 0, "widgets_values": ["model.safetensors"],
         "inputs": [], "outputs": [{"type": "MODEL"}, {"type": "CLIP"}, {"type": "VAE"}]},
        {"id": 5, "type": "EmptyLatentImage", "mode": 0, "widgets_values": [64, 48, 1]},
        {"id": 6, "type": "CLIPTextEncode", "mode": 0, "widgets_values": ["a red circle"],
         "inputs": [{"name": "clip", "type": "CLIP", "link": 1}]},
        {"id": 11, "type": "ConditioningZeroOut", "mode": 4, "inputs": [{"name": "conditioning", "type": "CONDITIONING", "link": 2}],
         "outputs": [{"type": "CONDITIONING"}]},
        {"id": 3, "type": "KSampler", "mode": 0, "widgets_values": [5, "randomize", 20, 3.0, "euler", "simple", 1.0],
         "inputs": [{"name": "model", "type": "MODEL", "link": 3}, {"name": "positive", "type": "CONDITIONING", "link": 4},
                    {"name": "negative", "type": "CONDITIONING", "link": 5}, {"name": "latent_image", "type": "LATENT", "link": 6},
                    {"name": "steps", "type": "INT", "widget": {"name": "steps"}, "link": 10}]},
        {"id": 12, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 7}], "outputs": [{"type": "VAE"}]},
        {"id": 8, "type": "VAEDecode", "mode": 0, "inputs": [{"name": "samples", "type": "LATENT", "link": 8},
                                                             {"name": "vae", "type": "VAE", "link": 9}]},
        {"id": 9, "type": "PreviewImage", "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 11}]},
        {"id": 13, "type": "PrimitiveNode", "mode": 0, "widgets_values": [6, "fixed"], "outputs": [{"type": "INT"}]},
        {"id": 14, "type": "Note", "mode": 0, "widgets_values": ["remember"]},
    ]
    links = [[1, 4, 1, 6, 0, "CLIP"], [2, 6, 0, 11, 0, "CONDITIONING"], [3, 4, 0, 3, 0, "MODEL"],
             [4, 6, 0, 3, 1, "CONDITIONING"], [5, 11, 0, 3, 2, "CONDITIONING"], [6, 5, 0, 3, 3, "LATENT"],
             [7, 4, 2, 12, 0, "VAE"], [8, 3, 0, 8, 0, "LATENT"], [9, 12, 0, 8, 1, "VAE"], [10, 13, 0, 3, 4, "INT"],
             [11, 8, 0, 9, 0, "IMAGE"]]
    result = compile_workflow({"nodes": nodes, "links": links, "version": 0.4}, MODELS)
    request = result.generations[0].request
    assert (request.diffusion.steps, request.diffusion.height, request.diffusion.seed) == (6, 48, 5)
    assert request.diffusion.negative_prompt == "a red circle"  # the bypassed zero-out passed its input on
    assert set(result.graph) == {"3", "4", "5", "6", "8", "9"}  # no reroute, note, primitive, bypassed node
    assert result.generations[0].saves[0].temporary  # PreviewImage
