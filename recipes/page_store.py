"""``python -m recipes.page_store {migrate,export,info}``: convert legacy ``pages.jsonl`` folders into
page stores, write a store as JSON lines, or show its shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from components.data.page_store import PageDataset, migrate_jsonl
from components.data.pages import InvalidPageError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.page_store", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    migrate = sub.add_parser("migrate", help="convert pages.jsonl folders into page stores")
    migrate.add_argument("folders", nargs="+", type=Path)
    migrate.add_argument("--keep", action="store_true", help="leave pages.jsonl in place")
    export = sub.add_parser("export", help="write a store as JSON lines")
    export.add_argument("folder", type=Path)
    export.add_argument("out", type=Path)
    info = sub.add_parser("info", help="shards, rows and dead rows of a store")
    info.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "migrate":
            for folder in args.folders:
                print(f"{folder}: {migrate_jsonl(folder, keep=args.keep)} pages migrated")
        elif args.command == "export":
            print(f"{PageDataset(args.folder).export_jsonl(args.out)} pages written to {args.out}")
        else:
            store = PageDataset(args.folder)
            shards = store.shards()
            print(f"{args.folder}: {len(store)} pages in {len(shards)} shards "
                  f"({sum(s.dead for s in shards)} dead rows)")
    except (FileNotFoundError, FileExistsError, InvalidPageError) as exc:
        print(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
