"""Self-distillation of a span adapter: the teacher is the model with full causal attention, the student the same
model plus LoRA under the attention the engine gives span prompts (layout.py). The loss is KL(teacher || student) of
the next-token distributions on the text after the first span (the question and the teacher's own greedy answer),
optionally also on the span tokens and on their hidden states at every layer (what later tokens attend to, which a
span computed alone gets wrong: wrong answers under span attention mostly name a value of an earlier document); a
share of turns runs the student with full attention, so dense requests keep their answers once the adapter is
merged.

Examples are drawn from a generator seeded by (seed, step), so a run resumed from its checkpoint sees the examples
the uninterrupted run would have seen. The teacher answers the prompts of several steps in one generate call: greedy
decoding is bound by its step count, not its batch, and answering 8 prompts a step took most of the step's time.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_pic.model_loader.default_model import file_sha256
from sglang_pic.model_loader.span_adapter import WEIGHTS, load_adapter, save_adapter
from sglang_pic.span_adapter.corpus import build_corpus
from sglang_pic.span_adapter.data_parallel import Group
from sglang_pic.span_adapter.examples import KINDS, Example, ExampleMaker, ExampleSizes
from sglang_pic.span_adapter.layout import SpanLayout, scope_ids, scope_mask
from sglang_pic.span_adapter.lora import add_lora, lora_off, to_adapter

logger = logging.getLogger(__name__)
CHECKPOINT = "checkpoint.pt"
KL_ROWS = 512  # rows per chunk of the loss: a [rows, vocab] float32 block at a time
# Batches are padded to a multiple of this length: torch 2.11's cuDNN attention backward on H100/H200 returns NaN
# query gradients for masked sequences of length 64 mod 128 (pytorch/pytorch#196678), the likely source of the
# skipped updates (12 in 837 steps, about the share of micro-batches with such a length).
PAD_MULTIPLE = 128


@dataclass
class TrainConfig:
    model_path: str
    out: str
    steps: int = 300
    batch_size: int = 8
    micro_batch: int = 2  # examples per forward and backward (the step's gradient is accumulated over them)
    lr: float = 2e-4
    rank: int = 16
    alpha: float = 32.0
    seed: int = 0
    dense_share: float = 0.3
    settings: list[dict] = field(default_factory=lambda: [{"span_anchor": "auto", "span_head_tokens": 0},
                                                          {"span_anchor": "none", "span_head_tokens": 0},
                                                          {"span_anchor": "auto", "span_head_tokens": 16}])
    serve_settings: dict = field(default_factory=lambda: {"span_anchor": "auto", "span_head_tokens": 0})
    span_token_weight: float = 0.0
    # Weight of the span tokens' hidden states at every layer against the teacher's (squared error relative to the
    # teacher's norm, averaged over rows and layers): it trains what later tokens attend to, not only the output.
    span_state_weight: float = 0.0
    # Share of each micro-batch's weighted loss rows, those of highest KL, that the KL is taken on (1: all). The
    # mean KL of training rows (about 0.1) is far below the first-token KL of the quality suite's span answers
    # (about 0.65): most rows are already right, and the few that choose an answer carry the gap.
    hard_row_share: float = 1.0
    answer_tokens: int = 48
    teacher_batch: int = 64  # prompts the teacher answers per generate call (steps ahead = teacher_batch // batch)
    sizes: ExampleSizes = field(default_factory=ExampleSizes)
    turn_kinds: dict[str, float] = field(default_factory=lambda: dict(KINDS))  # weights of docs, code, tools, records
    warmup_steps: int = 20
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # 0: no limit; else checkpoint and stop after this long (a device call is bounded)
    init_adapter: str | None = None  # a saved adapter to start from (rank up to this one's, same alpha / rank)
    device: str = "auto"


def _device(name: str, group: Group) -> torch.device:
    """The device named (auto: CUDA if there is one); a CUDA device without an index is this process's GPU."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", group.local_rank)
        torch.cuda.set_device(device)
    return device


