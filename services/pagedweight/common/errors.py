"""User-facing errors.

A `UserError` is a problem with what the user gave us (a path, a file, a flag, a
prompt), not a bug. The CLI prints its message as one line and exits with code 2; the
HTTP layers turn it into a 4xx JSON body. Messages name the file, key or limit at fault.
"""


class UserError(Exception):
    """Bad input: one clear line, no traceback."""


class CheckpointError(UserError):
    """A checkpoint directory, shard or tensor is missing, truncated or malformed."""


class UnsupportedModelError(UserError):
    """The checkpoint's architecture is not one PagedWeight can run."""


class ContextLengthError(UserError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class EngineDeadError(RuntimeError):
    """The engine failed a step and stopped: its state may be corrupt, so it takes no more
    work. Not a user error (HTTP 503/500); the worker must be restarted."""
