"""An SGLang frontend program run against a sglang_pic server: roles, gen, select, fork, streaming and batching.

Start a server first (with no --model-path it serves the embedded Qwen2.5-Coder-0.5B-Instruct):

    python -m sglang_pic.launch_server --port 30000
    python examples/demo_program.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse

import sglang as sgl

SYSTEM = "You are a concise Python tutor. Answer in one short sentence."


@sgl.function
def explain_and_judge(s, topic):
    """A two-turn chat: an explanation (gen), then a verdict picked from fixed choices (select)."""
    s += sgl.system(SYSTEM)
    s += sgl.user(f"What is {topic} in Python?")
    s += sgl.assistant(sgl.gen("explanation", max_tokens=64, stop="\n", temperature=0))
    s += sgl.user("Is it used often in everyday Python code? Answer yes or no.")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


@sgl.function
def two_examples(s, topic):
    """Fork the conversation into two branches that share the prompt (and so its cached KV)."""
    s += sgl.system(SYSTEM)
    s += sgl.user(f"Show a one-line example of {topic}.")
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        style = "the simplest possible" if i == 0 else "a more advanced"
        branch += sgl.assistant(f"Here is {style} example: " + sgl.gen("example", max_tokens=48, stop="\n"))
    branches.join()  # gathers each branch's "example" into a list on `s`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url, api_key=args.api_key))

    state = explain_and_judge.run(topic="a list comprehension")
    print("explanation:", state["explanation"].strip())
    print("verdict:", state["verdict"])

    print("streaming:", end=" ", flush=True)
    for piece in explain_and_judge.run(topic="a decorator", stream=True).text_iter("explanation"):
        print(piece, end="", flush=True)
    print()

    forked = two_examples.run(topic="a generator expression")
    for i, example in enumerate(forked["example"]):
        print(f"example {i}:", example.strip())

    batch = explain_and_judge.run_batch([{"topic": t} for t in ("a dict", "a lambda", "f-strings")], num_threads=3)
    for topic, result in zip(("a dict", "a lambda", "f-strings"), batch):
        print(f"{topic}: {result['verdict']} - {result['explanation'].strip()}")


if __name__ == "__main__":
    main()
