"""Hostile chat templates shipped inside a GGUF file cannot escape Jinja's sandbox.

`tokenizer.chat_template` is Jinja code from a downloaded file; the server renders it on
every chat request (`Tokenizer.apply_chat_template`). Every template here is written into
a GGUF file and rendered through exactly that path. Each must end in a `TokenizerError`
that names the template (metadata key and file) and says the sandbox refused it, must
not mutate the caller's messages, and must not read any file: one test runs the render
under an audit hook in a subprocess and checks that no file is opened at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2.sandbox
import pytest
from conftest import REPO_ROOT
from tokenizer_fixtures import write_byte_vocab_gguf

from minivllm.errors import TokenizerError
from minivllm.gguf.chat_template import _environment
from minivllm.gguf.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hello"}]


def write_vocab_gguf(path: Path, chat_template: str) -> Path:
    return write_byte_vocab_gguf(path, chat_template=chat_template)


def render_from_file(tmp_path: Path, template: str, messages: list[dict] | None = None) -> str:
    path = write_vocab_gguf(tmp_path / "model.gguf", template)
    return Tokenizer.from_gguf(path).apply_chat_template(MESSAGES if messages is None else messages)


# Python-internals escapes, template loading, and mutation of the arguments.
HOSTILE = {
    "str_mro_subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler_init_globals": "{{ cycler.__init__.__globals__ }}",
    "template_reference_context": "{{ self._TemplateReference__context }}",
    "for_over_subclasses": "{% for x in ().__class__.__base__.__subclasses__() %}{{ x }}{% endfor %}",
    "lipsum_globals_os": "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "joiner_init_globals": "{{ joiner.__init__.__globals__ }}",
    "namespace_init_globals": "{{ namespace.__init__.__globals__ }}",
    "raise_exception_globals": "{{ raise_exception.__globals__['json'] }}",
    "strftime_now_code": "{{ strftime_now.__code__ }}",
    "format_string_attribute": "{{ '{0.__class__.__mro__}'.format(1) }}",
    "attr_filter": "{{ messages|attr('__class__') }}",
    "map_attribute_filter": "{{ messages|map(attribute='__class__')|list }}",
    "getitem_dunder": "{{ messages['__class__'] }}",
    "include_file": "{% include '/etc/passwd' %}",
    "import_module": "{% import 'os' as os %}{{ os }}",
    "from_import": "{% from 'os' import system %}{{ system('id') }}",
    "extends_file": "{% extends '/etc/passwd' %}",
    "list_append": "{% set xs = [] %}{{ xs.append(1) }}",
    "messages_append": "{{ messages.append({'role': 'system', 'content': 'obey'}) }}",
    "messages_pop": "{{ messages.pop() }}",
    "message_update": "{{ messages[0].update({'content': 'rewritten'}) }}",
    # memory bombs: each would allocate gigabytes before anything could stop it
    "string_repeat_bomb": "{{ 'x' * 10**10 }}",
    "list_repeat_bomb": "{{ ([1] * 100000) * 100000 }}",
    "power_bomb": "{{ 7 ** 100000000 }}",
    "ljust_bomb": "{{ ''.ljust(10**10) }}",
    "output_bomb": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused(tmp_path, name):
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(TokenizerError) as info:
        render_from_file(tmp_path, HOSTILE[name], messages)
    message = str(info.value)
    assert "tokenizer.chat_template" in message and str(tmp_path / "model.gguf") in message, message
    assert "refused by the sandbox" in message, message
    assert "use another one, or send a raw prompt" in message  # the fix
    assert isinstance(info.value.__cause__, jinja2.sandbox.SecurityError)
    assert messages == [{"role": "user", "content": "hello"}]  # nothing was mutated


@pytest.mark.parametrize("name", ["config", "request", "os", "__builtins__", "url_for", "get_flashed_messages"])
def test_no_dangerous_globals(tmp_path, name):
    """Flask-style globals (`config.items()` and friends) do not exist in the sandbox."""
    with pytest.raises(TokenizerError) as info:
        render_from_file(tmp_path, f"{{{{ {name}.items() }}}}")
    assert f"'{name}' is undefined" in str(info.value)
    assert "tokenizer.chat_template" in str(info.value)


def test_globals_are_the_expected_safe_set():
    assert set(_environment().globals) == {
        "range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now",
    }


def test_include_cannot_read_a_file(tmp_path):
    """A file next to the model (or named by the user's message) is never included."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    for template, messages in (
        (f"{{% include '{secret}' %}}", MESSAGES),
        ("{% include 'secret.txt' %}", MESSAGES),
        ("{% include messages[0]['content'] %}", [{"role": "user", "content": str(secret)}]),
        (f"{{% import '{secret}' as s %}}", MESSAGES),
    ):
        with pytest.raises(TokenizerError) as info:
            render_from_file(tmp_path, template, messages)
        assert "refused by the sandbox" in str(info.value)
        assert "TOP-SECRET-CONTENT" not in str(info.value)


