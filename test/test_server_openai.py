"""The OpenAI API through the official `openai` client: models, completions and chat, streaming or not."""

from __future__ import annotations

import re

import openai
import pytest


MODEL = "tiny-chat"
PROMPT = "Once upon a time there was a little town by the sea where"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 256


def test_completion_matches_native_greedy(client, server):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    native = server.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    assert comp.object == "text_completion"
    assert comp.choices[0].text == native["text"]
    assert comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 6
    assert comp.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 6


def test_completion_cached_tokens_reported(client):
    prompt = PROMPT + " fishermen told stories every night"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_batch_n_logprobs_echo(client):
    comp = client.completions.create(
        model=MODEL, prompt=["The quick brown fox", "The weather today"], max_tokens=3, n=2, temperature=1.0,
        seed=3, logprobs=2,
    )
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    for choice in comp.choices:
        assert len(choice.logprobs.tokens) == 3
        assert len(choice.logprobs.token_logprobs) == 3
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=2, echo=True, logprobs=0)
    assert echoed.choices[0].text.startswith("The quick brown fox")
    assert echoed.choices[0].logprobs.token_logprobs[0] is None


def test_seed_makes_sampling_repeatable(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_completion_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat(client, server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = chat.choices[0]
    assert chat.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert len(choice.logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    # Same prompt through the native API, rendered with the model's template.
    prompt = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 5}}
    native = server.post("/generate", json=body).json()
    assert (choice.message.content or "") == native["text"]
    assert chat.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]


def test_chat_stream_and_stop(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    text = full.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True, extra_body=IGNORE_EOS
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        stopped = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop], extra_body=IGNORE_EOS
        )
        content = stopped.choices[0].message.content or ""  # None when the stop string came first
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].matched_stop == stop
        assert stop not in content
        assert text.startswith(content)

        streamed = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[stop], stream=True,
            extra_body=IGNORE_EOS,
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == content

        pattern = re.escape(stop[0]) + "."
        by_regex = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={**IGNORE_EOS, "stop_regex": pattern},
        )
        assert by_regex.choices[0].finish_reason == "stop"
        assert by_regex.choices[0].matched_stop == pattern
        assert re.search(pattern, by_regex.choices[0].message.content or "") is None


def test_openai_bookkeeping_fields_are_accepted(client):
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, store=False, metadata={"run": "7"}, service_tier="auto",
        prompt_cache_key="session-7", safety_identifier="user-42", verbosity="medium", modalities=["text"],
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_context_overflow_is_refused_naming_each_routes_limit(client, server):
    """An explicit limit past the 256-token context is a 400 with the numbers; a default one is cut to fit."""
    ids = [5] * 250
    numbers = (
        "This model's maximum context length is 256 tokens. However, you requested 350 tokens (250 in the prompt, "
        "100 for the completion). Reduce the prompt or "
    )
    reply = server.post("/v1/completions", json={"prompt": ids, "max_tokens": 100})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == numbers + "max_tokens."
    assert reply.json()["error"]["param"] == "max_tokens"
    reply = server.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 100}})
    assert reply.status_code == 400 and reply.json() == {"error": {"message": numbers + "max_new_tokens."}}
    default = client.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body=IGNORE_EOS)
    assert default.usage.completion_tokens == 6 and default.choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "hello " * 40}]
    prompt_tokens = server.post("/tokenize", json={"messages": messages}).json()["count"]
    assert prompt_tokens < 250
    too_many = 256 - prompt_tokens + 1
    reply = server.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": too_many})
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["param"] == "max_completion_tokens"
    expected = f"({prompt_tokens} in the prompt, {too_many} for the completion). Reduce the prompt or max_completion"
    assert expected in err["message"]
    fits = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=too_many - 1, temperature=0)
    assert fits.usage.prompt_tokens == prompt_tokens


def test_chat_n_choices(client):
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=3, temperature=1.0, seed=5)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert 3 <= chat.usage.completion_tokens <= 9
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, n=2, temperature=0, stream=True, logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == sorted(finished) == [0, 1]
    logprob_tokens = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert logprob_tokens == chunks[-1].usage.completion_tokens


def test_openai_errors_are_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert "temperature" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert "messages" in str(err.value)


def test_sglang_extensions_at_neutral_values_are_accepted(client):
    neutral = {"lora_path": None, "return_hidden_states": False, "session_params": None, "custom_params": {"k": 1}}
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body=neutral)
    assert comp.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={**neutral, "stream_reasoning": True, "reasoning_effort": "medium"},
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_sglang_extensions_asking_for_more_are_refused_by_name(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"lora_path": "adapter"})
    assert "unsupported field: lora_path" in str(err.value)
    body = {"prompt": PROMPT, "return_hidden_states": True, "max_tokns": 2}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 400 and set(reply.json()) == {"error"}, reply.text
    err = reply.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert "return_hidden_states" in err["message"] and "unknown field: max_tokns" in err["message"]
    assert err["param"] == "return_hidden_states"


def test_chat_template_sources(tmp_path):
    from sglang_pic.entrypoints.chat_template import BUILTIN_CHAT_TEMPLATES, load_chat_template

    class Tok:
        chat_template = "{{ messages[0]['content'] }}"

    assert load_chat_template(None, Tok()) == Tok.chat_template
    assert load_chat_template("chatml", Tok()) == BUILTIN_CHAT_TEMPLATES["chatml"]
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{{ 'x' }}")
    assert load_chat_template(str(jinja), Tok()) == "{{ 'x' }}"
    as_json = tmp_path / "t.json"
    as_json.write_text('{"chat_template": "{{ \'y\' }}"}')
    assert load_chat_template(str(as_json), Tok()) == "{{ 'y' }}"
    with pytest.raises(ValueError, match="neither a file nor a built-in"):
        load_chat_template("no-such-template", Tok())


def test_span_settings_as_extra_fields(client, server):
    """span_anchor and span_head_tokens (span_policy.py) travel in OpenAI bodies; bad values get a 400 naming them."""
    doc = "<|ssep|>The capital of France is Paris, the capital of Japan is Tokyo, the capital of Peru is Lima.<|pdep|>"
    messages = [{"role": "user", "content": doc + "Capital of Peru?"}]
    bad = server.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "span_head_tokens": -1})
    assert bad.status_code == 400 and "span_head_tokens" in bad.json()["error"]["message"]
    outs = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"span_anchor": "auto", "span_head_tokens": 3})
            for _ in range(2)]
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 0  # the span's tail and the recomputed head, reused
    native = server.post("/generate", json={"text": "Hi" + doc + "x", "span_head_tokens": 3,
                                            "sampling_params": {"max_new_tokens": 1}}).json()
    assert native["meta_info"]["recomputed_span_tokens"] == 3
