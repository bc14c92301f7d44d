"""The detokenizer process: turns the scheduler's token deltas into `/generate` outputs with cumulative text.

For each live request it keeps a mirror `Req` holding only what formatting reads (output ids, finish reason,
cache counts, logprobs) and formats it with `TokenizerManager.format_output`, so the server's wire format, its
stop-string trimming and its held-back partial characters are exactly the offline Engine's.
"""

from __future__ import annotations

import logging
import sys
import traceback

import zmq

from sglang_pic.managers.ipc import (
    BatchGenerateOutput,
    BatchTokenOutput,
    GenerateOutput,
    IpcNames,
    TokenDelta,
    pull_socket,
    push_socket,
)
from sglang_pic.managers.req import Req
from sglang_pic.server_args import ServerArgs
from sglang_pic.utils_process import ModelFiles, parent_alive, prepare_child

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, files: ModelFiles) -> None:
        from sglang_pic.managers.tokenizer_manager import TokenizerManager
        from sglang_pic.model_config import ModelConfig
        from sglang_pic.tokenizer import load_tokenizer

        model_config = ModelConfig.from_server_args(files.model_dir, server_args, "cpu")
        self.formatter = TokenizerManager(server_args, load_tokenizer(files.tokenizer_dir), model_config)
        self.mirrors: dict[str, tuple[Req, bool]] = {}  # rid -> (mirror, return_text_in_logprobs)

    def handle(self, batch: BatchTokenOutput) -> BatchGenerateOutput:
        outputs = []
        for delta in batch.deltas:
            out = self.apply(delta)
            if out is not None:
                outputs.append(out)
        return BatchGenerateOutput(outputs)

    def apply(self, delta: TokenDelta) -> GenerateOutput | None:
        if delta.header is not None:
            h = delta.header
            mirror = Req(
                rid=delta.rid,
                segments=[],
                sampling_params=h.sampling_params,
                prompt_len=h.prompt_len,
                return_logprob=h.return_logprob,
                created_time=h.created_time,
                input_token_logprobs=h.input_token_logprobs,
                input_top_logprobs=h.input_top_logprobs,
                token_ids_logprob=h.token_ids_logprob,
                input_token_ids_logprobs=h.input_token_ids_logprobs,
            )
            self.mirrors[delta.rid] = (mirror, h.return_text_in_logprobs)
        entry = self.mirrors.get(delta.rid)
        if entry is None:
            logger.error("detokenizer got output for unknown request %s", delta.rid)
            return None
        mirror, with_text = entry
        mirror.output_ids.extend(delta.new_ids)
        mirror.output_token_logprobs.extend(delta.new_output_token_logprobs)
        mirror.output_top_logprobs.extend(delta.new_output_top_logprobs)
        mirror.output_token_ids_logprobs.extend(delta.new_output_token_ids_logprobs)
        mirror.finished_reason = delta.finished_reason
        mirror.cached_prefix_tokens = delta.cached_prefix_tokens
        mirror.cached_span_tokens = delta.cached_span_tokens
        mirror.recomputed_span_tokens = delta.recomputed_span_tokens
        mirror.first_token_time = delta.first_token_time
        finished = delta.finished_reason is not None
        if finished:
            del self.mirrors[delta.rid]
        return GenerateOutput(delta.rid, self.formatter.format_output(mirror, with_text), finished)


def run_detokenizer_process(server_args: ServerArgs, files: ModelFiles, names: IpcNames) -> None:
    parent_pid = prepare_child(server_args.log_level)
    try:
        manager = DetokenizerManager(server_args, files)
        ctx = zmq.Context()
        inbox = pull_socket(ctx, names.detokenizer_input)
        to_main = push_socket(ctx, names.tokenizer_input)
        while parent_alive(parent_pid):
            if not inbox.poll(IDLE_POLL_MS):
                continue
            batch = inbox.recv_pyobj()
            result = manager.handle(batch)
            if result.outputs:
                to_main.send_pyobj(result)
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        sys.exit(1)
