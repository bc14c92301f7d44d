"""SGLang's request fields without a server: every field the installed SGLang (0.5.9) defines for a body served here
is either served or listed with its neutral values (sglang_fields); neutral values pass, others and unknown names
are refused, each by name; FastAPI's request-validation errors answer in each API's error shape."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from sglang_pic.entrypoints import http_server
from sglang_pic.entrypoints.errors import install_error_handlers
from sglang_pic.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.profiler import PROFILE_FIELDS
from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.sglang_fields import (
    ABORT_FIELDS,
    GENERATE_ALIASES,
    GENERATE_FIELDS,
    SAMPLING_ALIASES,
    SAMPLING_FIELDS,
    START_PROFILE_FIELDS,
    UPDATE_WEIGHTS_FIELDS,
    Ignored,
    accept_fields,
)


def sglang_source(relative: str) -> ast.Module:
    """A module of the installed SGLang, parsed rather than imported (its server side needs GPU-only packages)."""
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        pytest.skip(f"the installed sglang has no {relative}")
    return ast.parse(path.read_text())


def class_fields(module: ast.Module, name: str) -> set[str]:
    """The annotated fields of a class and of its bases defined in the same module."""
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}
    node = classes[name]
    names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            names |= class_fields(module, base.id)
    return names


def test_every_sglang_generate_field_is_served_or_ignored():
    sglang = class_fields(sglang_source("srt/managers/io_struct.py"), "GenerateReqInput")
    served = {f.name for f in dataclasses.fields(GenerateReqInput)}
    assert "lora_path" in sglang and "return_routed_experts" in sglang
    assert sglang - served - set(GENERATE_FIELDS) - set(GENERATE_ALIASES) == set()


def test_every_sglang_sampling_key_is_served_or_ignored():
    module = sglang_source("srt/sampling/sampling_params.py")
    init = next(
        node for cls in module.body if isinstance(cls, ast.ClassDef) and cls.name == "SamplingParams"
        for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    sglang = {a.arg for a in init.args.args[1:]}
    served = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert sglang - served - set(SAMPLING_FIELDS) - set(SAMPLING_ALIASES) == set()


@pytest.mark.parametrize(
    "sglang_class,served,ignored",
    [
        ("AbortReq", http_server.ABORT_REQUEST_FIELDS, ABORT_FIELDS),
        ("UpdateWeightFromDiskReqInput", http_server.UPDATE_WEIGHTS_REQUEST_FIELDS, UPDATE_WEIGHTS_FIELDS),
        ("ProfileReqInput", PROFILE_FIELDS, START_PROFILE_FIELDS),
    ],
)
def test_every_sglang_admin_field_is_served_or_ignored(sglang_class, served, ignored):
    sglang = class_fields(sglang_source("srt/managers/io_struct.py"), sglang_class)
    assert sglang - set(served) - set(ignored) == set()


def test_every_sglang_openai_extension_is_served_or_ignored():
    from sglang.srt.entrypoints.openai import protocol

    for theirs, ours in ((protocol.CompletionRequest, CompletionRequest), (protocol.ChatCompletionRequest,
                                                                           ChatCompletionRequest)):
        assert set(theirs.model_fields) - set(ours.model_fields) - set(ours.ignored_fields) == set(), theirs.__name__


def test_neutral_values_are_exact():
    flag = Ignored((False,), "x")
    assert flag.accepts(False) and flag.accepts([False, False]) and flag.accepts([])
    assert not flag.accepts(0) and not flag.accepts(None) and not flag.accepts([False, True])
    assert Ignored(None).accepts({"anything": 1})
    assert flag.hint() == "send false or leave it out"


def test_bench_serving_payload_is_accepted():
    """`bench_serving --backend sglang`'s body, which was refused with `unknown fields: lora_path, ...`."""
    body = {
        "text": "Hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
        "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    obj = GenerateReqInput.from_json(body)
    assert (obj.text, obj.stream, obj.return_logprob, obj.logprob_start_len) == ("Hello", True, False, -1)


def test_null_means_the_default_and_aliases_resolve():
    obj = GenerateReqInput.from_json({"text": "x", "return_logprob": None, "top_logprobs_num": None,
                                      "routed_dp_rank": 1})
    assert (obj.return_logprob, obj.top_logprobs_num, obj.data_parallel_rank) == (False, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank and routed_dp_rank disagree"):
        GenerateReqInput.from_json({"text": "x", "data_parallel_rank": 0, "routed_dp_rank": 1})
    assert SamplingParams.from_dict({"sampling_seed": 3, "seed": None, "stream_interval": None}).seed == 3


def test_every_bad_field_is_named_once():
    body = {"text": "x", "lora_path": "a", "return_hidden_states": True, "temprature": 0, "strem": True}
    with pytest.raises(ValueError) as err:
        GenerateReqInput.from_json(body)
    message = str(err.value)
    assert message.startswith('unsupported fields: lora_path="a" (LoRA adapters; send null or leave it out), '
                              "return_hidden_states=true")
    assert message.endswith("; unknown fields: strem, temprature")
    with pytest.raises(ValueError, match="unsupported field: return_routed_experts=0"):
        GenerateReqInput.from_json({"text": "x", "return_routed_experts": 0})
    with pytest.raises(ValueError, match="unknown sampling parameter: max_tokens"):
        SamplingParams.from_dict({"max_tokens": 3})


def test_fields_of_other_request_types_are_not_taken():
    """Neutral for one SGLang type is not a pass everywhere: flush_cache belongs to weight updates only."""
    with pytest.raises(ValueError, match="unknown field: flush_cache"):
        GenerateReqInput.from_json({"text": "x", "flush_cache": True})
    assert accept_fields({"flush_cache": True, "model_path": "m"}, {"model_path"}, UPDATE_WEIGHTS_FIELDS) == {
        "model_path": "m"
    }


def fastapi_error(path: str, exc: Exception) -> tuple[int, dict]:
    """Run the app's handler for `exc` as if raised while serving `path`."""
    from fastapi import FastAPI

    app = FastAPI()
    install_error_handlers(app)
    handler = app.exception_handlers[type(exc)]
    request = Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b""})
    response = asyncio.run(handler(request, exc))
    return response.status_code, json.loads(response.body)


def test_request_validation_errors_answer_in_each_apis_shape():
    exc = RequestValidationError([{"loc": ("query", "n"), "msg": "Input should be a valid integer", "type": "int"}])
    status, body = fastapi_error("/v1/models", exc)
    assert status == 400 and body == {"error": {"message": "query.n: Input should be a valid integer",
                                                "type": "BadRequestError", "param": "query.n", "code": 400}}
    status, body = fastapi_error("/get_model_info", exc)
    assert status == 400 and body == {"error": {"message": "query.n: Input should be a valid integer"}}


def test_http_errors_answer_in_each_apis_shape():
    status, body = fastapi_error("/v1/x", HTTPException(404))
    assert status == 404 and body["error"]["type"] == "NotFoundError" and "GET /v1/x" in body["error"]["message"]
    status, body = fastapi_error("/x", HTTPException(405, headers={"Allow": "POST"}))
    assert status == 405 and body == {"error": {"message": "Method Not Allowed: GET /x (allowed: POST)"}}