def test_no_file_is_opened_while_rendering(tmp_path):
    """In a fresh interpreter with an audit hook: rendering hostile templates opens no file."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    templates = [f"{{% include '{secret}' %}}", "{% include messages[0]['content'] %}",
                 f"{{% extends '{secret}' %}}", "{{ lipsum.__globals__['os'].popen('id').read() }}",
                 "{{ cycler.__init__.__globals__.__builtins__.open('" + str(secret) + "').read() }}"]
    paths = [str(write_vocab_gguf(tmp_path / f"m{i}.gguf", t)) for i, t in enumerate(templates)]
    script = textwrap.dedent("""
        import json, sys
        events, recording = [], [False]
        def hook(event, args):
            if recording[0] and event in ("open", "os.listdir", "os.system", "subprocess.Popen", "os.exec",
                                          "os.posix_spawn"):
                events.append([event, repr(args)[:200]])
        sys.addaudithook(hook)
        from minivllm.errors import TokenizerError
        from minivllm.gguf.tokenizer import Tokenizer
        paths, secret = json.loads(sys.argv[1]), sys.argv[2]
        messages = [{"role": "user", "content": secret}]
        toks = [Tokenizer.from_gguf(p) for p in paths]
        # Warm-up: the first render compiles and may import lazily; not part of the check.
        from minivllm.gguf.chat_template import ChatTemplate
        ChatTemplate("{% for m in messages %}{{ m['content']|tojson }}{% endfor %}").render(messages)
        try:  # the error path imports jinja2.debug on first use
            ChatTemplate("{{ ''.__class__ }}").render(messages)
        except TokenizerError:
            pass
        results = []
        recording[0] = True
        for tok in toks:
            try:
                results.append(["rendered", tok.apply_chat_template(messages)])
            except TokenizerError as exc:
                results.append(["TokenizerError", str(exc)])
        recording[0] = False
        render_events = list(events)
        recording[0] = True  # control: the hook does see a plain open()
        open(secret).close()
        recording[0] = False
        print(json.dumps({"events": render_events, "control": events[len(render_events):], "results": results}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(paths), str(secret)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["events"] == [], report["events"]
    assert len(report["control"]) == 1 and str(secret) in report["control"][0][1]
    assert [kind for kind, _ in report["results"]] == ["TokenizerError"] * len(templates), report["results"]
    assert all("refused by the sandbox" in text for _, text in report["results"]), report["results"]
    assert not any("TOP-SECRET-CONTENT" in text for _, text in report["results"])


def test_ordinary_template_features_still_work(tmp_path):
    """The hardening refuses only unsafe access: what real templates use keeps working."""
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.content is defined and m['role'] in ['user', 'assistant'] %}"
        "<{{ m.role|upper }}>{{ m.content.strip().split(' ')|join('_') }}{{ '|' if not loop.last }}"
        "{% endif %}{% endfor %}"
        "{% if tools is defined %}{{ tools|tojson }}{% endif %}{{ '#' ~ ns.n }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    messages = [{"role": "user", "content": " a b "}, {"role": "assistant", "content": "c"}]
    assert render_from_file(tmp_path, template, messages) == "<USER>a_b|<ASSISTANT>c#2>"
