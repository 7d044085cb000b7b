"""``ChatPrompt``: a conversation (text parts with roles) -> PromptTokens through the
tokenizer's own chat template, with the generation prompt (the assistant turn) opened.

Any AR pipeline puts it before its decode loop; without roles a request stays a raw
completion prompt (the loop tokenizes it). Image/video parts in a conversation become the
template's ``{"type": "image" | "video"}`` content entries (a vision tower must consume them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniloop.pipeline.loops.ar import PromptTokens
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import OmniRequest


def is_chat(request: OmniRequest) -> bool:
    """The request is a conversation: some part carries a role. Media parts count too (an
    ``ImagePart``'s role defaults to ``first_frame``), so a bare prompt beside an image goes
    through the chat template as the user's turn (``chat_messages``), not refused as media
    outside a conversation."""
    return any(getattr(p, "role", None) for p in request.inputs)


def chat_messages(request: OmniRequest, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Messages of a request: consecutive parts of one role form one message (text parts
    without a role are the user's); ``system_prompt`` opens the conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for part in request.inputs:
        role = getattr(part, "role", None) if part.kind in ("text", "audio") else None  # an image's role is no chat role
        role = role or (messages[-1]["role"] if messages and part.kind != "text" else "user")
        entry: dict[str, Any] = {"type": "text", "text": part.text} if part.kind == "text" else {"type": part.kind}
        if messages and messages[-1]["role"] == role and isinstance(messages[-1]["content"], list):
            messages[-1]["content"].append(entry)
        else:
            messages.append({"role": role, "content": [entry]})
    # text-only messages as plain strings: what every chat template accepts
    for m in messages:
        if isinstance(m["content"], list) and all(e["type"] == "text" for e in m["content"]):
            m["content"] = "".join(e["text"] for e in m["content"])
    return messages


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template, so it takes no conversations; send the "
                         "prompt as text without roles (a raw completion)")
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


@dataclass
class ChatPrompt(StageBase):
    tokenizer: str = "tokenizer"
    system_prompt: str | None = None
    outputs = {"prompt_tokens": PromptTokens}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer,)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        ctx.write(state, "prompt_tokens", PromptTokens(token_ids=ids))
