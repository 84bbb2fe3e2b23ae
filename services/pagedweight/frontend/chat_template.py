"""Chat templates rendered in jinja2's immutable sandbox.

A model directory's `tokenizer_config.json` carries a Jinja template, and the gateway will
render templates from directories users point it at: a template is untrusted code. The
sandbox refuses attribute access to internals (`__init__`, `__globals__`, ...) and any
method that mutates its arguments, which closes escapes such as
`{{ cycler.__init__.__globals__.os.popen('id').read() }}`. Every failure (a syntax error,
a blocked escape, a missing variable, the template's own `raise_exception`) is one
`UserError` that names the file the template came from.
"""

from __future__ import annotations

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from pagedweight.common.errors import UserError


class TemplateRaised(Exception):
    """The template called raise_exception(message) (HF templates use it to reject input)."""


def _raise_exception(message: str):
    raise TemplateRaised(message)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
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
    except Exception as err:  # e.g. TypeError from a template calling a value wrongly
        raise UserError(f"{source}: chat template failed: {type(err).__name__}: {err}") from None
