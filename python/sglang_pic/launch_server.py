"""`python -m sglang_pic.launch_server`: the HTTP server, with SGLang's process layout and flag names.

The main process runs the HTTP server and the tokenizer manager; the scheduler (with the model) and the
detokenizer run as spawned children. With --dp-size N there are N schedulers (model replicas); with --tp-size N
each scheduler is rank 0 of its replica and N-1 tensor-parallel followers run beside it. The main process watches
every child: if one dies, during start-up or later, the server logs which one and how, fails the requests in flight,
stops and exits non-zero. SIGTERM or Ctrl-C stops the HTTP server gracefully (bounded) and then the children.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from sglang_pic.distributed.launch import Follower, ReplicaPlacement, free_init_method
from sglang_pic.server_args import ServerArgs
from sglang_pic.server_flags import flag_help, flag_sections
from sglang_pic.utils_process import ModelFiles, configure_logging, exit_status

logger = logging.getLogger("sglang_pic.launch_server")

# SGLang's spellings that differ from the field name.
FLAG_ALIASES = {"model_path": ["--model"]}
GRACEFUL_SHUTDOWN_S = 2
CHILD_STOP_S = 3.0
EXIT_CODE_WAIT_S = 5.0  # a dead child's sentinel closes a moment before its exit code can be collected


# ---- command line ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """One flag per ServerArgs field (`--field-name`), typed from its annotation, documented by its metadata and
    grouped by its section, as docs/server.md groups them."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_pic.launch_server",
        description="Serve a model over SGLang's native HTTP API and the OpenAI API.",
    )
    section_of, groups = flag_sections(), {}
    for f in dataclasses.fields(ServerArgs):
        section = section_of[f.name]
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        flags = [f"--{f.name.replace('_', '-')}", *FLAG_ALIASES.get(f.name, [])]
        help_text = flag_help(f).replace("%", "%%")  # argparse %-formats help strings
        kind = str(f.type)
        if kind == "bool":
            group.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            continue
        value_type = int if kind.startswith("int") else float if kind.startswith("float") else str
        group.add_argument(*flags, dest=f.name, type=value_type, default=f.default, help=help_text)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        return ServerArgs(**vars(namespace))
    except ValueError as e:
        parser.error(str(e))


# ---- child processes ------------------------------------------------------------------------------------------
class ExitReasons:
    """How each child's death is told: a follower says whether it got to run and why it could not start."""

    def __init__(self, followers: list[Follower]) -> None:
        self.followers = {f.process.pid: f for f in followers}

    def __call__(self, p: BaseProcess) -> str:
        p.join(EXIT_CODE_WAIT_S)
        follower = self.followers.get(p.pid)
        if follower is not None:
            return follower.exit_reason()
        return f"the {p.name} process (pid {p.pid}) exited unexpectedly ({exit_status(p.exitcode)})"


