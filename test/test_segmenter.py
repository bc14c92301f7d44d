"""The prompt segmenter's fast paths: memoized segment tokenization and the input_ids cut give exactly the results
of tokenizing and scanning afresh (a memo hit is never another text's ids)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing

from sglang_pic.managers.segment_token_cache import SegmentTokenCache
from sglang_pic.managers.segmenter import PromptSegmenter
from sglang_pic.radix_ext.segments import Segment
from sglang_pic.server_args import ServerArgs
from sglang_pic.tokenizer import load_tokenizer
from tiny_models import build_tiny_model

VOCAB = 384
LONG_DOC = " ".join(f"The {i}th passage says that the fox jumps over the lazy dog." for i in range(20))


class CountingEncode:
    """An encode function that records its calls: (text, first) -> tuple of fake ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, text: str, first: bool) -> tuple[int, ...]:
        self.calls.append((text, first))
        return ((1,) if first else ()) + tuple(ord(c) for c in text)


@pytest.fixture(scope="module")
def segmenter(tiny_llama) -> PromptSegmenter:
    args = ServerArgs.from_kwargs(model_path=str(tiny_llama))
    return PromptSegmenter(load_tokenizer(str(tiny_llama)), args, VOCAB)


# ---- SegmentTokenCache -----------------------------------------------------------------------------------------------
def test_cache_hit_returns_the_encoded_ids_without_encoding_again():
    encode = CountingEncode()
    cache = SegmentTokenCache(encode, max_tokens=10_000, min_chars=4)
    assert cache("some text", False) == encode("some text", False)
    encode.calls.clear()
    assert cache("some text", False) == encode("some text", False)
    assert encode.calls == [("some text", False)]  # only the reference call above
    # The prefix flag is part of the key: the same text as a prefix gets its BOS, never the span's ids.
    assert cache("some text", True) == (1,) + tuple(ord(c) for c in "some text")


def test_cache_skips_short_texts_and_evicts_least_recently_used_by_tokens():
    encode = CountingEncode()
    cache = SegmentTokenCache(encode, max_tokens=25, min_chars=4)
    cache("abc", False)
    assert len(cache) == 0  # shorter than min_chars: encoded each time, never stored
    for text in ("a" * 10, "b" * 10):
        cache(text, False)
    cache("a" * 10, False)  # refresh a: b is now the least recently used
    cache("c" * 10, False)  # 30 tokens > 25: b goes
    assert cache.num_tokens == 20 and len(cache) == 2
    encode.calls.clear()
    cache("a" * 10, False)
    cache("b" * 10, False)
    assert encode.calls == [("b" * 10, False)]
    cache("z" * 30, False)  # larger than the whole budget: returned, not stored
    assert cache.num_tokens <= 25


# ---- PromptSegmenter ---------------------------------------------------------------------------------------------
def test_from_text_tokenizes_a_recurring_span_once(segmenter, monkeypatch):
    tokenizer = segmenter.tokenizer
    fresh_span = tuple(tokenizer.encode(LONG_DOC, add_special_tokens=False))
    fresh_prefix = tuple(tokenizer.encode(LONG_DOC, add_special_tokens=True))
    first = segmenter.from_text("Preface one.<|ssep|>" + LONG_DOC + "<|pdep|>Question?")
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(text) or encode(text, **kw))
    second = segmenter.from_text("Another preface.<|ssep|>" + LONG_DOC + "<|pdep|>Other question?")
    assert LONG_DOC not in calls  # the span came from the memo ...
    assert first[1] == second[1] == Segment("span", fresh_span)  # ... and equals a fresh encode
    as_prefix = segmenter.from_text(LONG_DOC + "<|ssep|>doc")
    assert as_prefix[0] == Segment("prefix", fresh_prefix)  # same text as the prefix: its own ids (BOS and all)
    assert LONG_DOC in calls


BATCH_TEXTS = [
    "Preface one.<|ssep|>" + LONG_DOC + "<|pdep|>Question?",
    "<|ssep|>" + LONG_DOC + "<|ssep|>Caf\u00e9 cr\u00e8me, na\u00efve \u65e5\u672c\u8a9e.<|pdep|>  spaces  ",
    LONG_DOC + "<|ssep|>doc",  # the span's text as a prefix: BOS and all
    "   ",
    "Preface one.<|ssep|>short span<|pdep|>Question?",
]


