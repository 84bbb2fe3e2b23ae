"""Chat templates rendered in jinja2's immutable sandbox.

A model directory's `tokenizer_config.json` carries a Jinja template, and the gateway will
render templates from directories users point it at: a template is untrusted code. The
sandbox refuses attribute access to internals (`__init__`, `__globals__`, ...) and any
method that mutates its arguments, which closes escapes such as
`{{ cycler.__init__.__globals__.os.popen('id').read() }}`. Every failure (a syntax error,
a blocked escape, a missing variable, the template's own `raise_exception`) is one
`UserError` that names the file the template came from.

Templates are compiled without jinja2's constant folding, which would evaluate an
expression such as `'x' * 1500000000` at compile time even in a branch that never runs;
`*` and `**` are intercepted and refuse results larger than `MAX_REPEAT_ITEMS` items or
`MAX_POWER_BITS` bits, so a template that does run such a branch fails at once.
"""

from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from pagedweight.common.errors import UserError


MAX_REPEAT_ITEMS = 1 << 22  # the longest string or list `*` may build (4 Mi items)
MAX_POWER_BITS = 1 << 16  # the largest integer `**` may build


class TemplateRaised(Exception):
    """The template called raise_exception(message) (HF templates use it to reject input)."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `*` and `**` bounded in the size of what they build."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            count, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and hasattr(seq, "__len__") and len(seq) * count > MAX_REPEAT_ITEMS:
                raise SecurityError(f"`*` would build more than {MAX_REPEAT_ITEMS} items")
        elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                and max(abs(left).bit_length(), 1) * right > MAX_POWER_BITS:
            raise SecurityError(f"`**` would build an integer of more than {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # optimized=False: no constant folding, so nothing in the template runs at compile time
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined, optimized=False
    )
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


class OutputTooLong(UserError):
    """The rendered text passed `max_chars`: a template that multiplies its input."""


def render_chat_template(
    template: str, source: str, messages: list[dict], add_generation_prompt: bool = True,
    max_chars: int | None = None, **extra
) -> str:
    """Render `template` (read from `source`, named in errors) over the messages; with
    `max_chars`, rendering stops as soon as the text passes it (OutputTooLong), so a
    template that loops over its input cannot build an unbounded string first."""
    try:
        parts, size = [], 0
        for part in _compile(template).generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        ):
            size += len(part)
            if max_chars is not None and size > max_chars:
                raise OutputTooLong(f"{source}: the chat template rendered more than {max_chars} characters")
            parts.append(part)
        return "".join(parts)
    except UserError:
        raise
    except SecurityError as err:
        raise UserError(f"{source}: chat template refused by the sandbox ({err})") from None
    except TemplateRaised as err:
        raise UserError(f"{source}: chat template rejected the messages: {err}") from None
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"{source}: chat template is not valid Jinja (line {err.lineno}: {err.message})") from None
    except jinja2.TemplateError as err:
        raise UserError(f"{source}: chat template failed on these messages: {err}") from None
    except MemoryError:
        raise UserError(f"{source}: chat template ran out of memory on these messages") from None
    except Exception as err:  # e.g. TypeError from a template calling a value wrongly
        raise UserError(f"{source}: chat template failed: {type(err).__name__}: {err}") from None
