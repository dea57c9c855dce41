"""`kvserve serve ...` and `kvserve prepare`: flags mirror the fields of `Settings`.

Every Settings field is a flag of the same name (`max_queue` -> `--max-queue`), documented by the
field's description; a flag wins over its `KVSERVE_*` env var.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from pydantic import ValidationError

from server.settings import Settings


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        origin = typing.get_origin(field.annotation)
        args = typing.get_args(field.annotation)
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        elif origin is list or (args and typing.get_origin(args[0]) is list):
            parser.add_argument(flag, dest=name, action="append", default=None, metavar="VALUE", help=field.description + " (repeatable)")
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=field.description)


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    return Settings(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="OpenAI-compatible server for one transformers model.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_setting_flags(commands.add_parser("serve", help="serve the model over HTTP"))
    _add_setting_flags(commands.add_parser("prepare", help="load (and convert) the model into the cache dir, then exit"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvserve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "prepare":
        from server.model_loader import load_model

        loaded = load_model(settings.model, cache_dir=settings.cache_dir, device="cpu", dtype="float32", trust_remote_code=settings.trust_remote_code)
        print(f"prepared {loaded.model_id} in {settings.cache_dir}")
        return 0
    import uvicorn

    from server.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
