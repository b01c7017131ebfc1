"""Chat messages and tool descriptions (dicts, as Twinkle's)."""

from __future__ import annotations

from typing import Any

from typing_extensions import Required, TypedDict


class ToolCall(TypedDict, total=False):
    id: str
    index: int
    type: str
    tool_name: str
    arguments: str


class Tool(TypedDict, total=False):
    server_name: str
    tool_name: Required[str]
    description: Required[str]
    parameters: dict[str, Any]


class Message(TypedDict, total=False):
    """One chat turn: role is system | user | assistant | tool; content is text."""

    role: Required[str]
    content: str | list[dict[str, Any]]
    tool_calls: list[ToolCall]
    tool_call_id: str | None
    name: str | None
    reasoning_content: str
