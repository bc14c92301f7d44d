"""The detokenizer process: turns the scheduler's token deltas into `/generate` outputs with cumulative text.

It is the client's side of managers/output_format.py: each live request's reports add up in a ReqOutput, which the
OutputFormatter formats just as the offline Engine does (the same stop-string trimming, the same held-back partial
characters).
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
from sglang_pic.managers.output_format import OutputFormatter, RequestOutputs
from sglang_pic.server_args import ServerArgs
from sglang_pic.tokenizer import load_tokenizer
from sglang_pic.utils_process import ModelFiles, parent_alive, prepare_child

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000


class DetokenizerManager:
    def __init__(self, files: ModelFiles) -> None:
        self.outputs = RequestOutputs(OutputFormatter(load_tokenizer(files.tokenizer_dir)))

    def handle(self, batch: BatchTokenOutput) -> BatchGenerateOutput:
        outputs = []
        for delta in batch.deltas:
            out = self.apply(delta)
            if out is not None:
                outputs.append(out)
        return BatchGenerateOutput(outputs)

    def apply(self, delta: TokenDelta) -> GenerateOutput | None:
        out = self.outputs.apply(delta)
        if out is None:
            logger.error("detokenizer got output for unknown request %s", delta.rid)
            return None
        return GenerateOutput(delta.rid, out, delta.finished_reason is not None)


def run_detokenizer_process(server_args: ServerArgs, files: ModelFiles, names: IpcNames) -> None:
    parent_pid = prepare_child(server_args.log_level)
    try:
        manager = DetokenizerManager(files)
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
