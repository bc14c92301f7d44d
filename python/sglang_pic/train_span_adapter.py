"""Train a span adapter for a model: `python -m sglang_pic.train_span_adapter --model-path M --out DIR`.

A LoRA over every linear layer of the decoder, trained by self-distillation (span_adapter/trainer.py) so that the
model answers under span attention as it does under full attention. DIR then holds a PEFT-format adapter and its
training record; serve it with `--span-adapter DIR`. The run checkpoints into DIR and resumes from there when run
again with the same DIR (use --max-minutes to stop in time on a bounded machine). On one H100, 300 steps of 8
prompts take a few minutes for a 0.5B model; on a CPU, use it only on tiny models. Under torchrun
(`torchrun --nproc-per-node N -m sglang_pic.train_span_adapter ...`) the N processes share each step's prompts.
"""

from __future__ import annotations

import argparse
import json
import logging

from sglang_pic.span_adapter.examples import KINDS, ExampleSizes
from sglang_pic.span_adapter.trainer import TrainConfig, Trainer


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig(model_path="", out="")
    parser = argparse.ArgumentParser(prog="python -m sglang_pic.train_span_adapter",
                                     description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-path", required=True, help="HF model folder or .gguf file, as the server takes it")
    parser.add_argument("--out", required=True, help="folder for the adapter, its record and the checkpoint")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per step")
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch,
                        help="prompts per forward and backward; the step accumulates the gradient over them")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--rank", type=int, default=d.rank, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=d.alpha, help="LoRA alpha (the update is scaled by alpha/rank)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--dense-share", type=float, default=d.dense_share,
                        help="share of turns the student runs with full attention (keeps dense answers)")
    parser.add_argument("--settings", default=json.dumps(d.settings),
                        help="JSON list of the span settings turns are drawn from: any of a request's span fields "
                        "(span_anchor, span_head_tokens, span_tail_tokens, span_query_share, span_select), applied "
                        "as the engine applies them")
    parser.add_argument("--serve-settings", default=json.dumps(d.serve_settings),
                        help="JSON span settings recorded as the server's defaults when the adapter is loaded")
    parser.add_argument("--span-token-weight", type=float, default=d.span_token_weight,
                        help="weight of the span tokens' own next-token KL beside the text after the spans")
    parser.add_argument("--span-state-weight", type=float, default=d.span_state_weight,
                        help="weight of the span tokens' hidden states at every layer against the teacher's "
                        "(squared error relative to the teacher's norm, averaged over rows and layers)")
    parser.add_argument("--hard-row-share", type=float, default=d.hard_row_share,
                        help="share of each micro-batch's loss rows, those of highest KL, that the KL is taken on")
    parser.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="teacher answer length limit")
    parser.add_argument("--teacher-batch", type=int, default=d.teacher_batch,
                        help="prompts the teacher answers per generate call, over this and the next steps")
    parser.add_argument("--turn-kinds", default=json.dumps(d.turn_kinds),
                        help="JSON object: the weight of each turn kind (docs, code, tools, records)")
    parser.add_argument("--docs", default=f"{d.sizes.min_docs},{d.sizes.max_docs}", help="spans per prompt: MIN,MAX")
    parser.add_argument("--passage-tokens", default=f"{d.sizes.min_passage_tokens},{d.sizes.max_passage_tokens}",
                        help="tokens per span: MIN,MAX")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--max-minutes", type=float, default=d.max_minutes,
                        help="checkpoint and stop after this long (0: no limit); run again to resume")
    parser.add_argument("--init-adapter", help="a saved adapter folder to start from (a rank up to --rank with the "
                        "same alpha / rank), e.g. to go on training it with other settings or at a higher rank; "
                        "ignored when --out holds a checkpoint")
    parser.add_argument("--device", default=d.device, help="auto, cuda or cpu")
    a = parser.parse_args(argv)
    try:
        docs = [int(x) for x in a.docs.split(",")]
        passage = [int(x) for x in a.passage_tokens.split(",")]
        settings, serve, kinds = json.loads(a.settings), json.loads(a.serve_settings), json.loads(a.turn_kinds)
    except ValueError as e:
        parser.error(f"--docs, --passage-tokens, --settings, --serve-settings and --turn-kinds: {e}")
    if not isinstance(kinds, dict) or not set(kinds) <= set(KINDS) or not all(
            isinstance(w, (int, float)) and w >= 0 for w in kinds.values()) or not any(kinds.values()):
        parser.error(f"--turn-kinds takes weights >= 0, not all 0, of {', '.join(KINDS)}; got {a.turn_kinds}")
    if len(docs) != 2 or len(passage) != 2 or not 1 <= docs[0] <= docs[1] or not 1 <= passage[0] <= passage[1]:
        parser.error("--docs and --passage-tokens take MIN,MAX with 1 <= MIN <= MAX")
    if min(a.steps, a.batch_size, a.micro_batch, a.rank, a.teacher_batch) < 1:
        parser.error("--steps, --batch-size, --micro-batch, --rank and --teacher-batch must be positive")
    if not 0 <= a.dense_share <= 1:
        parser.error("--dense-share must be in [0, 1]")
    if min(a.span_token_weight, a.span_state_weight) < 0:
        parser.error("--span-token-weight and --span-state-weight must be >= 0")
    if not 0 < a.hard_row_share <= 1:
        parser.error("--hard-row-share must be in (0, 1]")
    return TrainConfig(
        model_path=a.model_path, out=a.out, steps=a.steps, batch_size=a.batch_size, micro_batch=a.micro_batch,
        lr=a.lr, rank=a.rank, alpha=a.alpha, seed=a.seed, dense_share=a.dense_share, settings=settings,
        serve_settings=serve, span_token_weight=a.span_token_weight, span_state_weight=a.span_state_weight,
        hard_row_share=a.hard_row_share, answer_tokens=a.answer_tokens, teacher_batch=a.teacher_batch, turn_kinds=kinds,
        sizes=ExampleSizes(docs[0], docs[1], passage[0], passage[1]), checkpoint_every=a.checkpoint_every,
        max_minutes=a.max_minutes, init_adapter=a.init_adapter, device=a.device,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = parse_args(argv)
    trainer = Trainer(config)
    done = trainer.train()
    trainer.group.leave()
    if trainer.group.leader:
        print(f"{'adapter written to' if done else 'checkpoint in'} {config.out}")


if __name__ == "__main__":
    main()
