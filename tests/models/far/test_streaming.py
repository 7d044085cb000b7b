"""Streaming decode: a causal rollout's chunks, decoded one by one with the request's own VAE
cache, are exactly the whole clip's decode; the emitted chunks are the final video."""

from __future__ import annotations

import torch

from omniloop.api.generator import VideoGenerator
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.pipeline.stages.decode import StreamingVAEDecode, latents_to_unit_range, to_uint8_frames
from omniloop.request import (ArtifactEvent, DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart,
                              VideoChunkArtifact)


class _Ctx:
    def __init__(self, vae):
        self.vae = vae

    def component(self, name):
        return self.vae


def test_chunk_by_chunk_decode_equals_the_whole_clip_and_streams_do_not_share_state(far_dir):
    vae = load_wan_vae(far_dir / "vae", device="cpu", dtype=torch.float32)
    decoder, ctx = StreamingVAEDecode(), _Ctx(vae)
    gen = torch.Generator().manual_seed(0)
    clips = [torch.randn(1, vae.config.z_dim, 5, 4, 8, generator=gen) for _ in range(2)]
    whole = [latents_to_unit_range(vae, z) for z in clips]  # [1, 3, 17, 32, 64]
    streams = [decoder.init(ctx) for _ in clips]
    parts: list[list[torch.Tensor]] = [[], []]
    for start, stop in ((0, 1), (1, 3), (3, 5)):  # chunks of the two requests, interleaved
        for i, z in enumerate(clips):
            parts[i].append(decoder.decode_unit(ctx, streams[i], z[:, :, start:stop]))
    for i in range(2):
        streamed = torch.cat(parts[i], dim=2)
        assert torch.equal(streamed, whole[i])  # bit for bit
        assert torch.equal(to_uint8_frames(streamed[0]), to_uint8_frames(whole[i][0]))


def test_emitted_chunks_are_the_final_video(far_dir):
    generator = VideoGenerator.from_pretrained(far_dir, device="cpu", dtype="float32")
    events = []
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a blue square")],
                          diffusion=DiffusionParams(height=32, width=64, num_frames=17, steps=1, seed=5),
                          outputs=OutputSpec(stream=True, return_latents=True))
    out = generator.generate(request, on_event=events.append)
    chunks = [e.artifact for e in events if isinstance(e, ArtifactEvent) and e.partial
              and isinstance(e.artifact, VideoChunkArtifact)]
    assert [c.index for c in chunks] == [0, 1, 2] and [c.first_frame for c in chunks] == [0, 1, 9]
    final = out.video.frames
    assert torch.equal(torch.cat([c.frames for c in chunks]), final)
    whole = to_uint8_frames(latents_to_unit_range(generator.pipeline.components["vae"], out.artifacts["latents"].latents)[0])
    assert torch.equal(final, whole)
