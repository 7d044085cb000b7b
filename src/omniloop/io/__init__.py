"""Media I/O: mp4 (H.264), png, conditioning-image loading."""

from omniloop.io.image import image_to_tensor, open_image, write_png
from omniloop.io.video import encode_mp4, read_video, write_mp4

__all__ = ["encode_mp4", "image_to_tensor", "open_image", "read_video", "write_mp4", "write_png"]