def _pad_batch(layouts: list[SpanLayout], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions and a [B, 1, L, L] boolean mask, L the longest layout rounded up to PAD_MULTIPLE, built on
    the device (on the host, the masks of a step's 2,000-token layouts took a large share of the step); padding
    rows see only themselves (no row is all masked)."""
    length = -(-max(len(lay.ids) for lay in layouts) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = torch.zeros(len(layouts), length, dtype=torch.long)
    pos = torch.zeros(len(layouts), length, dtype=torch.long)
    scope = torch.full((len(layouts), length), -1, dtype=torch.long)
    visible = torch.zeros(len(layouts), length, dtype=torch.bool)
    for b, lay in enumerate(layouts):
        n = len(lay.ids)
        ids[b, :n] = torch.tensor(lay.ids)
        pos[b, :n] = torch.tensor(lay.positions)
        scope[b, :n] = scope_ids(lay.scope)
        visible[b, :n] = torch.tensor(lay.visible)
    lengths = torch.tensor([len(lay.ids) for lay in layouts], device=device)
    scope, visible = scope.to(device), visible.to(device)
    padding = torch.arange(length, device=device)[None, :] >= lengths[:, None]  # [B, L]
    eye = torch.eye(length, dtype=torch.bool, device=device)
    mask = (scope_mask(scope, visible) & ~padding[:, :, None]) | (eye & padding[:, :, None])
    return ids.to(device), pos.to(device), mask[:, None]


def hidden_states(model, layouts: list[SpanLayout]) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] for each layout as the engine attends to it."""
    return decoder_states(model, layouts, every_layer=False)[0]


def decoder_states(
    model, layouts: list[SpanLayout], every_layer: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(the last hidden states [B, L, H], and with `every_layer` the hidden states HF returns after each layer)."""
    device = next(model.parameters()).device
    ids, pos, mask = _pad_batch(layouts, device)
    out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=every_layer)
    return out.last_hidden_state, tuple(out.hidden_states[1:]) if every_layer else ()


def state_error_sum(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Sum over rows of |student - teacher|^2 / |teacher|^2 for matching [N, H] layers of rows, in float32."""
    total = student[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student, teacher):
        t = t.float()
        total = total + (((s.float() - t) ** 2).sum(-1) / (t**2).sum(-1).clamp(min=1e-6)).sum()
    return total


def layout_logits(model, layouts: list[SpanLayout]) -> list[torch.Tensor]:
    """Each layout's next-token logits [L, vocab] (float32): what the engine's logits for the same prompt are."""
    hidden = hidden_states(model, layouts)
    return [model.lm_head(hidden[b, : len(lay.ids)]).float() for b, lay in enumerate(layouts)]


@torch.no_grad()
def teacher_answers(model, prompts: list[list[int]], max_new: int, eos: list[int]) -> list[list[int]]:
    """The teacher's greedy continuation of each dense prompt, cut after its first end token."""
    device = next(model.parameters()).device
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), eos[0], dtype=torch.long)
    attn = torch.zeros(len(prompts), length, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding
        ids[b, length - len(p):] = torch.tensor(p)
        attn[b, length - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new,
                         do_sample=False, pad_token_id=eos[0], eos_token_id=eos)[:, length:].tolist()
    answers = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def kl_sum(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, lm_head,
           hard_share: float = 1.0) -> torch.Tensor:
    """Weighted sum over rows of KL(teacher || student), from hidden rows [N, H], in chunks of KL_ROWS; with
    hard_share < 1, over the ceil(hard_share * N) rows of highest weighted KL only."""
    kls = []
    for start in range(0, student.shape[0], KL_ROWS):
        s = torch.log_softmax(lm_head(student[start: start + KL_ROWS]).float(), -1)
        with torch.no_grad():
            t = torch.log_softmax(lm_head(teacher[start: start + KL_ROWS]).float(), -1)
        p = t.exp()
        kl = torch.where(p > 0, p * (t - s), 0.0).sum(-1)  # a teacher probability of 0 adds nothing, even at s = -inf
        kls.append(kl * weights[start: start + KL_ROWS])
    weighted = torch.cat(kls)
    if hard_share < 1.0:
        weighted = weighted.topk(math.ceil(hard_share * weighted.shape[0])).values
    return weighted.sum()


class Trainer:
    def __init__(self, config: TrainConfig, model=None) -> None:
        """`model`: an HF causal LM already loaded (tests); else loaded from config.model_path."""
        from transformers import AutoModelForCausalLM

        from sglang_pic.model_loader.loader import resolve_model_path

        self.config = config
        self.group = Group.from_env()
        if config.batch_size < self.group.size:
            raise ValueError(f"a batch of {config.batch_size} prompts leaves some of {self.group.size} processes none")
        self.device = _device(config.device, self.group)
        self.group.join(self.device)
        self.model_dir = resolve_model_path(config.model_path)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=dtype, attn_implementation="sdpa").to(self.device)
        self.model.eval()  # no dropout: the student differs from the teacher by the adapter only
        torch.manual_seed(config.seed)  # the fresh factors A, drawn at random, come from the run's seed
        self.layers = add_lora(self.model, config.rank, config.alpha)
        self.params = [p for layer in self.layers.values() for p in (layer.lora_A, layer.lora_B)]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.corpus = build_corpus()
        self.maker = ExampleMaker(self.model_dir, self.corpus, config.sizes, config.turn_kinds, config.answer_tokens)
        self.step = 0
        self.history: list[dict] = []
        self.init_record: dict | None = None  # the adapter this run started from, as the record names it
        self._ahead: dict[int, tuple[list[Example], list[list[int]]]] = {}  # step -> its examples, answered
        if not self._resume() and config.init_adapter:
            self._start_from(config.init_adapter)
        self.group.broadcast(self.params)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def _start_from(self, folder: str) -> None:
        """Continue training a saved adapter (e.g. with other settings): its factors replace the first rows of the
        fresh ones. A lower-rank adapter with the same scale (alpha / rank) goes on at this run's higher rank: the
        extra rows of A stay random and the extra columns of B zero, so the update B A starts as the saved one."""
        adapter = load_adapter(folder)
        c = self.config
        if adapter.rank > c.rank or adapter.alpha * c.rank != c.alpha * adapter.rank:
            raise ValueError(f"--init-adapter {folder!r} has rank {adapter.rank} and alpha {adapter.alpha}; this run "
                             f"trains rank {c.rank}, alpha {c.alpha}: it needs a rank up to {c.rank} with the same "
                             f"alpha / rank")
        if set(adapter.factors) != set(self.layers):
            raise ValueError(f"--init-adapter {folder!r} targets other modules than this model's LoRA layers")
        for name, layer in self.layers.items():
            a, b = adapter.factors[name]
            layer.lora_A.data[: adapter.rank].copy_(a.float())
            layer.lora_B.data.zero_()
            layer.lora_B.data[:, : adapter.rank].copy_(b.float())
        self.init_record = {"folder": folder, "sha256": file_sha256(Path(folder) / WEIGHTS),
                            "steps_done": adapter.record.get("training", {}).get("steps_done")}
        logger.info("starting from the adapter in %s", folder)

    def _resume(self) -> bool:
        path = Path(self.config.out) / CHECKPOINT
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        for name, layer in self.layers.items():
            layer.lora_A.data.copy_(state["lora"][name][0])
            layer.lora_B.data.copy_(state["lora"][name][1])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]
        self.init_record = state.get("init_adapter")
        logger.info("resumed from %s at step %d", path, self.step)
        return True

    def _checkpoint(self) -> None:
        if not self.group.leader:
            return
        Path(self.config.out).mkdir(parents=True, exist_ok=True)
        state = {"lora": {n: (l.lora_A.data, l.lora_B.data) for n, l in self.layers.items()},
                 "optimizer": self.optimizer.state_dict(), "step": self.step, "history": self.history,
                 "init_adapter": self.init_record}
        tmp = Path(self.config.out) / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(Path(self.config.out) / CHECKPOINT)

    # ---- one step ---------------------------------------------------------------------------------------------
    def _examples(self, step: int) -> list[Example]:
        rng = random.Random(self.config.seed * 1_000_003 + step)
        return [self.maker.example(rng, {} if rng.random() < self.config.dense_share else rng.choice(
            self.config.settings)) for _ in range(self.config.batch_size)]

    def _lr(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        return c.lr * 0.5 * (1 + math.cos(math.pi * (step - c.warmup_steps) / max(c.steps - c.warmup_steps, 1)))

    def _answered(self, step: int) -> tuple[list[Example], list[list[int]]]:
        """This process's share of the step's examples with the teacher's answers, generated for this and the next
        steps at once."""
        if step not in self._ahead:
            c = self.config
            ahead = max(1, c.teacher_batch * self.group.size // c.batch_size)
            steps = range(step, min(step + ahead, c.steps))
            examples = {s: self.group.share(self._examples(s)) for s in steps}
            prompts = [e.layout.dense_ids() for s in steps for e in examples[s]]
            self.model.eval()
            with lora_off(self.layers):
                answers = iter(teacher_answers(self.model, prompts, c.answer_tokens, self.maker.eos_token_ids))
            for s in steps:
                self._ahead[s] = (examples[s], [next(answers) for _ in examples[s]])
        return self._ahead.pop(step)

    def train_step(self) -> dict:
        c = self.config
        begin = time.monotonic()
        examples, answers = self._answered(self.step)
        dense = [e.layout.dense_ids() for e in examples]
        for e, answer in zip(examples, answers):
            start = len(e.layout.ids)
            e.layout.append_output(answer)
            e.loss_rows.extend(range(start, start + len(answer) - 1))
        rows = [self._rows(e) for e in examples]
        # the whole step's KL weight, and its span rows (times layers, for the state error's mean)
        total, span_total = self.group.sum([sum(w for r in rows for _, w in r),
                                            sum(len(e.span_rows) for e in examples)], self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for first in range(0, len(examples), c.micro_batch):
            part = slice(first, first + c.micro_batch)
            loss += float(self._backward(examples[part], dense[part], answers[part], rows[part], total, span_total))
        self.group.sum_grads(self.params)
        loss, n_rows, n_tokens = self.group.sum(
            [loss, sum(map(len, rows)), sum(len(e.layout.ids) for e in examples)], self.device)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self._lr(self.step)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        applied = math.isfinite(loss) and bool(torch.isfinite(norm))
        if applied:  # clipping by a non-finite norm would spread the bad value to every layer's gradient
            torch.nn.utils.clip_grads_with_norm_(self.params, 1.0, norm)
            self.optimizer.step()
        self.step += 1
        entry = {"step": self.step, "loss": loss, "applied": applied, "rows": int(n_rows), "tokens": int(n_tokens),
                 "seconds": time.monotonic() - begin}
        if not applied:  # one bad batch must not poison the adapter: its update is dropped
            entry["nonfinite"] = self._nonfinite_layers()
            logger.warning("step %d: non-finite loss or gradient (loss %s; %s), update skipped", self.step, loss,
                           entry["nonfinite"])
        self.history.append(entry)
        return entry

    def _nonfinite_layers(self) -> dict:
        """Where a skipped update came from: how many LoRA layers got a non-finite gradient, and the deepest of them
        (the backward pass runs from the last layer, so a bad value spreads to every layer before the one it
        appeared in)."""
        bad = [name for name, layer in self.layers.items()
               if any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                      for p in (layer.lora_A, layer.lora_B))]
        return {"count": len(bad), "deepest": bad[-1] if bad else None}

    def _rows(self, e: Example) -> list[tuple[int, float]]:
        """The layout rows the loss is taken on, with their weights."""
        rows = [(r, 1.0) for r in e.loss_rows]
        if self.config.span_token_weight > 0:
            rows += [(r, self.config.span_token_weight) for r in e.span_rows]
        return rows

    def _backward(self, examples: list[Example], dense: list[list[int]], answers: list[list[int]],
                  rows: list[list[tuple[int, float]]], total: float, span_total: float) -> torch.Tensor:
        """Back-propagate these examples' share of the step's mean KL (their weighted sum over the step's weight,
        times hard_row_share when only that share of rows counts), plus span_state_weight times their share of the
        step's mean state error over span rows and layers."""
        teachers = []
        for d, answer in zip(dense, answers):
            lay = SpanLayout()
            lay.add(d + answer, 0, None, True)
            teachers.append(lay)
        states = self.config.span_state_weight > 0
        with torch.no_grad(), lora_off(self.layers):
            t_hidden, t_layers = decoder_states(self.model, teachers, states)
        s_hidden, s_layers = decoder_states(self.model, [e.layout for e in examples], states)
        s_rows, t_rows, weights = [], [], []
        s_spans, t_spans = [[] for _ in s_layers], [[] for _ in t_layers]  # per layer, the span rows
        for b, (e, r) in enumerate(zip(examples, rows)):
            index = e.layout.dense_index()
            s_rows.append(s_hidden[b, [i for i, _ in r]])
            t_rows.append(t_hidden[b, [index[i] for i, _ in r]])
            weights += [w for _, w in r]
            for layer, (s_layer, t_layer) in enumerate(zip(s_layers, t_layers)):
                s_spans[layer].append(s_layer[b, e.span_rows])
                t_spans[layer].append(t_layer[b, [index[i] for i in e.span_rows]])
        loss = kl_sum(torch.cat(s_rows), torch.cat(t_rows), torch.tensor(weights, device=s_hidden.device),
                      self.model.lm_head, self.config.hard_row_share) / (total * self.config.hard_row_share)
        if states and span_total:
            error = state_error_sum([torch.cat(x) for x in s_spans], [torch.cat(x) for x in t_spans])
            loss = loss + self.config.span_state_weight * error / (span_total * len(s_layers))
        loss.backward()
        return loss.detach()

    # ---- the run ----------------------------------------------------------------------------------------------
    def train(self) -> bool:
        """Train until config.steps (True) or config.max_minutes (False: checkpointed, and the adapter so far saved
        with its steps_done in the record, so a cut run can still be served; run again to resume)."""
        c = self.config
        begin = time.monotonic()
        bar = tqdm(total=c.steps, initial=self.step, desc="span adapter",
                   disable=not (sys.stderr.isatty() and self.group.leader))
        while self.step < c.steps:
            entry = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.4f}")
            if self.group.leader and (self.step % 10 == 0 or self.step == c.steps):
                logger.info("step %d/%d loss %.4f (%d rows, %d tokens, %.2f s)", self.step, c.steps, entry["loss"],
                            entry["rows"], entry["tokens"], entry["seconds"])
            if self.step % c.checkpoint_every == 0:
                self._checkpoint()
            late = bool(c.max_minutes) and time.monotonic() - begin > 60 * c.max_minutes
            if self.group.any(late, self.device) and self.step < c.steps:
                self._checkpoint()
                self.save()
                logger.info("stopped at step %d after %.1f min; run the same command again to resume",
                            self.step, (time.monotonic() - begin) / 60)
                return False
        bar.close()
        self._checkpoint()
        self.save()
        return True

    def save(self) -> None:
        """The adapter and its record into config.out (by the leader process alone)."""
        if not self.group.leader:
            return
        record = {
            "span_settings": self.config.serve_settings,
            "training": {**{k: v for k, v in asdict(self.config).items() if k not in ("out", "device")},
                         "corpus": self.corpus.record(), "turn_kinds": self.maker.kinds, "steps_done": self.step,
                         "processes": self.group.size,
                         "final_loss": self.history[-1]["loss"] if self.history else None,
                         "skipped_updates": sum(not h["applied"] for h in self.history),
                         "skipped": [{k: h[k] for k in ("step", "loss", "nonfinite") if k in h}
                                     for h in self.history if not h["applied"]],
                         "init_adapter": self.init_record,
                         "loss_every_10": [h["loss"] for h in self.history[9::10]],
                         "seconds_per_step": (sum(h.get("seconds", 0.0) for h in self.history) / len(self.history)
                                              if self.history else None)},
            "base_model": {"model_path": self.config.model_path,
                           "architecture": json.loads((Path(self.model_dir) / "config.json").read_text())
                           .get("architectures", [None])[0]},
        }
        adapter = to_adapter(self.layers, self.config.rank, self.config.alpha, record, torch.bfloat16)
        save_adapter(self.config.out, adapter, self.config.model_path)

