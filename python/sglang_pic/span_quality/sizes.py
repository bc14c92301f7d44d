"""How big the tasks' prompts are, and the command-line flags that set it (one per field)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from sglang_pic.span_quality.pools import STDLIB_FUNCTIONS, TOOL_SPECS

LONG_ROOM = 64  # tokens a long_spans chronicle leaves below its length range and for the fact above it


@dataclass(frozen=True)
class TaskSizes:
    """How big each task's prompts are. With the defaults a CPU run of a 0.5B model takes minutes per task, except
    long_spans, whose prompts of several thousand tokens take that per request."""

    qa_docs: int = 5  # factual_qa's and multi_turn's
    qa_pool: int = 30
    num_tools: int = 5
    needle_spans: int = 8
    needle_pool: int = 40
    depth_buckets: int = 4  # needle's and long_spans'
    records_docs: int = 5
    records_pool: int = 30
    code_functions: int = 4
    long_docs: int = 3
    long_pool: int = 6
    long_tokens: tuple[int, int] = (1024, 4096)

    def __post_init__(self) -> None:
        for pool, drawn, what in ((self.qa_pool, self.qa_docs, "qa_pool < qa_docs"),
                                  (len(TOOL_SPECS), self.num_tools, f"num_tools > {len(TOOL_SPECS)} tools defined"),
                                  (self.needle_pool, self.needle_spans - 1, "needle_pool < needle_spans - 1"),
                                  (self.records_pool, self.records_docs, "records_pool < records_docs"),
                                  (len(STDLIB_FUNCTIONS), self.code_functions,
                                   f"code_functions > {len(STDLIB_FUNCTIONS)} functions listed"),
                                  (self.long_pool, self.long_docs, "long_pool < long_docs")):
            if drawn < 1 or pool < drawn:
                raise ValueError(f"task sizes: {what} (or a size below 1)")
        if not 1 <= self.depth_buckets <= self.needle_spans:
            raise ValueError(f"task sizes: depth_buckets must be in [1, needle_spans], got {self.depth_buckets}")
        low, high = self.long_tokens
        if low < 1 or high - low < 2 * LONG_ROOM:
            raise ValueError(f"task sizes: long_tokens must be MIN,MAX with MIN >= 1 and MAX - MIN >= {2 * LONG_ROOM}, "
                             f"got {low},{high}")


def _int_pair(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_size_flags(parser: argparse.ArgumentParser, sizes: type[TaskSizes]) -> None:
    """A flag per field of `sizes` (a TaskSizes class): --qa-docs N, --rag-passage-tokens MIN,MAX, ... A pair's
    default is given as it is typed, MIN,MAX, so the help shows it that way (argparse parses a string default)."""
    for f in fields(sizes):
        pair = isinstance(f.default, tuple)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=_int_pair if pair else int,
                            default=",".join(map(str, f.default)) if pair else f.default,
                            help=f"task size{' (min,max)' if pair else ''} (default: %(default)s)")


def sizes_from_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, sizes: type[TaskSizes]) -> TaskSizes:
    """The `sizes` the flags of add_size_flags give; a bad combination is the parser's error."""
    try:
        return sizes(**{f.name: getattr(args, f.name) for f in fields(sizes)})
    except ValueError as e:
        parser.error(str(e))
