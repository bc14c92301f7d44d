"""The server's log: one INFO line per HTTP request (route, status, latency; a generation's rid and prompt, span,
cached and completion tokens; a refusal's error), polling routes quiet while they succeed, prompts and outputs only
with --log-requests; the first start's steps at INFO, and progress bars only on a terminal."""

from __future__ import annotations

import hashlib
import io
import logging
import re
import sys
import time
from pathlib import Path

import pytest
from server_utils import ServerProcess

from sglang_pic.entrypoints.request_log import PARTIAL_CHARS, RequestRecord
from sglang_pic.managers.io_struct import GenerateReqInput

LINE_WAIT_S = 60  # a line is written once its answer has gone; this only bounds a wait for one that never comes
PROMPT = "The capital of France is<|ssep|>Paris, the capital of Japan is Tokyo.<|pdep|> and of Italy?"


@pytest.fixture(scope="module")
def server(chat_server):
    """The shared tiny-chat server, which logs at INFO; other modules' requests have lines there too."""
    return chat_server


def request_lines(server: ServerProcess) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if " sglang_pic.entrypoints.request_log: " in line]


def lines_with(server: ServerProcess, needle: str) -> list[str]:
    return [line for line in request_lines(server) if needle in line]


def log_line(server: ServerProcess, needle: str, earlier: int = 0) -> str:
    """The request line holding `needle` after the `earlier` ones that hold it too (other modules share the server),
    waiting for it: the reply can reach the client before its line is written."""
    deadline = time.monotonic() + LINE_WAIT_S
    while time.monotonic() < deadline:
        found = lines_with(server, needle)
        if len(found) > earlier:
            assert len(found) == earlier + 1, found
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no request line with {needle!r}:\n{server.log_tail()}")


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r" (\w+)=(\S+)", line))


def test_generation_line_counts_the_prompt(server):
    """prompt_tokens and span_tokens as /tokenize counts them, cached_tokens and completion_tokens as meta_info."""
    segments = server.post("/tokenize", json={"prompt": PROMPT}).json()
    spans = sum(s["count"] for s in segments["segments"] if s["kind"] == "span")
    params = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}
    for rid in ("log-first", "log-again"):
        out = server.post("/generate", json={"text": PROMPT, "sampling_params": params, "rid": rid}).json()
        line = log_line(server, f"rid={rid} ")
        assert re.search(r"\] INFO .*: POST /generate 200 \d+\.\d{3}s rid=", line), line
        assert fields(line) == {
            "rid": rid,
            "prompt_tokens": str(segments["count"]),
            "span_tokens": str(spans),
            "cached_tokens": str(out["meta_info"]["cached_tokens"]),
            "completion_tokens": "3",
        }
    assert int(fields(line)["cached_tokens"]) > 0  # the second run found the first one's prompt
    assert "Paris" not in line  # prompts stay out of the log without --log-requests


def test_streamed_chat_line(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "ignore_eos": True,
            "stream": True, "rid": "log-chat"}
    with server.post("/v1/chat/completions", json=body, stream=True) as resp:
        assert resp.status_code == 200
        assert resp.text.rstrip().endswith("data: [DONE]")
    line = log_line(server, "rid=log-chat ")
    assert " POST /v1/chat/completions 200 " in line
    assert fields(line)["completion_tokens"] == "4"


def test_refusals_are_logged_with_their_error(server):
    assert server.post("/generate", json={"text": "zz<|ssep log-test words"}).status_code == 400
    line = log_line(server, "log-test")
    assert " INFO " in line and " POST /generate 400 " in line
    assert 'error="broken marker at character 2: ' in line
    missing = {"model": "no-such-model-for-the-log", "prompt": "hi"}
    assert server.post("/v1/completions", json=missing).status_code == 404
    line = log_line(server, "no-such-model-for-the-log")
    assert " POST /v1/completions 404 " in line and "does not exist" in line
    bad_json = " POST /v1/detokenize 400 "
    earlier = len(lines_with(server, bad_json))
    assert server.post("/v1/detokenize", data=b"{oops").status_code == 400
    assert 'error="malformed JSON body: ' in log_line(server, bad_json, earlier)


