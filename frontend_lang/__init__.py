"""span()/pdep() for SGLang's frontend language: `s += span(doc)` inside an `@sgl.function` program."""

from sglang_pic.frontend_lang.markers import PDEP_MARKER, SSEP_MARKER, Span, marked_prompt, pdep, span, strip_markers
from sglang_pic.frontend_lang.warmup import warm_spans

__all__ = ["PDEP_MARKER", "SSEP_MARKER", "Span", "marked_prompt", "pdep", "span", "strip_markers", "warm_spans"]
