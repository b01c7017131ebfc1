"""Twinkle's data shapes: messages, trajectories, input features, sampling parameters.

They are plain dicts (TypedDicts), as in ModelScope Twinkle, so `Message(role=..., content=...)`,
`trajectory.get('messages')` and JSON round trips all work.
"""

from twinkle.data_format.input_feature import InputFeature, ModelOutput
from twinkle.data_format.message import Message, Tool, ToolCall
from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams
from twinkle.data_format.trajectory import Trajectory, user_data_get

__all__ = [
    "InputFeature",
    "Message",
    "ModelOutput",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "Tool",
    "ToolCall",
    "Trajectory",
    "user_data_get",
]
