"""Pool-to-pool handles (engine/held_artifacts.py): rank 0 holds a pool's outputs as the shared-memory
connector's handle; a consumer pool reads it as borrowed (the segments stay), rank 0 materializes it only
when read, and its segments are unlinked exactly once: after the last reader, or when the request ends."""

from __future__ import annotations

import os

import torch

from omniloop.engine.connectors import SharedMemoryConnector
from omniloop.engine.held_artifacts import MAIN, Held, HeldArtifacts
from omniloop.pipeline.edges import DenoisedLatents
from omniloop.request import TensorArtifact


def _alive(names) -> list[bool]:
    return [os.path.exists(f"/dev/shm/{n}") for n in names]


def _held(readers: set[str], unpacked: list) -> Held:
    latents = DenoisedLatents(latents={"video": torch.randn(1, 4, 2, 3, 3)})
    packed = SharedMemoryConnector().pack("r0", "denoise", {"final_latents": latents,
                                                           "ids": TensorArtifact(tensor=torch.arange(4))})

    def materialize(p):
        arts, metric = SharedMemoryConnector().unpack(p, MAIN, torch.device("cpu"))
        unpacked.append(metric)
        return arts

    return Held(packed, "denoise", "shared_memory", readers, materialize)


def test_a_pool_reader_borrows_the_handle_and_rank_0_materializes_it_only_when_read_then_frees_it_once():
    unpacked: list = []
    arts = HeldArtifacts()
    held = _held({"decode", MAIN}, unpacked)
    arts.hold(held)
    segments = held.packed.segments
    assert "final_latents" in arts and not unpacked and all(_alive(segments))  # nothing moved to rank 0 yet
    assert arts.handle("final_latents") is held
    # the decode pool reads the forwarded handle: a copy, the segments stay for rank 0
    got, metric = SharedMemoryConnector().unpack(held.forwarded(), "decode", torch.device("cpu"))
    arts.read_by(held, "decode")
    assert (metric.source, metric.target) == ("denoise", "decode") and all(_alive(segments))
    # the final output reads it: rank 0's copy (denoise -> main), then the last reader frees the segments
    assert torch.equal(arts["final_latents"].latents["video"], got["final_latents"].latents["video"])
    assert [(m.source, m.target) for m in unpacked] == [("denoise", MAIN)] and not any(_alive(segments))
    assert held.freed and arts.handle("ids") is None and torch.equal(arts["ids"].tensor, torch.arange(4))
    arts.clear()  # the request ends: freed already, nothing unlinked twice
    assert len(unpacked) == 1


def test_a_request_that_ends_before_its_readers_frees_the_handle_and_an_unread_edge_is_dropped():
    unpacked: list = []
    arts = HeldArtifacts()
    held = _held({"decode"}, unpacked)
    arts.hold(held)
    arts.clear()  # failed or cancelled before decode ran: the segments go, never read on rank 0
    assert not any(_alive(held.packed.segments)) and not unpacked and held.freed
    arts = HeldArtifacts()
    held = _held({"decode"}, unpacked)
    arts.hold(held)
    arts.read_by(held, "decode")  # its only reader read it: freed, and the edge is no longer there to read
    assert not any(_alive(held.packed.segments)) and "final_latents" not in arts and not unpacked
    held = _held(set(), unpacked)
    arts.hold(held)  # nobody on a pool reads it: rank 0's copy at once, as without handles
    assert len(unpacked) == 1 and not any(_alive(held.packed.segments)) and "ids" in arts
