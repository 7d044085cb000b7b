"""Connectors (engine/connectors.py): what a transfer carries arrives equal, with its metric;
the extension points are refused by name."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine.connectors import InProcessConnector, SharedMemoryConnector, connector_for, discard
from omniloop.pipeline.edges import DenoisedLatents
from omniloop.request import TensorArtifact


def _artifacts() -> dict:
    return {"latents": DenoisedLatents(latents={"video": torch.randn(1, 4, 2, 3, 3), "audio": torch.randn(1, 8, 5)}),
            "codes": TensorArtifact(tensor=torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:]),  # a view
            "half": TensorArtifact(tensor=torch.randn(3, 2).to(torch.bfloat16)),
            "empty": TensorArtifact(tensor=torch.empty(0, 4))}


def test_shared_memory_carries_every_tensor_of_the_artifacts_equal_and_measures_the_transfer():
    sent = _artifacts()
    packed = SharedMemoryConnector().pack("r0", "encode", sent)
    got, metric = SharedMemoryConnector().unpack(packed, "main", torch.device("cpu"))
    assert torch.equal(got["latents"].latents["video"], sent["latents"].latents["video"])
    assert torch.equal(got["latents"].latents["audio"], sent["latents"].latents["audio"])
    for name in ("codes", "half", "empty"):
        assert got[name].tensor.dtype == sent[name].tensor.dtype and torch.equal(got[name].tensor, sent[name].tensor)
    nbytes = (72 + 40) * 4 + 4 * 8 + 6 * 2
    assert (metric.request_id, metric.source, metric.target, metric.bytes) == ("r0", "encode", "main", nbytes)
    assert metric.edges == ("latents", "codes", "half", "empty") and metric.seconds > 0
    discard(packed)  # read already: nothing left to free


def test_an_unread_transfer_is_discarded_and_in_process_hands_over_the_objects():
    packed = SharedMemoryConnector().pack("r0", "main", _artifacts())
    discard(packed)
    with pytest.raises(FileNotFoundError):
        SharedMemoryConnector().unpack(packed, "denoise", torch.device("cpu"))
    sent = _artifacts()
    got, metric = InProcessConnector().unpack(InProcessConnector().pack("r0", "main", sent), "main", torch.device("cpu"))
    assert got["codes"] is sent["codes"] and metric.bytes == 0


def test_extension_points_and_unknown_connectors_are_refused_naming_what_to_pass():
    with pytest.raises(ValueError, match=r"connector 'nixl' is a named extension point, not implemented"):
        connector_for("nixl")
    with pytest.raises(ValueError, match=r"unknown connector 'tcp'; pass one of \['in_process', 'shared_memory'\]"):
        connector_for("tcp")
