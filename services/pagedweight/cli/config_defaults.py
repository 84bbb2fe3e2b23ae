"""CLI defaults read from the config dataclasses, so each default is written once (the flag
shows what the library does when the flag is left out; vLLM's `get_kwargs(SchedulerConfig)`
is the model)."""

from __future__ import annotations

from dataclasses import MISSING, fields


def default_of(config_cls, name: str):
    """The default of dataclass field `name` (its default_factory called)."""
    for f in fields(config_cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise TypeError(f"{config_cls.__name__}.{name} has no default")
    raise AttributeError(f"{config_cls.__name__} has no field {name!r}")
