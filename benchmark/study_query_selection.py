"""Query-driven span selection on the real model: how many span tokens must a request recompute, picked by the
question's attention, before its answers match dense attention? (issue 39: the bound before the engine work.)

Per item of the span-quality tasks, a probe runs the prompt under the engine's default span semantics without
recomputation (each span behind the model's anchor, its KV as its job computed it) through the HF model, with a
dense masked layout that holds each span's job copy hidden (as test/test_span_policy.py's reference does). The
queries of the text after the last span (the question and the assistant header) score every span token by the
attention mass they give its key, summed over layers, heads and queries. The top `fraction` of all span tokens
are then recomputed by the engine itself through each span's own `span_recompute` runs, and the answer is judged
against the gold and against dense attention (the prompt's plain token ids). Baselines: the anchor alone, and the
anchor with a recomputed head of 64 tokens. `--oracle` adds two modes that know the answer: the span holding the gold
phrase recomputed whole (`target`), or every other span (`others`); they show whether a wrong answer comes from the
asked document's own context-free KV or from its rivals'. `--lexical` adds a mode that picks without the answer
and without a probe: the one span sharing the most rare words with the question's line (lexical_runs).
`--sentences` adds modes that recompute sentences instead of whole spans, picked by the same words (sentence_runs).
`--span-adapter` serves every mode with an adapter (the probe still reads the base model's attention); the span
modes send span_query_share 0, so the selection an adapter's record serves with adds nothing to their runs.

Usage: python benchmark/study_query_selection.py --samples 10 --tasks factual_qa,rag_two_hop
       --fractions 0.05,0.1,0.15,0.25 [--out benchmark/results/query_selection.json]
       python benchmark/study_query_selection.py --tasks factual_qa,multi_turn --fractions "" --oracle
       python benchmark/study_query_selection.py --fractions "" --lexical --sentences best,0.1 --span-adapter auto
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from span_quality_tasks import TASKS, BenchTaskSizes
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sglang_pic.engine import Engine
from sglang_pic.managers.io_struct import GenerateReqInput
from sglang_pic.managers.span_lexical import lexical_scores, question_weights, words
from sglang_pic.model_loader.loader import model_dirs
from sglang_pic.radix_ext.segments import normalize_runs
from sglang_pic.span_quality.items import SPLITS, Gold, Item, item_seed
from sglang_pic.span_quality.judging import judge, says
from sglang_pic.span_quality.prompts import PromptBuilder
from sglang_pic.span_quality.sizes import add_size_flags, sizes_from_flags


# ---- the probe: attention mass of the question's queries on span keys --------------------------------------
@dataclass
class ProbeState:
    """What the probe attention reads (the query rows to score) and writes (mass per key)."""

    rows: slice | None = None
    mass: torch.Tensor | None = None


PROBE = ProbeState()


def probe_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA, plus the softmax mass that PROBE.rows' queries give each key (GQA keys repeated per query head)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if PROBE.rows is not None:
        q = query[:, :, PROBE.rows].float()
        k = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        mask = attention_mask[:, :, PROBE.rows, : k.shape[2]]
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        mass = scores.softmax(-1).sum(dim=(0, 1, 2))
        PROBE.mass = mass if PROBE.mass is None else PROBE.mass + mass
    return out


AttentionInterface.register("probe", probe_attention)


@dataclass(frozen=True)
class Layout:
    """A request's dense masked layout: flat ids and positions, each token's scope (-1: it sees every visible token
    before it; n: it sees segment n's hidden job copy and itself), its visibility to later tokens, and for every
    visible span token its (span number, offset in the span)."""

    ids: list[int]
    positions: list[int]
    scope: list[int]
    visible: list[bool]
    span_token: dict[int, tuple[int, int]]
    question_start: int  # flat index of the first token after the last span


def layout(engine: Engine, marked: str) -> Layout:
    (req,) = engine.make_reqs(GenerateReqInput(text=marked, span_anchor="auto", span_head_tokens=0,
                                                 span_query_share=0.0))
    ids, pos, scope, visible, span_token = [], [], [], [], {}
    question_start, spans = 0, 0
    for n, seg in enumerate(req.segments):
        if seg.kind == "span":
            hidden = list(seg.key_lead)
            ids += hidden
            pos += range(seg.start - len(hidden), seg.start)
            scope += [n] * len(hidden)
            visible += [False] * len(hidden)
            for j in range(len(seg.tokens)):
                span_token[len(ids) + j] = (spans, j)
            spans += 1
            question_start = len(ids) + len(seg.tokens)
        ids += seg.tokens
        pos += range(seg.start, seg.start + len(seg.tokens))
        scope += [n if seg.kind == "span" else -1] * len(seg.tokens)
        visible += [True] * len(seg.tokens)
    return Layout(ids, pos, scope, visible, span_token, question_start)


def span_scores(model, lay: Layout) -> list[list[float]]:
    """Per span, each token's attention mass from the queries after the last span."""
    sc, vis = torch.tensor(lay.scope), torch.tensor(lay.visible)
    j = torch.arange(len(lay.ids))
    causal = j[None, :] <= j[:, None]
    mask = causal & (((sc[:, None] == sc[None, :]) & (sc[:, None] >= 0)) | ((sc[:, None] < 0) & vis[None, :]))
    PROBE.rows, PROBE.mass = slice(lay.question_start, len(lay.ids)), None
    with torch.no_grad():
        model(torch.tensor([lay.ids]), attention_mask=mask[None, None], position_ids=torch.tensor([lay.positions]))
    PROBE.rows = None
    spans = 1 + max(s for s, _ in lay.span_token.values())
    out = [[] for _ in range(spans)]
    for flat, (s, _) in sorted(lay.span_token.items()):
        out[s].append(float(PROBE.mass[flat]))
    return out


def select_runs(scores: list[list[float]], fraction: float, unit: str = "tokens") -> list[list[tuple[int, int]]]:
    """Each span's runs: the top `fraction` of all span tokens by score (unit "tokens"), or whole spans by their
    summed score until `fraction` of the span tokens is reached (unit "spans")."""
    if unit == "spans":
        order = sorted(range(len(scores)), key=lambda s: -sum(scores[s]))
        total, chosen, runs = sum(len(r) for r in scores), 0, [[] for _ in scores]
        for s in order:
            if chosen >= fraction * total:
                break
            runs[s], chosen = [(0, len(scores[s]))], chosen + len(scores[s])
        return runs
    ranked = sorted(((v, s, j) for s, row in enumerate(scores) for j, v in enumerate(row)), reverse=True)
    keep = ranked[: round(fraction * len(ranked))]
    return [list(normalize_runs([(j, 1) for _, s2, j in keep if s2 == s], len(row))) for s, row in enumerate(scores)]


def with_runs(marked: str, ssep: str, settings_marker: str, runs: list[list[tuple[int, int]]]) -> str:
    """`marked` with span i opening with its own `span_recompute` runs."""
    parts = marked.split(ssep)
    assert len(parts) == len(runs) + 1, "one set of runs per span"
    out = [parts[0]]
    for part, span_runs in zip(parts[1:], runs):
        out.append(ssep + settings_marker + json.dumps({"span_recompute": [list(r) for r in span_runs]}) + part)
    return "".join(out)


def oracle_runs(marked: str, ssep: str, pdep: str, item: Item, lengths: list[int]) -> dict[str, list]:
    """Runs for the oracle modes: `target` recomputes the spans whose text says a gold phrase, `others` the rest."""
    if not isinstance(item.gold, Gold):
        raise ValueError("the oracle modes need a task whose gold answer is a phrase in a document")
    texts = [part.split(pdep)[0] for part in marked.split(ssep)[1:]]
    target = [any(says(t, g) for g in item.gold.phrases) for t in texts]
    if not any(target):
        raise ValueError(f"no span says the gold answer {item.gold.phrases}: the oracle modes have no target")
    return {mode: [[(0, n)] if hit == (mode == "target") else [] for hit, n in zip(target, lengths)]
            for mode in ("target", "others")}


def lexical_runs(marked: str, ssep: str, pdep: str, lengths: list[int]) -> list[list[tuple[int, int]]]:
    """Recompute whole the one span the engine's lexical selection scores best (managers/span_lexical.py: the rare
    words of the question line, each weighted log(spans / spans holding it)); none when no line says a rare word."""
    spans, after = span_words_and_question(marked, ssep, pdep)
    scores = lexical_scores(spans, after)
    best = max(range(len(spans)), key=lambda i: scores[i])
    return [[(0, n)] if i == best and scores[best] > 0 else [] for i, n in enumerate(lengths)]


def span_words_and_question(marked: str, ssep: str, pdep: str) -> tuple[list[set[str]], str]:
    """Each span's words and the text after the last span, which the lexical choices read."""
    parts = marked.split(ssep)[1:]
    after = parts[-1].split(pdep, 1)
    return [words(part.split(pdep)[0]) for part in parts], after[1] if len(after) > 1 else ""


SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+|\n")


def sentence_runs(marked: str, ssep: str, pdep: str, span_ids: list[list[int]], decode, share: float | None
                  ) -> list[list[tuple[int, int]]]:
    """Recompute sentences, not whole spans: each sentence (split at . ! ? : ; and line ends) is scored by the
    question line's rare words it says (span_lexical's weights). share None: the sentences of the span lexical_runs
    picks that say any; else sentences of every span, best first, while short of `share` of the span tokens."""
    spans, after = span_words_and_question(marked, ssep, pdep)
    weights = question_weights(spans, after)
    best = lexical_runs(marked, ssep, pdep, [len(ids) for ids in span_ids])
    found = []  # (score, span, first token, end token)
    for s, ids in enumerate(span_ids):
        if share is None and not best[s]:
            continue
        ends = [len(decode(ids[:j])) for j in range(len(ids) + 1)]  # char offset where each token starts
        text, start = decode(ids), 0
        for m in [*SENTENCE_END.finditer(text), None]:
            stop = m.start() if m else len(text)
            score = sum(weights.get(w, 0.0) for w in words(text[start:stop]))
            first = max(j for j in range(len(ids) + 1) if ends[j] <= start)
            last = min((j for j in range(len(ids) + 1) if ends[j] >= stop), default=len(ids))
            if score > 0 and last > first:
                found.append((score, s, first, last))
            start = m.end() if m else len(text)
    runs, total, taken = [[] for _ in span_ids], sum(len(i) for i in span_ids), 0
    for score, s, first, last in sorted(found, key=lambda f: (-f[0], f[1], f[2])):
        if share is not None and taken >= share * total:
            break
        runs[s].append((first, last - first))
        taken += last - first
    return [list(normalize_runs(r, len(ids))) for r, ids in zip(runs, span_ids)]


# ---- the study ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--split", choices=SPLITS, default="tuning", help="a study chooses settings: tuning items")
    p.add_argument("--tasks", default="factual_qa,rag_two_hop")
    p.add_argument("--fractions", default="0.05,0.1,0.15,0.25")
    p.add_argument("--unit", choices=("tokens", "spans"), default="tokens", help="what the selection picks")
    p.add_argument("--oracle", action="store_true", help="add the target and others modes (see above)")
    p.add_argument("--lexical", action="store_true", help="add the lexical mode (see above)")
    p.add_argument("--sentences", default="", help="comma-separated shares for the sentence modes (sentence_runs): "
                   "'best' for the best span's sentences, a number for sentences of every span up to that share")
    p.add_argument("--span-adapter", help="serve every mode with this span adapter (launch_server's flag)")
    p.add_argument("--out", type=Path)
    p.add_argument("--model-path", help="an HF folder; default: the embedded model")
    p.add_argument("--chat-template", help="as launch_server's flag; default: the tokenizer's")
    add_size_flags(p, BenchTaskSizes)
    args = p.parse_args(argv)
    model_dir, tokenizer_dir = model_dirs(args.model_path, None)
    builder = PromptBuilder(model_dir, tokenizer_dir, args.chat_template)
    sizes = sizes_from_flags(p, args, BenchTaskSizes)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="probe").eval()
    fractions = [float(f) for f in args.fractions.split(",") if f]
    sentence_shares = [x for x in args.sentences.split(",") if x]
    modes = ["dense", "anchor", "anchor+head64", *(f"query{f:g}" for f in fractions),
             *(("target", "others") if args.oracle else ()), *(("lexical",) if args.lexical else ()),
             *(f"sent-{x}" for x in sentence_shares)]
    results: dict[str, dict[str, list]] = {}
    engine_args = dict(model_path=model_dir, tokenizer_path=tokenizer_dir, chat_template=args.chat_template,
                       span_adapter=args.span_adapter)
    with Engine(dtype="float32", **engine_args) as engine:
        sa = engine.server_args
        for task_name in args.tasks.split(","):
            task = TASKS[task_name]
            items = task.make(args.samples, item_seed(args.seed, task_name, args.split), sizes, builder.count)
            rows = results[task_name] = {m: [] for m in modes}
            for item in items:
                prompt = builder.build(item)
                lay = layout(engine, prompt.marked)
                scores = span_scores(model, lay)
                lengths = [len(r) for r in scores]
                total = sum(lengths)
                own = {"span_query_share": 0.0}  # no selection beyond the mode's own (an adapter's record may set one)
                requests = {  # mode -> (request, the share of span tokens it recomputes, cache aside)
                    "dense": ({"input_ids": prompt.ids}, 1.0),
                    "anchor": ({"prompt": prompt.marked, "span_head_tokens": 0, **own}, 0.0),
                    "anchor+head64": ({"prompt": prompt.marked, "span_head_tokens": 64, **own},
                                      sum(min(64, n) for n in lengths) / total),
                }
                chosen = {f"query{f:g}": select_runs(scores, f, args.unit) for f in fractions}
                if args.oracle:
                    chosen |= oracle_runs(prompt.marked, sa.ssep_marker, sa.pdep_marker, item, lengths)
                if args.lexical:
                    chosen["lexical"] = lexical_runs(prompt.marked, sa.ssep_marker, sa.pdep_marker, lengths)
                span_ids = [[] for _ in lengths]
                for flat, (s, _) in sorted(lay.span_token.items()):
                    span_ids[s].append(lay.ids[flat])
                for x in sentence_shares:
                    chosen[f"sent-{x}"] = sentence_runs(prompt.marked, sa.ssep_marker, sa.pdep_marker, span_ids,
                                                        builder.tokenizer.decode, None if x == "best" else float(x))
                for mode, runs in chosen.items():
                    marked = with_runs(prompt.marked, sa.ssep_marker, sa.span_settings_marker, runs)
                    requests[mode] = ({"prompt": marked, **own}, sum(n for r in runs for _, n in r) / total)
                dense_first = None
                for mode in modes:  # cache hits equal recomputation, so the modes share one warm cache
                    request, share = requests[mode]
                    out = engine.generate(sampling_params={"temperature": 0, "max_new_tokens": task.max_new_tokens},
                                          **request)
                    right, key = judge(item.gold, out["text"], builder.tool_calls(item, out["text"]))
                    first = out["output_ids"][0]
                    dense_first = first if mode == "dense" else dense_first
                    rows[mode].append({
                        "correct": right, "key": key, "first_token_agrees": first == dense_first,
                        "recomputed_share": share, "reply": out["text"],
                    })
            print(summary_line(task_name, rows), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


def summary_line(task: str, rows: dict[str, list]) -> str:
    dense_keys = [r["key"] for r in rows["dense"]]
    cells = []
    for mode, recs in rows.items():
        n = len(recs)
        acc = sum(r["correct"] for r in recs) / n
        agree = sum(r["key"] == k for r, k in zip(recs, dense_keys)) / n
        top1 = sum(r["first_token_agrees"] for r in recs) / n
        share = sum(r["recomputed_share"] for r in recs) / n
        cells.append(f"{mode}: acc {acc:.2f} agree {agree:.2f} top1 {top1:.2f} recomputed {share:.2f}")
    return f"{task} (n={len(rows['dense'])})\n  " + "\n  ".join(cells)


if __name__ == "__main__":
    main()
