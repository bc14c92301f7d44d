"""What a user trips over gets a clear refusal instead of a quiet wrong answer: a model name the server does not
serve is a 404 in OpenAI's shape (as vLLM answers), a prompt with a broken span marker a 400 naming where it
breaks, and a malformed body the same words on every route."""

from __future__ import annotations

import openai
import pytest

from sglang_pic.managers.segmenter import PromptSegmenter
from sglang_pic.server_args import ServerArgs

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "The weather today is"}]
SMALL = {"max_new_tokens": 2}


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


# ---- unknown model names ----------------------------------------------------------------------------------------
def not_found(name: str) -> dict:
    message = f"The model `{name}` does not exist. This server serves `{MODEL}`."
    return {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}


UNKNOWN_MODEL_ROUTES = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True}),
    ("/v1/completions", {"prompt": "The weather today is", "max_tokens": 2}),
    ("/v1/tokenize", {"prompt": "The weather today is"}),
    ("/v1/detokenize", {"tokens": [5, 6]}),
]


@pytest.mark.parametrize("path,body", UNKNOWN_MODEL_ROUTES, ids=[f"{p}-{len(b)}" for p, b in UNKNOWN_MODEL_ROUTES])
def test_unknown_model_is_404(server, path, body):
    resp = server.post(path, json={**body, "model": "gpt-4o"})
    assert resp.status_code == 404, resp.text
    assert resp.json() == not_found("gpt-4o")


def test_unknown_model_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)


def test_served_names_work_and_answers_name_the_served_model(server, tiny_qwen2):
    """The served name, the model path, SGLang's `default`, and an omitted or empty name all mean this model."""
    for model in (MODEL, str(tiny_qwen2), "default", "", None):
        named = {} if model is None else {"model": model}
        chat = server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **named})
        assert chat.status_code == 200, (model, chat.text)
        assert chat.json()["model"] == MODEL
        completion = server.post("/v1/completions", json={"prompt": "The weather", "max_tokens": 2, **named})
        assert completion.status_code == 200, (model, completion.text)
        assert completion.json()["model"] == MODEL


# ---- broken span markers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,position,marker",
    [
        ("Q.<|ssep The sky is blue.<|pdep|>Color?", 2, "<|ssep|>"),
        ("<|ssep|><|span_settings The sky is blue.<|pdep|>Color?", 8, "<|span_settings|>"),
        ("Q.<|ssep|>The sky is blue.<|pdep Color?", 26, "<|pdep|>"),
        ("Q.<|ssep|", 2, "<|ssep|>"),
    ],
)
def test_broken_marker_is_400_with_its_position(server, text, position, marker):
    resp = server.post("/generate", json={"text": text, "sampling_params": SMALL})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith(f"broken marker at character {position}: "), message
    assert f"'{marker}'" in message


def test_misplaced_span_settings_is_400_with_its_position(server):
    resp = server.post("/generate", json={"text": 'Q.<|span_settings|>{"span_head_tokens": 0}The sky<|pdep|>Color?'})
    assert resp.status_code == 400
    assert "at character 2 must follow a span marker" in resp.json()["error"]["message"]


def test_broken_marker_on_the_openai_routes(server):
    completion = server.post("/v1/completions", json={"prompt": ["fine", "Q.<|ssep The sky"], "max_tokens": 2})
    assert completion.status_code == 400
    assert completion.json()["error"]["message"].startswith("request 1: broken marker at character 2: ")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Doc: <|pdep and more"}]
    chat = server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert chat.status_code == 400
    assert chat.json()["error"]["message"].startswith("messages[1].content: broken marker at character 5: ")
    tokenize = server.post("/tokenize", json={"prompt": "<|ssep|><|span_settings x"})
    assert tokenize.status_code == 400
    assert "broken marker at character 8" in tokenize.json()["error"]["message"]


def test_whole_markers_and_other_text_still_pass(server):
    """Only a marker's opening is reserved: whole markers cut spans, and text that merely looks similar passes."""
    spans = server.post("/tokenize", json={"prompt": "Q.<|ssep|>The sky is blue.<|pdep|>Color?"}).json()
    assert [s["kind"] for s in spans["segments"]] == ["prefix", "span", "pdep"]
    for text in ("a <|im_start|> b", "<|ss and <|pd", "<|SSEP|>", "<ssep|>"):
        resp = server.post("/generate", json={"text": text, "sampling_params": SMALL})
        assert resp.status_code == 200, (text, resp.text)


def test_configured_markers_reserve_their_own_openings():
    """The reserved openings follow --ssep-marker and friends (no tokenizer needed to check text)."""
    args = ServerArgs(model_path="unused", ssep_marker="[[SPAN]]", pdep_marker="[[ASK]]")
    segmenter = PromptSegmenter(None, args, vocab_size=10)
    segmenter.check_markers("x [[SPAN]] doc [[ASK]] q <|ssep")  # the defaults mean nothing here
    with pytest.raises(ValueError, match=r"character 4: .*'\[\[SPAN\]\]'"):
        segmenter.check_markers("doc [[SPAN] x")


# ---- malformed JSON -----------------------------------------------------------------------------------------------
def test_malformed_json_reads_the_same_on_every_route(server):
    broken = b'{"messages": [1,'
    messages = set()
    for path in ("/generate", "/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/detokenize",
                 "/abort_request"):
        resp = server.post(path, data=broken, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, (path, resp.text)
        messages.add(resp.json()["error"]["message"])
    assert len(messages) == 1, messages
    assert messages.pop().startswith("malformed JSON body: ")
