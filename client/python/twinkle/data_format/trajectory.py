"""A conversation to train on or to complete, with the caller's own data beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import TypedDict

from twinkle.data_format.message import Message, Tool


class Trajectory(TypedDict, total=False):
    """messages, optional tools, and user_data that rewards read (e.g. a ground truth).

    user_data is a list of (key, value) pairs or of dicts, as Twinkle's preprocessors write it;
    user_data_get reads either form.
    """

    messages: list[Message]
    tools: list[Tool]
    user_data: Any
    rewards: list[float]
    generation_config: dict[str, Any]


def user_data_get(user_data: Any, key: str, default: Any = None) -> Any:
    """The value for key in a trajectory's user_data: pairs [(k, v), ...], dicts [{k: v}] or a dict."""
    if user_data is None:
        return default
    if isinstance(user_data, Mapping):
        return user_data.get(key, default)
    for item in user_data:
        if isinstance(item, Mapping):
            if key in item:
                return item[key]
        elif isinstance(item, (list, tuple)) and len(item) == 2 and item[0] == key:
            return item[1]
    return default
