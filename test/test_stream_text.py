"""Streamed outputs: text decoded piece by piece (tokenizer.DecodeWindow) equals decoding the whole output at every
step, the server keeps only the newest cumulative output of a request, and logprob entries carry their token's text."""

from __future__ import annotations

import random

import pytest
from sglang_pic import Engine
from sglang_pic.tokenizer import (
    DecodeWindow,
    fast_decode,
    load_tokenizer,
    plain_backend,
)

CORPUS = [
    "Paris is the capital of France. Café crème, naïve façade, and 東京 are words with multi-byte characters.",
    "The quick brown fox jumps over the lazy dog; emoji like 🙂 and 🚀 take four bytes each in UTF-8.",
    "def span(doc):\n    return '<ssep>' + doc  # a code line, with   extra   spaces\n",
]
SPECIAL = ["<s>", "</s>", "<|im_end|>"]


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|im_end|>"])


def _metaspace_tokenizer():
    """SentencePiece-style BPE: words start with '▁', and decoding drops the space before the first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *SPECIAL, *bytes_],
                                                              show_progress=False))
    return _wrap(tok)


def _wordpiece_tokenizer():
    """WordPiece: decoding joins pieces with spaces unless a piece continues a word ('##')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL],
                                                                    show_progress=False))
    return _wrap(tok)


def _stream(tok, batches: list[list[int]]) -> tuple[int, int]:
    """Feed `batches` of ids one after another; after each, the streamed text (the window's, or the whole decode
    where the window declines) must equal the whole decode without its trailing partial character. Returns (texts
    that held back a partial character, steps where the window declined)."""
    decode = fast_decode(tok)
    held = declined = 0
    for skip in (False, True):
        window, ids = DecodeWindow(), []
        for batch in batches:
            ids += batch
            whole = decode(ids, skip_special_tokens=skip)
            got = window.advance(ids, decode, skip_special_tokens=skip)
            declined += got is None
            assert (whole.rstrip("\ufffd") if got is None else got) == whole.rstrip("\ufffd"), (skip, len(ids))
            held += whole.endswith("\ufffd")
    return held, declined


def _random_batches(tok, seed: int, steps: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 3))] for _ in range(steps)]


def _text_batches(tok) -> list[list[int]]:
    ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    return [ids[i : i + 2] for i in range(0, len(ids), 2)]


def test_window_equals_whole_decode_byte_level(tiny_llama):
    tok = load_tokenizer(str(tiny_llama))
    assert plain_backend(tok) is not None
    results = [_stream(tok, _random_batches(tok, seed)) for seed in range(4)]
    assert sum(held for held, _ in results) > 0  # random bytes did split characters
    assert all(declined == 0 for _, declined in results)  # byte-level decoding is piecewise: the window always works
    assert _stream(tok, _text_batches(tok))[1] == 0


@pytest.mark.parametrize("build", [_metaspace_tokenizer, _wordpiece_tokenizer], ids=["metaspace", "wordpiece"])
def test_window_equals_whole_decode_other_decoders(build):
    """Real text streams through the window; random ids may hit decodings that later tokens change (byte-fallback
    runs turn invalid as a whole), where the window declines and the whole decode is used."""
    tok = build()
    assert plain_backend(tok) is not None
    assert _stream(tok, _text_batches(tok))[1] == 0
    for seed in range(3):
        _stream(tok, _random_batches(tok, seed))


def test_window_decodes_only_the_recent_ids(tiny_llama):
    """Each step decodes the window (ids since the last piece but one), not the whole output."""
    tok = load_tokenizer(str(tiny_llama))
    text_ids = tok.encode(" ".join(["plain ascii words"] * 200), add_special_tokens=False)
    lengths: list[int] = []

    def counting_decode(ids, **kwargs):
        lengths.append(len(ids))
        return tok.decode(ids, **kwargs)

    window = DecodeWindow()
    for n in range(1, len(text_ids) + 1):
        assert window.advance(text_ids[:n], counting_decode) == tok.decode(text_ids[:n])
    assert max(lengths) <= 2


def test_engine_stream_text_equals_whole_decode(tiny_llama):
    """Through the Engine: every streamed chunk's text is the whole decode of its output ids so far."""
    tok = load_tokenizer(str(tiny_llama))
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "seed": 3}
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, random_seed=0) as engine:
        chunks = list(engine.generate(["Paris is", "Café crème"], params, stream=True))
    assert len(chunks) > 40
    for chunk in chunks:
        whole = tok.decode(chunk["output_ids"])
        if chunk["meta_info"]["finish_reason"] is None:
            whole = whole.rstrip("\ufffd")
        assert chunk["text"] == whole


class _Output(dict):
    """An output dict that weak references can watch."""


def test_server_holds_only_the_newest_output_of_a_request():
    """The server's tokenizer manager keeps a request's newest cumulative output, not every one: those carry all ids
    and the whole text so far, and a stream whose client read slower than the steps held each one in between."""
    import asyncio
    import gc
    import weakref
    from types import SimpleNamespace

    from sglang_pic.managers.ipc import GenerateOutput
    from sglang_pic.managers.server_tokenizer_manager import (
        ReqState,
        ServerTokenizerManager,
    )

    manager = object.__new__(ServerTokenizerManager)  # only the output path: no processes, no sockets
    manager.metrics = SimpleNamespace(on_output=lambda *args: None)
    manager._dispatcher = SimpleNamespace(release=lambda rid: None)
    state = ReqState("r", stream=True, wake=asyncio.Event())
    manager.states = {"r": state}
    watched = []
    for n in range(1, 51):
        out = _Output(text="x" * n, output_ids=list(range(n)), meta_info={"completion_tokens": n})
        watched.append(weakref.ref(out))
        manager._on_output(GenerateOutput("r", out, finished=n == 50))
        del out
    gc.collect()
    assert [ref() is not None for ref in watched] == [False] * 49 + [True]
    assert state.finished and state.latest["meta_info"]["completion_tokens"] == 50


def test_streamed_logprob_texts_are_each_tokens_text(tiny_llama):
    """Logprob entries carry each token's own text (decoded once per token id and remembered) in every chunk."""
    tok = load_tokenizer(str(tiny_llama))
    kwargs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048, random_seed=0) as engine:
        chunks = list(engine.generate("Café crème and 東京", params, stream=True, **kwargs))
    for chunk in chunks:
        meta = chunk["meta_info"]
        entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
        entries += [e for row in meta["input_top_logprobs"] + meta["output_top_logprobs"] if row for e in row]
        assert entries and all(text == tok.decode([token]) for _, token, text in entries)
