"""LTX-2's prompt enhancement (ComfyUI ``TextGenerateLTX2Prompt``) on our loop: Gemma 3 as a
causal LM with its tied head. Oracle: transformers' ``Gemma3ForCausalLM.generate``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniloop.models.families.ltx2.enhance import EnhanceParams, LTX2PromptEnhance
from omniloop.models.families.ltx2.enhance_prompts import gemma3_chat
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import OmniRequest, TaskType, TextArtifact, TextPart

from tests.models.ltx2.checkpoint import tiny_tokenizer


@pytest.fixture(scope="module")
def lm_and_tokenizer(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tokenizer.model_max_length = 4096
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                              sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id)
    lm = Gemma3ForCausalLM(config).eval()
    return lm, tokenizer


def _run(lm, tokenizer, prompt: str, params: EnhanceParams, task=TaskType.T2V) -> TextArtifact:
    # the text encoder component as LTX-2 loads it from a ComfyUI file: Gemma3TextModel (no lm_head) + tokenizer
    encoder = SimpleNamespace(model=lm.model, tokenizer=tokenizer)
    stage = LTX2PromptEnhance()
    ctx = StageContext(node="enhance_prompt", components={"text_encoder": encoder}, device=torch.device("cpu"),
                       dtype=torch.float32)
    state = RequestState(request=OmniRequest(task=task, inputs=[TextPart(text=prompt)]),
                         node_params={"enhance_prompt": params})
    loop = stage.init(ctx, state)
    while not stage.step(ctx, loop).done:
        pass
    stage.finalize(ctx, loop, state)
    return state.artifacts["enhanced_prompt"]


@pytest.mark.parametrize("penalty", [1.0, 1.05])
def test_greedy_tokens_equal_transformers_generate(lm_and_tokenizer, penalty):
    lm, tokenizer = lm_and_tokenizer
    prompt = "a red circle moving right"
    out = _run(lm, tokenizer, prompt, EnhanceParams(sampling="off", max_length=24, repetition_penalty=penalty))
    ids = tokenizer(gemma3_chat(prompt, image=False), return_tensors="pt").input_ids
    ref = lm.generate(ids, do_sample=False, max_new_tokens=24, repetition_penalty=penalty, min_length=0)[0, ids.shape[1]:]
    ref_ids = [t for t in ref.tolist() if t != tokenizer.eos_token_id]
    assert len(out.token_ids) > 4 and out.token_ids == ref_ids
    assert out.text == tokenizer.decode(ref_ids, skip_special_tokens=True).strip()
    assert out.prompt_tokens == ids.shape[1]


def test_sampling_is_deterministic_at_a_seed(lm_and_tokenizer):
    lm, tokenizer = lm_and_tokenizer
    params = EnhanceParams(max_length=16, seed=7, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a, b = (_run(lm, tokenizer, "waves crash", params) for _ in range(2))
    c = _run(lm, tokenizer, "waves crash", params.model_copy(update={"seed": 8}))
    assert a.token_ids == b.token_ids and a.text == b.text
    assert c.token_ids != a.token_ids


def test_the_image_to_video_turn_uses_the_i2v_system_prompt():
    from diffusers.pipelines.ltx2.utils import I2V_DEFAULT_SYSTEM_PROMPT, T2V_DEFAULT_SYSTEM_PROMPT

    t2v, i2v = gemma3_chat("x", image=False), gemma3_chat("x", image=True)
    assert t2v.startswith("<start_of_turn>system\nYou are a Creative Assistant.")
    assert t2v.endswith("<start_of_turn>user\n\nUser Raw Input Prompt: x.<end_of_turn>\n<start_of_turn>model\n")
    # Lightricks' text (diffusers carries it line-wrapped): the same words in both layouts
    def words(text: str) -> list[str]:
        return text.replace("#### Example Input:", "#### Example\nInput:").replace("Output: Style", "Output:\nStyle").split()
    assert words(T2V_DEFAULT_SYSTEM_PROMPT) == words(t2v.split("system\n", 1)[1].split("<end_of_turn>")[0])
    i2v_system = i2v.split("system\n", 1)[1].split("<end_of_turn>")[0]
    assert words(I2V_DEFAULT_SYSTEM_PROMPT) == words(i2v_system.split("\n", 1)[1])


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        EnhanceParams(temperature=0.0)
    with pytest.raises(ValueError, match="sampling"):
        EnhanceParams(sampling="maybe")
