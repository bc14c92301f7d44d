"""The OpenAI-compatible routes: /v1/models and /tokenize, /detokenize (both also under /v1) here; completions
(openai_completions.py) and chat (openai_chat.py) in their own handlers, which build on openai_handler.py."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sglang_pic.entrypoints.openai_chat import ChatHandler
from sglang_pic.entrypoints.openai_completions import CompletionsHandler
from sglang_pic.entrypoints.openai_handler import refusal, unknown_model
from sglang_pic.entrypoints.openai_protocol import DetokenizeRequest, TokenizeRequest
from sglang_pic.entrypoints.openai_responses import ModelCard, ModelList
from sglang_pic.entrypoints.request_body import read_object
from sglang_pic.managers.server_tokenizer_manager import ServerTokenizerManager


class OpenAIServing:
    def __init__(self, manager: ServerTokenizerManager) -> None:
        self.manager = manager
        self.completions = CompletionsHandler(manager)
        self.chat = ChatHandler(manager)

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/v1/completions", self.completions.handle, methods=["POST"])
        router.add_api_route("/v1/chat/completions", self.chat.handle, methods=["POST"])
        for path in ("/tokenize", "/v1/tokenize"):
            router.add_api_route(path, self.tokenize, methods=["POST"])
        for path in ("/detokenize", "/v1/detokenize"):
            router.add_api_route(path, self.detokenize, methods=["POST"])
        return router

    async def models(self) -> Response:
        card = ModelCard(
            id=self.manager.served_model_name,
            root=self.manager.served_model_name,
            max_model_len=self.manager.context_len,
        )
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    async def tokenize(self, request: Request) -> Response:
        """The ids /generate runs for each prompt (or /v1/chat/completions for chat messages) and, as PIC sees
        them, its segments (prefix, span, pdep) with their lengths: what a client counts before sending, and how
        its markers cut the prompt."""
        try:
            body = TokenizeRequest.model_validate(await read_object(request))
            refused = unknown_model(request, self.manager, body.model)
            if refused is not None:
                return refused
            single = body.messages is not None or isinstance(body.prompt, str)
            if body.messages is not None:
                prompts = [self.chat.render_chat(body.chat())]
            else:
                prompts = [body.prompt] if single else body.prompt
            cut = [self.manager.request_builder.tokenize(p, body.add_special_tokens) for p in prompts]
        except ValueError as e:  # pydantic's ValidationError too
            return refusal(request, e)
        tokens = [[t for seg in segments for t in seg.token_ids] for segments in cut]
        parts = [[{"kind": seg.kind, "count": len(seg.token_ids)} for seg in segments] for segments in cut]

        def one_or_all(values: list) -> Any:
            return values[0] if single else values

        content = {
            "tokens": one_or_all(tokens),
            "count": one_or_all([len(t) for t in tokens]),
            "max_model_len": self.manager.context_len,
            "segments": one_or_all(parts),
        }
        return Response(json.dumps(content), media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        try:
            body = DetokenizeRequest.model_validate(await read_object(request))
            refused = unknown_model(request, self.manager, body.model)
            if refused is not None:
                return refused
            single = not body.tokens or isinstance(body.tokens[0], int)
            texts = [
                self.manager.request_builder.detokenize(ids, body.skip_special_tokens)
                for ids in ([body.tokens] if single else body.tokens)
            ]
        except ValueError as e:  # pydantic's ValidationError too
            return refusal(request, e)
        return Response(json.dumps({"text": texts[0] if single else texts}), media_type="application/json")