class ChildWatcher:
    """Once any child process dies on its own: log which and how, fail the requests in flight (`on_death` gets the
    reason), and stop the HTTP server with exit code 1."""

    def __init__(
        self,
        children: list[BaseProcess],
        server,
        describe: Callable[[BaseProcess], str],
        on_death: Callable[[str], None],
    ) -> None:
        self.children = children
        self.server = server
        self.describe = describe
        self.on_death = on_death
        self.exit_code = 0
        self.stopping = False
        self._thread = threading.Thread(target=self._watch, name="child-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        ended = wait([p.sentinel for p in self.children])
        if self.stopping:
            return
        reason = "; ".join(self.describe(p) for p in self.children if p.sentinel in ended)
        logger.error("%s; shutting down the server", reason)
        self.exit_code = 1
        self.on_death(reason)
        self.server.should_exit = True


def wait_ready(
    conn: Connection, scheduler: BaseProcess, children: list[BaseProcess], describe: Callable[[BaseProcess], str]
):
    """Block until `scheduler` reports it is loaded; raise RuntimeError naming it if it failed, or a child that
    died."""
    while not conn.poll(0.5):
        dead = next((p for p in children if not p.is_alive()), None)
        if dead is not None:
            raise RuntimeError(f"{describe(dead)} during start-up")
    try:
        ready = conn.recv()
    except EOFError:  # it died before it could say anything
        raise RuntimeError(f"{describe(scheduler)} during start-up") from None
    if ready.error is not None:
        raise RuntimeError(f"the {scheduler.name} process failed to start: {ready.error}")
    return ready


def stop_children(children: list[BaseProcess]) -> None:
    for p in children:
        if p.is_alive():
            p.terminate()
    for p in children:
        p.join(CHILD_STOP_S)
        if p.is_alive():
            p.kill()
            p.join()


# ---- main -----------------------------------------------------------------------------------------------------
def _exit_on(code: int):
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(code)

    return handler


def serve(args: ServerArgs, files: ModelFiles) -> int:
    """Run the server; return 1 if a child died. SIGTERM and Ctrl-C leave through SystemExit(0) and (130)."""
    import uvicorn

    from sglang_pic.entrypoints.http_server import create_app
    from sglang_pic.managers.detokenizer_manager import run_detokenizer_process
    from sglang_pic.managers.ipc import IpcNames
    from sglang_pic.managers.scheduler_process import run_scheduler_process
    from sglang_pic.managers.server_tokenizer_manager import ServerTokenizerManager
    from sglang_pic.model_executor.tp_follower import tp_follower_processes

    # Uvicorn re-raises the signal that stopped it; these turn it into an orderly exit through `finally`.
    signal.signal(signal.SIGTERM, _exit_on(0))
    signal.signal(signal.SIGINT, _exit_on(130))
    names = IpcNames.in_new_tempdir()
    ctx = mp.get_context("spawn")
    children, schedulers, followers, ready_readers, ready_writers = [], [], [], [], []
    for dp_rank in range(args.dp_size):
        placement = ReplicaPlacement(dp_rank, free_init_method() if args.tp_size > 1 else "")
        reader, writer = ctx.Pipe(duplex=False)
        ready_readers.append(reader)
        ready_writers.append(writer)
        name = "scheduler" if args.dp_size == 1 else f"scheduler-dp{dp_rank}"
        scheduler_args = (args, files, names.for_dp_rank(dp_rank), writer, placement)
        schedulers.append(ctx.Process(target=run_scheduler_process, args=scheduler_args, name=name))
        replica_followers = tp_follower_processes(ctx, args, files.model_dir, placement)
        followers.extend(replica_followers)
        children.extend([schedulers[-1], *(f.process for f in replica_followers)])
    children.append(ctx.Process(target=run_detokenizer_process, args=(args, files, names), name="detokenizer"))
    watcher: ChildWatcher | None = None
    try:
        logger.info("starting %s; each scheduler loads the model", ", ".join(p.name for p in children))
        for p in children:
            p.start()
        for writer in [*ready_writers, *(f.sender for f in followers)]:
            writer.close()
        describe = ExitReasons(followers)
        manager = ServerTokenizerManager(args, files, names)
        readies = [wait_ready(r, s, children, describe) for r, s in zip(ready_readers, schedulers)]
        manager.scheduler_ready(min(readies, key=lambda r: r.max_total_num_tokens))  # the smallest replica's pool
        app = create_app(manager)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.log_level.lower() == "debug",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)
        watcher = ChildWatcher(children, server, describe, manager.fail_requests)
        watcher.start()
        logger.info("serving %s on http://%s:%d", args.served_model_name or args.model_path, args.host, args.port)
        server.run()
        return watcher.exit_code
    finally:
        if watcher is not None:
            watcher.stopping = True
        stop_children(children)
        for f in followers:
            f.close()
        names.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.skip_tokenizer_init:
            raise ValueError("--skip-tokenizer-init is supported by the offline Engine only, not by the server")
        if args.chat_template is not None:
            from sglang_pic.entrypoints.chat_template import load_chat_template

            load_chat_template(args.chat_template, None)
        if args.model_path is None:
            from sglang_pic.model_loader.default_model import use_default_model

            use_default_model(args)
        from sglang_pic.model_loader.loader import resolve_model_files

        files = resolve_model_files(args)
        return serve(args, files)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
