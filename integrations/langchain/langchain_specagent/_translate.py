"""Translation between LangChain's messages and chunks and specagent's calls."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from specagent.calls import CallChunk

__all__ = ["final_chunk", "text_chunk", "to_chat_message"]


def _logprobs(chunk: CallChunk) -> dict[str, Any]:
    """``{"logprobs": {"content": [...]}}`` for a chunk's tokens, as ``ChatOpenAI`` reports
    them (LangChain merges the chunks' lists); empty where the call did not ask."""
    if chunk.logprobs is None:
        return {}
    return {"logprobs": {"content": [each.as_openai() for each in chunk.logprobs]}}


def text_chunk(chunk: CallChunk) -> ChatGenerationChunk:
    """A piece of a call's text (and its tokens' log-probabilities, where asked for)."""
    logprobs = _logprobs(chunk)
    message = AIMessageChunk(content=chunk.text, response_metadata=dict(logprobs))
    return ChatGenerationChunk(message=message, generation_info=logprobs or None)


def final_chunk(chunk: CallChunk, model_name: str) -> ChatGenerationChunk:
    """The last chunk of a call: content, tool calls, usage and the specagent stats."""
    result = chunk.result
    assert result is not None
    stats = result.stats
    tool_call_chunks = [
        tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
        for i, c in enumerate(chunk.tool_calls)
    ]
    message = AIMessageChunk(
        content=chunk.content,
        tool_call_chunks=tool_call_chunks,
        usage_metadata=UsageMetadata(
            input_tokens=result.usage.input_tokens,
            output_tokens=result.usage.output_tokens,
            total_tokens=result.usage.total_tokens,
            input_token_details=InputTokenDetails(cache_read=result.usage.cached_input_tokens),
        ),
        response_metadata={
            "model_name": model_name,
            "model_provider": "specagent",
            "finish_reason": chunk.finish_reason,
            **_logprobs(chunk),
            "specagent": {
                "policy": stats.policy,
                "mode": stats.mode,
                "seed": result.seed,
                **stats.as_dict(),
            },
        },
        chunk_position="last",
    )
    return ChatGenerationChunk(
        message=message,
        generation_info={
            "finish_reason": chunk.finish_reason,
            "token_usage": {
                "prompt_tokens": result.usage.input_tokens,
                "completion_tokens": result.usage.output_tokens,
                "total_tokens": result.usage.total_tokens,
                "completion_tokens_details": {
                    "accepted_prediction_tokens": result.usage.accepted_prediction_tokens,
                    "rejected_prediction_tokens": result.usage.rejected_prediction_tokens,
                },
            },
            "model_name": model_name,
            **_logprobs(chunk),
        },
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") in {"tool_use", "tool_call"}:
            continue  # carried by tool_calls
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"ChatSpecAgent takes text content only; got a {kind!r} block")
    return "".join(parts)


def to_chat_message(message: BaseMessage) -> dict[str, Any]:
    """LangChain message -> the dict a Hugging Face chat template expects."""
    text = _content_text(message.content)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": text}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": text}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "id": call.get("id"),
                    "function": {"name": call["name"], "arguments": call["args"]},
                }
                for call in message.tool_calls
            ]
        return out
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "content": text,
            "tool_call_id": message.tool_call_id,
            "name": getattr(message, "name", None),
        }
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": text}
    raise ValueError(f"unsupported message type {type(message).__name__}")
