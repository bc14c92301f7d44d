"""Run SGLang frontend programs on the offline Engine (no HTTP): `sgl.set_default_backend(EngineBackend(engine))`.

It reuses RuntimeEndpoint's program logic (select's logprob scoring, token healing) and swaps only the transport:
every request body that RuntimeEndpoint would POST to `/generate` goes to `Engine.generate_request` instead.
"""

from __future__ import annotations

from typing import Any

from sglang.global_config import global_config
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path


class EngineBackend(RuntimeEndpoint):
    def __init__(self, engine, chat_template_name: str | None = None) -> None:
        BaseBackend.__init__(self)
        self.engine = engine
        self.support_concate_and_append = False
        self.model_info = engine.get_model_info()
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = get_chat_template_by_model_path(self.model_info["model_path"])

    def _request(self, s, sampling_params, stream: bool) -> dict[str, Any]:
        self._handle_dtype_to_regex(sampling_params)
        data: dict[str, Any] = {
            "text": s.text_,
            "sampling_params": {
                "skip_special_tokens": global_config.skip_special_tokens_in_output,
                "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                **sampling_params.to_srt_kwargs(),
            },
            "stream": stream,
        }
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        return data

    def _generate_http_request(self, s, data: dict[str, Any]) -> Any:
        return self.engine.generate_request(data)

    def generate(self, s, sampling_params):
        out = self.engine.generate_request(self._request(s, sampling_params, stream=False))
        return out["text"], out["meta_info"]

    def generate_stream(self, s, sampling_params):
        pos = 0
        for chunk in self.engine.generate_request(self._request(s, sampling_params, stream=True)):
            delta = chunk["text"][pos:]
            pos += len(delta)
            yield delta, chunk["meta_info"]

    def cache_prefix(self, prefix_str: str) -> None:
        self.engine.generate_request({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s) -> None:
        self.cache_prefix(s.text_)

    def fill_image(self, s) -> None:
        raise NotImplementedError("images are not supported")

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        self.engine.shutdown()
