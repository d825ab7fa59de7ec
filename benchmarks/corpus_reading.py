"""How well PP-OCRv6's recogniser, as our torch module, reads the real-document corpus's held-out text.

    python -m benchmarks.corpus_reading [--corpus var/corpus] [--split test] [--max-elements 400]

Every ``text``, ``title`` and ``code`` element of the split is read line by line: each line box
(``meta.element_lines``) is cropped from the page with a small margin, scaled to 48 pixels high
and decoded greedily from the converted network's CTC output (:mod:`models.ocr_encoder`); the
element's lines are joined as the corpus joins them. Character error rate (Levenshtein distance
over the truth's length, whitespace collapsed) per category, pooled over characters, with seconds
per line. This is the frozen encoder with its own head: the number a reader built on it starts
from, and a check that the corpus's line boxes and texts agree with what the page shows.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rapidfuzz.distance import Levenshtein

from components.data.page_store import PageDataset
from models.ocr_encoder import LINE_HEIGHT, greedy_ctc, load_ppocr_recognizer, ppocr_charset

MARGIN = 4  # pixels around a line's character boxes (144 dpi)
CATEGORIES = ("text", "title", "code")


def line_tensor(image: Image.Image, box) -> torch.Tensor:
    """One line crop, 48 pixels high, scaled to [-1, 1], as (1, 3, 48, W)."""
    x0, y0, x1, y1 = box
    crop = image.crop((max(0, x0 - MARGIN), max(0, y0 - MARGIN), min(image.width, x1 + MARGIN),
                       min(image.height, y1 + MARGIN))).convert("RGB")
    width = max(16, round(crop.width * LINE_HEIGHT / max(1, crop.height)))
    crop = crop.resize((width, LINE_HEIGHT), Image.Resampling.BILINEAR)
    array = np.asarray(crop, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1)[None]


def _collapsed(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("var/corpus"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--max-elements", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/corpus_reading.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    recognizer, charset = load_ppocr_recognizer(), ppocr_charset()
    store = PageDataset(args.corpus / args.split)
    errors, lengths = defaultdict(int), defaultdict(int)
    per_element: dict[str, list[float]] = defaultdict(list)
    seconds, lines_read, elements_read = 0.0, 0, 0
    for page in store.pages():
        if elements_read >= args.max_elements:
            break
        image = store.load_image(page)
        for element, boxes in zip(page.elements, page.meta.get("element_lines", []), strict=False):
            if element.category not in CATEGORIES or not boxes or elements_read >= args.max_elements:
                continue
            started = time.perf_counter()
            with torch.no_grad():
                read = [greedy_ctc(recognizer(line_tensor(image, box))[0], charset) for box in boxes]
            seconds += time.perf_counter() - started
            lines_read += len(boxes)
            elements_read += 1
            truth, predicted = _collapsed(element.content), _collapsed(" ".join(read))
            distance = Levenshtein.distance(predicted, truth)
            errors[element.category] += distance
            lengths[element.category] += len(truth)
            per_element[element.category].append(distance / max(1, len(truth)))
    table = {category: {"elements": len(per_element[category]), "characters": lengths[category],
                        "cer": errors[category] / max(1, lengths[category]),
                        "median_element_cer": statistics.median(per_element[category]) if per_element[category] else None}
             for category in CATEGORIES}
    total_chars = sum(lengths.values())
    result = {"corpus": str(args.corpus), "split": args.split, "elements": elements_read, "lines": lines_read,
              "cer": sum(errors.values()) / max(1, total_chars), "characters": total_chars,
              "seconds_per_line": seconds / max(1, lines_read), "by_category": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| category | elements | characters | CER (pooled) | median element CER |")
    print("| --- | --- | --- | --- | --- |")
    for category, row in table.items():
        median = f"{row['median_element_cer']:.4f}" if row["median_element_cer"] is not None else "–"
        print(f"| {category} | {row['elements']} | {row['characters']} | {row['cer']:.4f} | {median} |")
    print(f"| all | {elements_read} | {total_chars} | {result['cer']:.4f} | |")
    print(f"{lines_read} lines, {result['seconds_per_line'] * 1000:.1f} ms per line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
