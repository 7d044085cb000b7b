"""Generic one-shot stages shared by families (chat templates, text encoding, latent decoding)."""

from omniloop.pipeline.stages.chat import ChatPrompt, chat_ids, chat_messages, is_chat
from omniloop.pipeline.stages.decode import VAEDecode, latents_to_unit_range
from omniloop.pipeline.stages.text import TextEncode

__all__ = ["ChatPrompt", "TextEncode", "VAEDecode", "chat_ids", "chat_messages", "is_chat", "latents_to_unit_range"]
