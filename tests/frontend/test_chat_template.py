"""Chat templates render in jinja2's immutable sandbox: escapes fail with one clear error."""

from __future__ import annotations

import json
import shutil
import time

import jinja2
import pytest

from pagedweight.common.errors import UserError
from pagedweight.frontend.tokenizer import Tokenizer
from tests.conftest import BUNDLED_MODEL, shared_model_dirs

ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__.os.system('id') }}",
    "{{ namespace.__init__.__globals__['os'].popen('id').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append({'role': 'system', 'content': 'x'}) %}{{ messages }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
]

MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo {{ 1 }} 世界"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again\n"}],
]


def model_dir_with_template(tmp_path, template: str):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(BUNDLED_MODEL / "tokenizer.json", model / "tokenizer.json")
    settings = json.loads((BUNDLED_MODEL / "tokenizer_config.json").read_text())
    settings["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    return model


@pytest.mark.parametrize("template", ESCAPES)
def test_template_escapes_fail_with_one_error_naming_the_file(tmp_path, template):
    model = model_dir_with_template(tmp_path, template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError) as err:
        Tokenizer(model).apply_chat_template(messages)
    assert str(model / "tokenizer_config.json") in str(err.value)
    assert "\n" not in str(err.value)
    assert messages == [{"role": "user", "content": "hi"}]  # the template changed nothing


def test_the_escape_runs_under_a_plain_environment(tmp_path):
    """The payload is real: unsandboxed jinja2 executes it (what the sandbox prevents)."""
    marker = tmp_path / "ran"
    template = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    jinja2.Environment().from_string(template).render()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UserError):
        Tokenizer(model_dir_with_template(tmp_path, template)).apply_chat_template([])
    assert not marker.exists()


@pytest.mark.parametrize("template,fragment", [
    ("{% for m in messages %}", "not valid Jinja"),
    ("{{ raise_exception('only user turns') }}", "only user turns"),
    ("{{ messages[0].nope }}", "failed"),
])
def test_broken_templates_give_one_clear_error(tmp_path, template, fragment):
    with pytest.raises(UserError, match=fragment):
        Tokenizer(model_dir_with_template(tmp_path, template)).apply_chat_template(MESSAGES[0])


@pytest.mark.parametrize("model_dir", sorted({BUNDLED_MODEL, *shared_model_dirs()}), ids=lambda p: p.name)
def test_real_templates_render_as_an_unsandboxed_environment_did(model_dir):
    tokenizer = Tokenizer(model_dir)
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    for messages in MESSAGES:
        for add in (True, False):
            expected = plain.from_string(tokenizer.chat_template).render(
                messages=messages, add_generation_prompt=add
            )
            assert tokenizer.apply_chat_template(messages, add) == expected
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(MESSAGES[0])


HUGE = "{{ 'x' * 1500000000 }}"


def test_a_huge_constant_in_a_branch_never_taken_is_not_built(tmp_path):
    """jinja2 folds constants at compile time: the branch below would build 1.5 GB on
    every compile although it never runs."""
    tokenizer = Tokenizer(model_dir_with_template(
        tmp_path, "{% if messages | length > 99 %}" + HUGE + "{% endif %}{{ messages[0]['content'] }}"))
    started = time.monotonic()
    assert tokenizer.apply_chat_template(MESSAGES[0]) == "hi"
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("template", [HUGE, "{{ [1] * 1500000000 }}", "{{ 10 ** 100000000 }}",
                                      "{% set n = 1500000000 %}{{ messages[0]['content'] * n }}"])
def test_repetition_and_powers_past_their_bound_fail_at_once(tmp_path, template):
    tokenizer = Tokenizer(model_dir_with_template(tmp_path, template))
    with pytest.raises(UserError, match="refused by the sandbox"):
        tokenizer.apply_chat_template(MESSAGES[0])


def test_small_repetition_and_powers_still_render(tmp_path):
    tokenizer = Tokenizer(model_dir_with_template(tmp_path, "{{ '-' * 3 }}{{ 2 ** 10 }}{{ 3 * [0] | length }}"))
    assert tokenizer.apply_chat_template(MESSAGES[0]) == "---10243"
