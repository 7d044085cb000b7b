"""The offline API's sound contract on a model without an audio path (Wan): no soundtrack,
and audio asked for explicitly is refused naming the field. (Models with sound: the
Stable Audio and LTX-2 family tests.)"""

from __future__ import annotations

import av
import pytest

from omniloop.api.generator import VideoGenerator


def test_a_silent_model_returns_no_audio_and_refuses_audio_requests(wan_t2v_dir, tmp_path):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    kw = dict(steps=1, height=32, width=32, num_frames=5, seed=1)
    result = gen.generate_video("a cat", output_path=tmp_path, **kw)
    assert result.audio is None and result.sample_rate is None
    with av.open(str(result.path)) as c:
        assert [s.type for s in c.streams] == ["video"]
    assert gen.generate_video("a cat", audio=False, save_video=False, **kw).audio is None
    with pytest.raises(ValueError, match=r"outputs.modalities=\['video', 'audio'\]: .* produces \['video', 'latent'\]"):
        gen.generate_video("a cat", audio=True, save_video=False, **kw)
    with pytest.raises(ValueError, match="has no audio path"):
        gen.generate_audio("a cat", **kw)


def test_cli_audio_only_on_a_silent_model_is_a_clear_error(wan_t2v_dir, tmp_path, capsys):
    from omniloop.api.cli import main

    rc = main(["generate", "x", "--model", str(wan_t2v_dir), "--audio-only", "--output", str(tmp_path),
               "--steps", "1", "--height", "32", "--width", "32", "--num-frames", "5", "--device", "cpu",
               "--no-progress"])
    assert rc == 2
    assert "has no audio path" in capsys.readouterr().err
