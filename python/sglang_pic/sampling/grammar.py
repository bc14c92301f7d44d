"""Constrained decoding: a request's json_schema, regex, EBNF grammar or structural tag limits each next token to
those that keep its output inside the language (xgrammar compiles it against the tokenizer's vocabulary).

Each constrained request carries a matcher that has accepted its output so far. Before sampling, the matcher fills
its row of a token bitmask, which masks the logits to the allowed tokens; after sampling, the token is accepted.
Once the grammar is complete only stop tokens are allowed, and the request ends with the first. Because the next
mask depends on the token just sampled, a step with constrained requests is committed before the next step samples
(after its forward is launched; managers/overlap.py). With jump-forward (`--enable-jump-forward`) the tokens the
grammar forces next are appended at once and prefilled in one step (managers/finishing.py, admission.py).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from sglang_pic.sampling.sampling_params import SamplingParams
from sglang_pic.utils_tensor import to_device, upload


class GrammarBackend:
    """Compiles grammars for one tokenizer; compiled grammars are cached by source, so repeated schemas (every
    call of an agent's tool, a client's fixed response format) compile once."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("constrained decoding needs xgrammar: pip install 'sglang-pic[grammar]'") from None

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.filler = xgr.BatchGrammarMatcher()  # fills a batch's masks on several host threads

    def compile(self, name: str, source: str) -> Any:
        """The compiled grammar; ValueError naming the field and the problem when `source` is not valid."""
        try:
            if name == "json_schema":
                json.loads(source)
                return self.compiler.compile_json_schema(source, any_whitespace=False)
            if name == "regex":
                return self.compiler.compile_regex(source)
            if name == "structural_tag":
                return self._compile_structural_tag(source)
            return self.compiler.compile_grammar(source)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # xgrammar raises RuntimeErrors
            raise ValueError(f"{name} is not valid: {_reason(e)}") from None

    def _compile_structural_tag(self, source: str) -> Any:
        """SGLang's form ({"structures": [{"begin", "schema", "end"}], "triggers"}: free text in which each trigger
        opens a structure whose body follows its schema) or xgrammar's own ({"format": ...})."""
        tag = json.loads(source)
        if not isinstance(tag, dict):
            raise ValueError("a structural tag is a JSON object")
        if "structures" not in tag:
            return self.compiler.compile_structural_tag(source)
        items = [
            self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return self.compiler.compile_structural_tag(items, tag["triggers"])

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher for the grammar of a request that has one."""
        return self._xgr.GrammarMatcher(self.compile(*params.grammar()))

    @torch.inference_mode()  # logits come out of the forward as inference tensors, updated in place here
    def mask_logits(self, logits: torch.Tensor, matchers: list[Any | None]) -> None:
        """Mask, in place, each row with a matcher to the tokens its grammar allows next ([B, V] logits)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        self.filler.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask)
        bitmask = to_device(bitmask, logits.device)
        # xgrammar's CUDA kernel is compiled on first use, which needs a CUDA toolchain; Triton's is at hand.
        backend = "triton" if logits.is_cuda else "cpu"
        if len(rows) == len(matchers):
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, backend=backend)
            return
        index = upload(rows, device=logits.device)  # only the constrained rows' masks cross to the device
        part = logits[index]
        self._xgr.apply_token_bitmask_inplace(part, bitmask, vocab_size=self.vocab_size, backend=backend)
        logits[index] = part


_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its backend in this process


def grammar_backend(tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The process's grammar compiler for `tokenizer`, built on first use (most servers never see a constrained
    request). An offline Engine's front end and scheduler share one tokenizer, so they share one backend: its
    vocabulary is indexed once and a grammar the front end compiled to validate is a cache hit for the scheduler."""
    backend = _BACKENDS.get(tokenizer)
    if backend is None or backend.vocab_size != vocab_size:
        backend = _BACKENDS[tokenizer] = GrammarBackend(tokenizer, vocab_size)
    return backend


def _reason(error: Exception) -> str:
    """The message of a compile error without the timestamp and C++ source location xgrammar puts first."""
    line = str(error).strip().splitlines()[-1]
    return line.split(": ", 1)[-1] if ".cc:" in line else line
