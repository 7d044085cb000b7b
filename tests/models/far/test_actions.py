"""Action-conditioned FAR (the interactive shapes-world model): the checkpoint round trip,
actions reaching a chunk's denoise forward (and only it) through ``ChunkModel.action_kwargs``,
sessions steered by ``Engine.send(ActionPart)``, the vocabulary in the pipeline defaults, and
bad actions refused with the vocabulary named."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

import pytest
import torch

from omniloop.cache.chunk_kv import ChunkKVBatch, ChunkKVHandle, ChunkKVPool, KVSegment, SlabLayout, TierPolicy
from omniloop.engine import Engine
from omniloop.eval.shapes_actions import ACTION_NAMES
from omniloop.models.families.far.model import COMPRESSED, FULL, FARConfig
from omniloop.models.families.far.weights import WEIGHTS_INDEX_FILE, load_far_dit
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import ActionPart
from omniloop.train.recipes.far_checkpoint import save_far_dit
from omniloop.train.recipes.interactive import run_sessions, session_request, validation_clips
from tests.models.far.checkpoint import tiny_far_transformer
from tests.models.far.interactive_checkpoint import SIZE, save_interactive_checkpoint, tiny_action_far

CPU = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def interactive_dir(tmp_path_factory):
    return save_interactive_checkpoint(tmp_path_factory.mktemp("interactive"))


@pytest.fixture(scope="module")
def pipeline(interactive_dir):
    return load_pipeline(interactive_dir, CPU)[1]


def _kv(model, rows: int = 1) -> tuple[ChunkKVBatch, list[ChunkKVHandle]]:
    cfg = model.config
    layouts = {t: SlabLayout(cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim,
                             cfg.tokens_per_frame(t, 8, 8), torch.float32) for t in (FULL, COMPRESSED)}
    pool = ChunkKVPool(1 << 26, "cpu")
    handles = [ChunkKVHandle(pool, layouts, {t: TierPolicy() for t in layouts}, ("cond",)) for _ in range(rows)]
    return handles, layouts  # type: ignore[return-value]


def test_save_far_dit_round_trips_and_a_plain_far_stays_a_diffusers_checkpoint(tmp_path):
    from diffusers import AnyFlowFARTransformer3DModel

    model = tiny_action_far()
    for name, shard in (("a", None), ("sharded", 60_000)):  # sharded: diffusers' index layout (153 KB here)
        folder = save_far_dit(model, tmp_path / name, max_shard_bytes=shard)
        files = list(folder.glob("*.safetensors"))
        assert len(files) == 1 if shard is None else (len(files) >= 3 and (folder / WEIGHTS_INDEX_FILE).is_file())
        load = load_far_dit(folder, dtype=torch.float32)
        assert load.config.action_vocab == ACTION_NAMES
        for (k, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(load.state_dict().items())):
            assert torch.equal(a, b), k
    theirs = tiny_far_transformer(seed=4)
    from omniloop.models.families.far.weights import far_state_dict_from_diffusers
    from omniloop.models.families.far.model import FARDiT

    cfg = {k: v for k, v in theirs.config.items() if not k.startswith("_")}
    plain = FARDiT(FARConfig(**cfg))
    plain.load_state_dict(far_state_dict_from_diffusers(theirs.state_dict()))
    folder = save_far_dit(plain, tmp_path / "plain")
    assert "action_vocab" not in json.loads((folder / "config.json").read_text())
    back = AnyFlowFARTransformer3DModel.from_pretrained(folder)  # diffusers reads what we wrote
    for k, v in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_an_action_changes_a_denoise_forward_and_no_action_leaves_the_model_as_it_was():
    model = tiny_action_far()
    torch.manual_seed(0)
    x, text = torch.randn(1, 16, 1, 8, 8), torch.randn(1, 5, 384)
    t = torch.full((1, 1), 500.0, dtype=torch.float64)
    handles, _ = _kv(model)
    seg = KVSegment(FULL, 0, 0, 1)
    out = {}
    for name in ("left", "right", None):
        action = None if name is None else torch.tensor([ACTION_NAMES.index(name)])
        out[name] = model(x, t, t, text, kv=ChunkKVBatch([(handles[0], "cond")], (), (seg,), write=False), action=action)
    assert (out["left"] - out["right"]).abs().max() > 1e-3  # the action reaches the chunk
    with torch.no_grad():
        model.action_embedder.weight.zero_()
    zero = model(x, t, t, text, kv=ChunkKVBatch([(handles[0], "cond")], (), (seg,), write=False),
                 action=torch.tensor([0]))
    assert torch.equal(zero, out[None])  # a zero embedding is exactly the action-free model


def test_the_pipeline_lists_the_vocabulary_and_refuses_an_unknown_action(pipeline):
    assert sorted(pipeline.defaults.actions) == sorted(ACTION_NAMES)
    model = pipeline.spec.nodes[-1].stage.model
    ctx = pipeline.contexts["rollout"]
    with pytest.raises(ValueError, match=r"unknown action 'jump'; this model's actions: \['left'"):
        model.action_kwargs(ctx, ActionPart(name="jump", values=[[0.0]]))
    assert model.action_kwargs(ctx, None)["action"].tolist() == [ACTION_NAMES.index("stay")]


def _steered(clip, actions):
    return dataclasses.replace(clip, actions=actions)


def test_sessions_take_actions_chunk_by_chunk(pipeline):
    """Two sessions, same prompt and seed, steered apart at chunk 2: chunks 0-1 (frames 0-4)
    are equal, chunk 2 (frames 5-8) differs -- each action reached its own chunk."""
    clips, prompts = validation_clips(1, 3)
    va = run_sessions(pipeline, [_steered(clips[0], ("left", "left"))], prompts, steps=1, size=SIZE, seed=5)[0]
    vb = run_sessions(pipeline, [_steered(clips[0], ("left", "right"))], prompts, steps=1, size=SIZE, seed=5)[0]
    assert va.shape == vb.shape == (9, SIZE, SIZE, 3)
    assert np.array_equal(va[:5], vb[:5])
    assert np.abs(va[5:].astype(int) - vb[5:].astype(int)).max() > 0


def test_a_session_request_is_an_open_ended_rollout_with_max_chunks(pipeline):
    engine = Engine(pipeline)
    rid = engine.add_request(session_request("a red circle", 1, 2, steps=1, size=SIZE, rid="s1"))
    engine.send(rid, ActionPart(name="up", values=[[0.0]]))
    out = engine.run_until_done(rid)
    assert out.status.value == "completed", out.error