def bos_tokenizer(path):
    """The tiny tokenizer, made to add BOS as special tokens (as Llama's does), so the prefix flag matters."""
    tokenizer = load_tokenizer(str(path))
    bos = tokenizer.bos_token
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    return tokenizer


def test_encode_all_gives_each_segment_its_own_encoding(tiny_llama, monkeypatch):
    """One batch call per kind must give every segment exactly what encoding it alone gives (BOS on the prefix
    only), and from_text then encodes nothing more."""
    args = ServerArgs.from_kwargs(model_path=str(tiny_llama))
    alone = PromptSegmenter(bos_tokenizer(tiny_llama), args, VOCAB)
    expected = [alone.from_text(text) for text in BATCH_TEXTS]
    assert expected[2][0].token_ids[0] == alone.tokenizer.bos_token_id != expected[0][1].token_ids[0]
    batched = PromptSegmenter(bos_tokenizer(tiny_llama), args, VOCAB)
    known = batched.encode_all(BATCH_TEXTS)
    calls = []
    monkeypatch.setattr(batched.tokenizer, "encode", lambda text, **kw: calls.append(text))
    assert [batched.from_text(text, known) for text in BATCH_TEXTS] == expected
    assert calls == []


def _from_ids_reference(ids: list[int], markers: dict[int, str]) -> list[Segment]:
    """The per-token loop the segmenter replaces, kept as the specification of its result and errors."""
    segments = [Segment("prefix", ())]
    current: list[int] = []
    for tok in ids:
        if tok in markers:
            segments[-1] = Segment(segments[-1].kind, tuple(current))
            segments.append(Segment(markers[tok], ()))
            current = []
            continue
        if not 0 <= tok < VOCAB:
            raise ValueError(f"input_ids holds token id {tok}, outside the vocabulary [0, {VOCAB})")
        current.append(tok)
    segments[-1] = Segment(segments[-1].kind, tuple(current))
    for i, seg in enumerate(segments):
        if seg.kind == "span" and not seg.token_ids:
            raise ValueError(f"empty span: span marker #{i} in input_ids is followed by no tokens")
    return segments


def _outcome(fn, ids):
    try:
        return fn(ids)
    except ValueError as e:
        return str(e)


def test_from_ids_matches_the_per_token_scan(segmenter):
    rng = random.Random(0)
    pool = [-2, -1, -1, -3, 0, 5, 200, VOCAB - 1, VOCAB, 10**6] + list(range(1, 40))
    for _ in range(2000):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        expected = _outcome(lambda x: segmenter._finish(_from_ids_reference(x, segmenter.marker_ids)), ids)
        assert _outcome(segmenter.from_ids, ids) == expected, ids


@pytest.mark.parametrize("ids", [[5, True, 6], [5, 6.0], [5, "6"]])
def test_input_ids_must_be_plain_ints(tiny_llama, ids):
    from sglang_pic.managers.io_struct import GenerateReqInput
    from sglang_pic.managers.request_builder import RequestBuilder
    from sglang_pic.model_config import ModelConfig

    args = ServerArgs.from_kwargs(model_path=str(tiny_llama))
    rb = RequestBuilder(args, load_tokenizer(str(tiny_llama)), ModelConfig.from_path(str(tiny_llama), device="cpu"))
    with pytest.raises(ValueError, match="input_ids must be a list of integers"):
        rb.build(GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 1}))
    assert rb.build(GenerateReqInput(input_ids=[5, -1, 6], sampling_params={"max_new_tokens": 1}))


def test_tokenize_benchmark_runs(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    import bench_tokenize

    model = build_tiny_model(tmp_path, "llama", name="llama_4k", max_position_embeddings=4096)  # RAG prompts fit
    out = tmp_path / "tokenize.json"
    result = bench_tokenize.main(["--tokenizer-path", str(model), "--num-samples", "6", "--repeats", "1",
                                  "--out", str(out)])
    assert result["prompts"] == 6 and result["prompt_tokens"] > 6 * 10 * 50 and out.is_file()
