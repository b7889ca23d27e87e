"""A conversation rendered with the model's chat template (Info.chat_template) as transformers' apply_chat_template
renders it: Jinja in an immutable sandbox, blocks trimmed, loop controls, `tojson` and `raise_exception`, the
special tokens' strings as variables."""

import functools
import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or does not render."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)


def render(template: str, messages: list[dict], special_tokens: dict[str, str],
           add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` ({"role", "content"} each); special_tokens: bos_token, eos_token."""
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          tools=None, documents=None, **special_tokens)
    except TemplateError:
        raise
    except jinja2.TemplateError as error:
        raise TemplateError(f"the chat template does not render: {error}") from None
