"""How the page store scales: synthetic records (no images) at 10K, 100K and 1M pages.

    python -m benchmarks.data_scale                    # 10K, 100K, 1M; legacy JSONL up to 100K
    python -m benchmarks.data_scale --sizes 10000 --legacy-max 10000

For each size, one fresh process builds the store and another runs the operations a curation step
needs, so the peak RSS printed is that of the operations alone (and of the build separately):
adding 1,000 pages (median of 3 batches), fetching one page by id (median of 50), scanning every id, scanning the hard
pages (1 in 20); then the curation steps that touch every page (splitting into train/val/test
stores, collecting hard pages) with their own peak RSS. "legacy" is the store this replaced (one ``pages.jsonl`` parsed whole and
rewritten whole), kept here only as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from components.curation.mining import hard_example_ids
from components.curation.splits import make_splits
from components.data.page_records import HARD
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement, Page, atomic_write_text

SHARED_IMAGE = "images/shared.png"  # one image for every record: the benchmark is about records
WORDS = "the of model data page table text figure result method value layer input output image document".split()


def synthetic_page(i: int) -> Page:
    """A record the size of a curated ``tiny`` page (~1.2 KB as JSON): four elements, curation meta."""
    rng = random.Random(i)
    elements = [LayoutElement(rng.choice(["text", "title", "table", "formula"]), (12, 40 * k, 300, 40 * k + 30),
                              " ".join(rng.choice(WORDS) for _ in range(24))) for k in range(4)]
    meta = {"seed": i, "preset": "tiny", "hard": i % 20 == 0, "consistency": rng.random(),
            "preannotation": {"confidence": rng.random(), "model_version": "rapidocr-3.4"}}
    return Page(f"syn-{i:08d}", SHARED_IMAGE, 320, 416, elements, meta=meta)


def pages(start: int, stop: int) -> Iterator[Page]:
    return (synthetic_page(i) for i in range(start, stop))


class LegacyJsonlStore:
    """The replaced store, for the "before" column: every operation parses the whole manifest."""

    def __init__(self, root: Path):
        self.manifest = root / "pages.jsonl"

    def _all(self) -> list[Page]:
        return [Page.from_json(json.loads(line)) for line in self.manifest.read_text(encoding="utf-8").splitlines() if line]

    def write(self, records) -> None:
        self.manifest.parent.mkdir(parents=True, exist_ok=True)
        with open(self.manifest, "w", encoding="utf-8") as handle:
            for page in records:
                handle.write(json.dumps(page.to_json()) + "\n")

    def upsert(self, records) -> None:
        current = {p.page_id: p for p in self._all()}
        for page in records:
            current[page.page_id] = page
        atomic_write_text(self.manifest, "".join(json.dumps(p.to_json()) + "\n" for p in current.values()))

    def get(self, page_id: str) -> Page | None:
        return next((p for p in self._all() if p.page_id == page_id), None)

    def ids(self) -> list[str]:
        return [p.page_id for p in self._all()]

    def hard(self) -> int:
        return sum(1 for p in self._all() if p.meta.get("hard"))


def open_store(kind: str, root: Path):
    return LegacyJsonlStore(root) if kind == "legacy" else PageDataset(root)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(kind: str, root: Path, size: int) -> dict:
    (root / SHARED_IMAGE).parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), 255).save(root / SHARED_IMAGE)
    started = time.perf_counter()
    open_store(kind, root).write(pages(0, size))
    return {"build_s": time.perf_counter() - started, "build_rss_mb": peak_rss_mb()}


def operate(kind: str, root: Path, size: int) -> dict:
    store = open_store(kind, root)
    adds = []
    for repeat in range(3 if kind == "store" else 1):  # three batches of 1,000 new pages
        batch = list(pages(size + 1000 * repeat, size + 1000 * (repeat + 1)))
        started = time.perf_counter()
        store.upsert(batch)
        adds.append(time.perf_counter() - started)
    added = 1000 * len(adds)
    rng = random.Random(0)
    fetches = []
    for _ in range(50 if kind == "store" else 3):
        page_id = f"syn-{rng.randrange(size):08d}"
        started = time.perf_counter()
        assert store.get(page_id) is not None
        fetches.append(time.perf_counter() - started)
    started = time.perf_counter()
    n_ids = len(store.ids())
    ids_s = time.perf_counter() - started
    started = time.perf_counter()
    n_hard = sum(t.num_rows for t in store.scan(["page_id"], HARD)) if kind == "store" else store.hard()
    hard_s = time.perf_counter() - started
    assert n_ids == size + added and n_hard == len(range(0, size + added, 20))
    return {"add_1000_s": statistics.median(adds), "add_1000_spread": (min(adds), max(adds)), "get_ms": statistics.median(fetches) * 1000,
            "get_ms_spread": (min(fetches) * 1000, max(fetches) * 1000), "scan_ids_s": ids_s, "scan_hard_s": hard_s,
            "ops_rss_mb": peak_rss_mb()}


def curate(root: Path) -> dict:
    """Curation steps over the whole store: the train/val/test split (written as three stores) and
    the hard-example scan, as the curate and train flows run them."""

    store = PageDataset(root)
    started = time.perf_counter()
    counts = make_splits(store, out_dir=root / "splits").counts()
    split_s = time.perf_counter() - started
    assert sum(counts.values()) == len(store)
    started = time.perf_counter()
    n_hard = len(hard_example_ids(store))
    return {"split_s": split_s, "hard_pages_s": time.perf_counter() - started, "n_hard": n_hard,
            "curate_rss_mb": peak_rss_mb()}


def child(args: argparse.Namespace) -> int:
    root = Path(args.root)
    steps = {"build": lambda: build(args.kind, root, args.size), "ops": lambda: operate(args.kind, root, args.size),
             "curate": lambda: curate(root)}
    result = steps[args.step]()
    print(json.dumps(result))
    return 0


def run_child(kind: str, step: str, root: Path, size: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.data_scale", "--child", step, "--kind", kind,
                          "--root", str(root), "--size", str(size)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {step} at {size} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--legacy-max", type=int, default=100_000, help="largest size to run the JSONL baseline at")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--child", choices=["build", "ops", "curate"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["store", "legacy"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.step = args.child
        return child(args)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="data-scale-"))
    rows = []
    print(f"{'store':7} {'pages':>9} {'build s':>8} {'add 1000 s':>10} {'get ms (min-max)':>20} {'ids s':>7} "
          f"{'hard s':>7} {'ops RSS MB':>10} {'build RSS MB':>12} {'disk MB':>8}", flush=True)
    for size in args.sizes:
        for kind in ("legacy", "store"):
            if kind == "legacy" and size > args.legacy_max:
                continue
            root = work / f"{kind}-{size}"
            shutil.rmtree(root, ignore_errors=True)
            row = {"kind": kind, "pages": size, **run_child(kind, "build", root, size), **run_child(kind, "ops", root, size)}
            if kind == "store":
                row.update(run_child(kind, "curate", root, size))
            row["disk_mb"] = disk_mb(root)
            rows.append(row)
            low, high = row["get_ms_spread"]
            print(f"{kind:7} {size:>9,} {row['build_s']:>8.1f} {row['add_1000_s']:>10.3f} "
                  f"{row['get_ms']:>8.2f} ({low:.2f}-{high:.2f}) {row['scan_ids_s']:>7.2f} {row['scan_hard_s']:>7.2f} "
                  f"{row['ops_rss_mb']:>10.0f} {row['build_rss_mb']:>12.0f} {row['disk_mb']:>8.0f}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    stores = [r for r in rows if r["kind"] == "store"]
    print("\ncuration over the whole store (page store only): split into 3 stores, hard-page scan")
    for row in stores:
        print(f"{row['pages']:>9,} pages: split {row['split_s']:.1f} s, hard pages {row['hard_pages_s']:.2f} s "
              f"({row['n_hard']:,}), peak RSS {row['curate_rss_mb']:.0f} MB")
    if len(stores) > 1:
        print(f"add 1000 pages at {stores[-1]['pages']:,} vs {stores[0]['pages']:,}: "
              f"{stores[-1]['add_1000_s'] / stores[0]['add_1000_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    os.sync()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
