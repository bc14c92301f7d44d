"""Engine.async_generate: concurrent asyncio calls are batched into shared steps and give generate's outputs, the
event loop keeps running while steps compute, and a stream closed early aborts its request and frees its KV."""

from __future__ import annotations

import asyncio

import pytest

from sglang_pic import Engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Paris is the capital of", "def span(doc):"]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with Engine(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048) as eng:
        yield eng


def test_concurrent_calls_share_steps_and_match_generate(engine):
    expected = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    steps_before = engine.scheduler.stats.num_decode_steps

    async def main() -> list[dict]:
        return await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in PROMPTS))

    outs = asyncio.run(main())
    assert [o["output_ids"] for o in outs] == expected
    # one call alone would take 23 decode steps; run one after another, four would take 92
    assert engine.scheduler.stats.num_decode_steps - steps_before < 2 * GREEDY["max_new_tokens"]
    batch = asyncio.run(engine.async_generate(PROMPTS[:2], GREEDY))
    assert [o["output_ids"] for o in batch] == expected[:2]


def test_stream_gives_cumulative_chunks_and_the_loop_keeps_running(engine):
    whole = engine.generate(PROMPTS[1], GREEDY)

    async def main() -> tuple[list[dict], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        chunks = [c async for c in await engine.async_generate(PROMPTS[1], GREEDY, stream=True)]
        task.cancel()
        return chunks, ticks

    chunks, ticks = asyncio.run(main())
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert len(chunks) >= GREEDY["max_new_tokens"]
    assert all(whole["text"].startswith(c["text"]) for c in chunks)
    assert ticks > len(chunks)  # the loop ran between (and during) the steps


def test_closing_a_stream_early_aborts_its_request(engine):
    long = {**GREEDY, "max_new_tokens": 200}

    async def main() -> dict:
        stream = await engine.async_generate(PROMPTS[2], long, stream=True)
        first = await anext(stream)
        await stream.aclose()
        return first

    first = asyncio.run(main())
    assert first["meta_info"]["finish_reason"] is None
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.get_stats()["token_usage"] == 0