def test_polls_stay_out_of_the_info_log(server):
    for path in ("/health", "/metrics", "/get_load"):
        assert server.get(path).status_code == 200
    info = " GET /get_model_info 200 "
    earlier = len(lines_with(server, info))
    assert server.get("/get_model_info").status_code == 200
    log_line(server, info, earlier)  # written after the polls' lines would have been
    polled = [line for line in request_lines(server) if re.search(r" GET /(health|metrics|get_load) ", line)]
    assert polled == []


def test_log_requests_levels_add_the_contents():
    """--log-requests adds SGLang's level of detail to the line: sampling params, then prompts and outputs cut to
    PARTIAL_CHARS characters, then whole."""
    record = RequestRecord(inputs=GenerateReqInput(text="p" * 3000, sampling_params={"temperature": 0}))
    record.outputs = [{"text": "answer", "meta_info": {}}]
    plain = record.line("POST", "/generate", 200, 0.25, None)
    assert plain == "POST /generate 200 0.250s"
    assert record.line("POST", "/generate", 200, 0.25, 0) == plain
    assert record.line("POST", "/generate", 200, 0.25, 1) == plain + ' sampling_params={"temperature": 0}'
    partial = record.line("POST", "/generate", 200, 0.25, 2)
    assert f'input="{"p" * (PARTIAL_CHARS - 1)}...(' in partial and 'output="answer"' in partial
    assert f'input="{"p" * 3000}"' in record.line("POST", "/generate", 200, 0.25, 3)


# ---- the first start ----------------------------------------------------------------------------------------------
def test_first_start_steps_log_at_info(monkeypatch, tmp_path, caplog):
    """Assembling the embedded model logs each step at INFO (the server's default level shows them), none louder."""
    from sglang_pic.model_loader import default_model

    parts = []
    for i in range(len(default_model.PART_PACKAGES)):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(bytes([i]) * 100)
    whole = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setenv("SGLANG_PIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_part_file", lambda index: parts[index - 1])
    monkeypatch.setattr(default_model, "GGUF_SIZE", len(whole))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(whole).hexdigest())
    caplog.set_level(logging.INFO)
    assert default_model.assemble_gguf().read_bytes() == whole
    steps = [r for r in caplog.records if r.name == default_model.__name__]
    assert [r.levelno for r in steps] == [logging.INFO, logging.INFO]
    assert "assembling" in steps[0].getMessage() and "sha256" in steps[1].getMessage()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_conversion_progress_bars_only_on_a_terminal(monkeypatch, tmp_path, capsys):
    """A GGUF conversion's bars (transformers' GGUF reader and its weight loading) go to a terminal, never into a
    log file; the switches are as they were afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    from sglang_pic.model_loader import gguf_convert

    def dequantize(gguf_file: Path, out: Path) -> None:
        for _ in gguf_reader.tqdm(range(3), desc="reading tensors"):
            pass
        for _ in hf_logging.tqdm(range(3), desc="loading weights"):
            pass
        out.mkdir()
        (out / gguf_convert._DONE_MARKER).write_text("{}")

    monkeypatch.setattr(gguf_convert, "_dequantize_to", dequantize)
    reader_tqdm, enabled = gguf_reader.tqdm, hf_logging.is_progress_bar_enabled()
    for name in ("log.gguf", "terminal.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    gguf_convert.convert_gguf(tmp_path / "log.gguf", tmp_path / "cache")  # stderr is pytest's capture
    written = capsys.readouterr().err
    assert "reading tensors" not in written and "loading weights" not in written
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    gguf_convert.convert_gguf(tmp_path / "terminal.gguf", tmp_path / "cache")
    assert "reading tensors" in terminal.getvalue()
    assert gguf_reader.tqdm is reader_tqdm and hf_logging.is_progress_bar_enabled() == enabled
