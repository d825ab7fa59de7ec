"""Table structure from pixels: SLANet vs the line-position heuristic, on table crops with exact truth.

    python -m benchmarks.table_structure [--pages 40] [--seed 60000000] [--out var/bench/table_structure.json]

The tables are the corpus's table elements: the synthetic generator's ``standard`` preset (768x1024,
real fonts; the corpus builder's ``--synthetic-pages`` seeds start at 60,000,000), each table element
cropped from its page with a 4 px margin. RapidOCR reads the boxes in the crop once; then, interleaved
per table, SLANet's structure gets the boxes as cell text (``components/parsing/tables.py``) and the
heuristic builds rows and columns from the boxes' positions (what RapidOCR's backend falls back to).
Prints mean and median TEDS and TEDS-S of each against the element's HTML, the tables each wins, and
seconds per table (structure only; OCR is shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from components.curation.preannotate.rapidocr import RapidOCRAnnotator
from components.data.synthetic import SyntheticConfig, generate_page
from components.metrics.table import teds_pair
from components.parsing.frontend import Blocks, merge_lines
from components.parsing.tables import shared_slanet, table_from_pixels
from components.services.process import VAR_DIR

PAD = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=40)
    parser.add_argument("--seed", type=int, default=60_000_000)
    parser.add_argument("--out", default=str(VAR_DIR / "bench" / "table_structure.json"))
    args = parser.parse_args(argv)
    ocr = RapidOCRAnnotator()
    shared_slanet()  # load outside the timed tables
    rows = []
    for seed in range(args.seed, args.seed + args.pages):
        page, image = generate_page(seed, SyntheticConfig.preset("standard"))
        for element in (e for e in page.elements if e.category == "table"):
            x0, y0 = max(0, int(element.bbox[0]) - PAD), max(0, int(element.bbox[1]) - PAD)
            x1, y1 = min(image.width, int(element.bbox[2]) + PAD), min(image.height, int(element.bbox[3]) + PAD)
            crop = image.crop((x0, y0, x1, y1))
            boxes = ocr.recognize_boxes(crop)
            if len(boxes) < 2:
                continue
            started = time.perf_counter()
            slanet = table_from_pixels(crop, [(b.text, b.box) for b in boxes]) or ""
            slanet_s = time.perf_counter() - started
            started = time.perf_counter()
            lines = Blocks._grid_table_html(merge_lines(boxes))
            lines_s = time.perf_counter() - started
            s_teds, s_struct = teds_pair(slanet, element.content)
            l_teds, l_struct = teds_pair(lines, element.content)
            rows.append({"seed": seed, "slanet_teds": s_teds, "slanet_teds_s": s_struct, "lines_teds": l_teds,
                         "lines_teds_s": l_struct, "slanet_s": slanet_s, "lines_s": lines_s})
    if not rows:
        raise SystemExit("no table with text in these pages")

    def stat(key: str) -> str:
        values = [row[key] for row in rows]
        return f"mean {statistics.mean(values):.3f} median {statistics.median(values):.3f}"

    print(f"{len(rows)} tables of {args.pages} synthetic pages (seeds {args.seed}..{args.seed + args.pages - 1})")
    for name in ("slanet", "lines"):
        print(f"{name:<7} TEDS {stat(name + '_teds')}  TEDS-S {stat(name + '_teds_s')}  s/table {stat(name + '_s')}")
    wins = sum(row["slanet_teds"] > row["lines_teds"] + 1e-9 for row in rows)
    losses = sum(row["slanet_teds"] < row["lines_teds"] - 1e-9 for row in rows)
    print(f"SLANet better on {wins}, worse on {losses}, equal on {len(rows) - wins - losses} tables")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
