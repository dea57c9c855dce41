"""`kvserve serve ...` and `kvserve prepare`: flags mirror the fields of `Settings`.

Every Settings field is a flag of the same name (`max_queue` -> `--max-queue`), documented by the
field's description; a flag wins over its `KVSERVE_*` env var.

`serve` drains on SIGTERM (and Ctrl+C) before it exits 0; see `server.draining`. An error no
request can fix (the model cannot load or run, the engine died) ends it with one line and its
status (server/exits.py). `serve --check` starts everything but HTTP, prints what it would
serve with, and exits 0 or 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import typing

from pydantic import ValidationError

from server import __version__, exits
from server.settings import Settings


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        origin = typing.get_origin(field.annotation)
        args = typing.get_args(field.annotation)
        help_text = _help(name, field)
        negated = (field.json_schema_extra or {}).get("negated")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif negated is not None:  # a mode with a --no- form (--cuda-graphs MODE, --no-cuda-graphs)
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
            parser.add_argument("--no-" + flag[2:], dest=name, action="store_const", const=negated, help=f"= {flag} {negated}")
        elif origin is list or (args and typing.get_origin(args[0]) is list):
            parser.add_argument(flag, dest=name, action="append", default=None, metavar="VALUE", help=help_text + " Repeatable.")
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def _help(name: str, field) -> str:
    """The field's description, its default and its env var (the parser's own defaults stay
    None so that an unset flag never overrides the env var)."""
    default = field.get_default(call_default_factory=True)
    shown = "unset" if default in (None, [], "") else default
    return f"{field.description} [default: {shown}; env KVSERVE_{name.upper()}]"


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    return Settings(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible server for one transformers model.")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve the model over HTTP")
    serve_parser.add_argument(
        "--check", action="store_true",
        help="load the model, size the KV budget, run the start-up forward pass and warm-up, print the "
        "capacity and the paths it would use as JSON, and exit 0 (or 1, with the reason): no HTTP",
    )
    _add_setting_flags(serve_parser)
    _add_setting_flags(commands.add_parser("prepare", help="load (and convert) the model into the cache dir, then exit"))
    return parser


def serve(settings: Settings) -> int:
    # NOTE: the server's modules are imported here, once a flag asks to serve: parsing the flags
    # and printing --help import neither torch nor uvicorn.
    import uvicorn
    from sse_starlette.sse import AppStatus

    from server.startup import create_app
    from server.draining import FLUSH_S, DrainingServer

    # NOTE: sse-starlette cancels every open stream once it sees uvicorn's should_exit, which
    # races with the last chunks (or the abort chunk) of the streams our drain lets finish.
    # DrainingServer ends them itself; uvicorn's FLUSH_S cancellation stays the backstop.
    AppStatus.disable_automatic_graceful_drain()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=FLUSH_S,
    )
    state = app.state.kv
    server = DrainingServer(config, state, settings.shutdown_grace_s)
    server.run()
    if not server.started:
        return exits.BIND  # uvicorn's STARTUP_FAILURE
    if state.fatal is not None:
        status, reason = state.fatal
        print(f"kvserve: exiting with status {status} ({exits.STATUSES[status]}): {reason}", file=sys.stderr)
        return status
    return exits.OK


def check(settings: Settings) -> int:
    """`serve --check`: start everything but HTTP, print what it would serve with as JSON
    (stdout), then exit 0; 1 with the reason (stderr) when the server would not start."""
    from server.startup import startup_check

    summary, failure = asyncio.run(startup_check(settings))
    if failure is not None:
        status, reason = failure
        print(f"kvserve: check failed: {reason} (serve would exit with status {status}: {exits.STATUSES[status]})", file=sys.stderr)
        return exits.FAILED
    print(json.dumps(summary, indent=2))
    return exits.OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvserve: invalid settings:\n{exc}", file=sys.stderr)
        return exits.SETTINGS
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "prepare":
        from server.model_loader import load_model

        loaded = load_model(settings.model, cache_dir=settings.cache_dir, device="cpu", dtype="float32", trust_remote_code=settings.trust_remote_code,
                            task=settings.task)
        print(f"prepared {loaded.model_id} in {settings.cache_dir}")
        return exits.OK
    if settings.tensor_parallel_size > 1:
        return tensor_parallel(settings, args, argv if argv is not None else sys.argv[1:])
    if args.check:
        return check(settings)
    return serve(settings)


FAILED_RANK_WAIT_S = 20.0  # how long rank 0, failed in a collective, waits for a rank that failed first to exit with its status


def tensor_parallel(settings: Settings, args: argparse.Namespace, argv: list[str]) -> int:
    """`serve` over --tensor-parallel-size ranks (server/parallel.py): this node's first process
    starts the node's other ranks (unless torchrun did); rank 0 serves (or checks), the others
    follow it. The ranks started here are stopped (killed past a grace) before it returns."""
    from server import parallel

    try:
        rank = parallel.rank_of(settings)
    except ValueError as exc:
        print(f"kvserve: invalid settings: {exc}", file=sys.stderr)
        return exits.SETTINGS
    parallel.ignore_stop_signals(rank)
    children = parallel.spawn(settings, rank, argv)
    status = exits.FAILED
    try:
        if not rank.leader:
            from server.startup import follow

            status = follow(settings)
            if status not in (exits.OK, exits.ENGINE_DEAD):
                # NOTE: a rank that could not start has nothing to tidy, and rank 0 reads its
                # status once it has exited: the interpreter's teardown took seconds on a busy
                # node, and rank 0 gave up waiting and reported a lost collective instead
                logging.shutdown()
                sys.stderr.flush()
                os._exit(status)
            return status
        status = check(settings) if args.check else serve(settings)
        if status == exits.FAILED and not args.check and children is not None:  # rank 0 lost a collective: did a rank fail first?
            children.stop(grace_s=FAILED_RANK_WAIT_S)
            if (theirs := children.failed()) is not None:
                status, which = theirs
                print(f"kvserve: exiting with status {status} ({exits.STATUSES[status]}): {which}; its line above says why", file=sys.stderr)
        return status
    finally:
        if children is not None:  # told to stop where rank 0 closed cleanly; else not waited for long
            children.stop(grace_s=settings.shutdown_grace_s + 5 if status == exits.OK else 5)


if __name__ == "__main__":
    sys.exit(main())
