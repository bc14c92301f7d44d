"""Span adapters: a LoRA trained by self-distillation so that the model answers under span attention as it does under
full attention (the Block-Attention lineage), then merged into the weights when served (`--span-adapter`).

layout.py states span attention as one flat sequence with a mask (what training runs and what the engine serves);
corpus.py and examples.py make training prompts from text that ships with installed packages; lora.py and
trainer.py train the adapter; `python -m sglang_pic.train_span_adapter` is the command.
"""
