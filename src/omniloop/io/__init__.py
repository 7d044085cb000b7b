"""Media I/O: mp4 (H.264, optional AAC soundtrack), wav / flac / mp3, png, conditioning-image loading."""

from omniloop.io.audio import AUDIO_FORMATS, encode_audio, read_audio, write_audio
from omniloop.io.image import image_to_tensor, open_image, write_png
from omniloop.io.video import encode_mp4, read_video, write_mp4

__all__ = [
    "AUDIO_FORMATS", "encode_audio", "encode_mp4", "image_to_tensor", "open_image", "read_audio", "read_video",
    "write_audio", "write_mp4", "write_png",
]
