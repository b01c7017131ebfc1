"""Small helpers shared by the twinkle components."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any


def construct_class(spec: Any, base: type, module: ModuleType, **kwargs: Any) -> Any:
    """Twinkle's way of naming a component: a class name in `module`, a class, or an instance.

    A name or a class is instantiated with kwargs; an instance or a plain callable is returned
    as it is (kwargs must then be empty).
    """
    if isinstance(spec, str):
        cls = getattr(module, spec, None)
        if not (inspect.isclass(cls) and issubclass(cls, base)):
            known = sorted(
                name for name, value in vars(module).items()
                if inspect.isclass(value) and issubclass(value, base) and not name.startswith("_")
            )
            raise ValueError(f"unknown {base.__name__} '{spec}' in {module.__name__}; available: {known}")
        return cls(**kwargs)
    if inspect.isclass(spec):
        return spec(**kwargs)
    if kwargs:
        raise TypeError(f"init arguments {sorted(kwargs)} given with an already built {type(spec).__name__}")
    if not callable(spec):
        raise TypeError(f"expected a {base.__name__} name, class, instance or a callable, got {type(spec).__name__}")
    return spec


def to_int_list(values: Any) -> list[int]:
    """A flat list of Python ints from a list, a tuple, a numpy array or a torch tensor."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if values and isinstance(values[0], (list, tuple)):
        if len(values) != 1:
            raise ValueError(f"expected one sequence, got a batch of {len(values)}")
        values = values[0]
    return [int(v) for v in values]


def to_float_list(values: Any) -> list[float]:
    """A flat list of Python floats from a list, a tuple, a numpy array or a torch tensor."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]
