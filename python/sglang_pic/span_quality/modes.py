"""Span-quality modes: how a prompt is sent and which Engine settings serve it.

  dense          the prompt's token ids with the markers dropped (the same ids the spans have), full attention;
  naive          the marked prompt: each document a span prefilled on its own (span_anchor none);
  anchor         spans prefilled behind the model's anchor (span_anchor auto, span_policy.py);
  headK          each request recomputes every span's first K tokens with full attention (span_head_tokens);
  tailK          likewise its last K tokens (span_tail_tokens);
  seamsK         both, K each: the span's two seams;
  ...+queryP     each request's probe pass also recomputes P percent of its span tokens, those its question
                 attends to most (span_query_share);
  ...+devP       likewise, those whose KV at the second layer deviates most from the shared copy
                 (span_select deviation);
  ...+lexP       likewise, whole spans sharing the question's rarest words, at least the best one, with no pass
                 (span_select lexical);
  ...+apeTxSy    APE's reweighting of the attention to span keys: temperature x and scale y in percent
                 (span_attention_temperature, span_attention_scale);
  anchor+...     the anchor with a head, tail or seams;
  ...+kvfp8e4m3  the KV cache in fp8 (kv_cache_dtype fp8_e4m3; kvfp8e5m2: fp8_e5m2), for dense and the default spans;
  ...+fp8        fp8 weights and activations (quantization fp8), for dense and the default spans;
  ...+adapter    the model with a span adapter merged (the folder the benchmark's --span-adapter names), for dense
                 and the settings an adapter is trained for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Mode:
    marking: str  # "dense": the prompt's ids without markers; "spans": the marked prompt
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def server_flags(self) -> str:
        """The launch_server flags that serve prompts as this mode does."""
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in self.engine_kwargs.items()]
        return " ".join((["--disable-pic"] if self.marking == "dense" else []) + flags)


MARKINGS = ("dense", "spans")
SELECT_NAMES = {"query": "query", "deviation": "dev", "lexical": "lex"}  # span_select -> its mode name part
REFERENCE = "dense"  # the answers and first-token distributions the other modes are compared with
BASELINE = "naive"  # extra prefill tokens are counted over this mode's


def span_mode(anchor: str, head_tokens: int, tail_tokens: int = 0, query_share: float = 0.0,
              temperature: float = 1.0, scale: float = 1.0, select: str = "query") -> Mode:
    """Spans under these Engine settings (a tail or query share of 0, a temperature or scale of 1, the query
    selector are the server's defaults: not passed)."""
    kwargs: dict[str, Any] = {"span_anchor": anchor, "span_head_tokens": head_tokens}
    if tail_tokens:
        kwargs["span_tail_tokens"] = tail_tokens
    if query_share:
        kwargs["span_query_share"] = query_share
    if select != "query":
        kwargs["span_select"] = select
    if (temperature, scale) != (1.0, 1.0):
        kwargs["span_attention_temperature"], kwargs["span_attention_scale"] = temperature, scale
    return Mode("spans", kwargs)


def span_mode_name(anchor: str, head_tokens: int, tail_tokens: int = 0, query_share: float = 0.0,
                   temperature: float = 1.0, scale: float = 1.0, select: str = "query") -> str:
    """naive, anchor, headK, tailK, seamsK (a head and a tail of K each) or headK+tailJ, then queryP, devP or lexP
    (P percent of the span tokens chosen by the query probe, by KV deviation or lexically), then apeTxSy (APE's
    temperature x and scale y, in percent), all after `anchor+` when the anchor is on."""
    if head_tokens and head_tokens == tail_tokens:
        parts = [f"seams{head_tokens}"]
    else:
        parts = [f"{what}{k}" for what, k in (("head", head_tokens), ("tail", tail_tokens)) if k]
    if query_share:
        parts.append(f"{SELECT_NAMES[select]}{round(100 * query_share)}")
    if (temperature, scale) != (1.0, 1.0):
        parts.append(f"apeT{round(100 * temperature)}S{round(100 * scale)}")
    if anchor == "auto":
        parts.insert(0, "anchor")
    return "+".join(parts) or BASELINE


_SPAN_SETTINGS = (
    ("none", 0, 0), ("auto", 0, 0), ("none", 8, 0), ("none", 32, 0), ("auto", 0, 8), ("auto", 0, 16),
    *(("auto", k, 0) for k in (4, 8, 16, 32, 64, 128, 256)), *(("auto", k, k) for k in (8, 16, 32)),
    *(("auto", 8, 0, share) for share in (0.1, 0.2, 0.3, 0.5)), *(("auto", 8, 8, share) for share in (0.1, 0.2, 0.3)),
    *(("auto", 128, 0, share) for share in (0.1, 0.2, 0.3)), *(("auto", 128, k) for k in (16, 32)),
    ("auto", 64, 32), ("auto", 128, 32, 0.1),
    *(("auto", k, 0, 0.0, t, s) for k in (0, 16) for t, s in ((0.7, 1.1), (0.8, 1.0), (0.9, 0.9), (1.0, 1.2))),
    *(("auto", k, 0, share, 1.0, 1.0, "deviation") for k, shares in ((8, (0.1, 0.2, 0.3, 0.5)), (128, (0.1, 0.2)))
      for share in shares),
    *(("auto", k, 0, 0.1, 1.0, 1.0, "lexical") for k in (0, 16)),
)
_SPAN_MODES = {span_mode_name(*setting): span_mode(*setting) for setting in _SPAN_SETTINGS}
ADAPTER_FOLDER = "DIR"  # +adapter modes' placeholder for the folder a run names
ADAPTER_SETTINGS = ("naive", "anchor", "anchor+head4", "anchor+head8", "anchor+head16", "anchor+head128",
                    "anchor+tail8", "anchor+tail16", "anchor+lex10")
DEFAULT_SPANS = "anchor+head128"  # the server's default span setting
MODES: dict[str, Mode] = {
    REFERENCE: Mode("dense"),
    **_SPAN_MODES,
    **{f"{name}+kv{kv.replace('_', '')}": Mode(mode.marking, {**mode.engine_kwargs, "kv_cache_dtype": kv})
       for name, mode in ((REFERENCE, Mode("dense")), (DEFAULT_SPANS, _SPAN_MODES[DEFAULT_SPANS]))
       for kv in ("fp8_e4m3", "fp8_e5m2")},
    **{f"{name}+fp8": Mode(mode.marking, {**mode.engine_kwargs, "quantization": "fp8"})
       for name, mode in ((REFERENCE, Mode("dense")), (DEFAULT_SPANS, _SPAN_MODES[DEFAULT_SPANS]))},
    **{f"{name}+adapter": Mode(mode.marking, {**mode.engine_kwargs, "span_adapter": ADAPTER_FOLDER})
       for name, mode in ((REFERENCE, Mode("dense")), *((n, _SPAN_MODES[n]) for n in ADAPTER_SETTINGS))},
}


def with_adapter(mode: Mode, folder: str | None, scope: str = "spans") -> Mode:
    """The mode with the adapter folder in place of its ADAPTER_FOLDER, served at `scope` (ServerArgs'
    span_adapter_scope); a mode without one: unchanged."""
    if mode.engine_kwargs.get("span_adapter") != ADAPTER_FOLDER:
        return mode
    if folder is None:
        raise ValueError("+adapter modes need the span adapter's folder (bench_span_quality.py --span-adapter DIR)")
    return Mode(mode.marking, {**mode.engine_kwargs, "span_adapter": folder, "span_adapter_scope": scope})
