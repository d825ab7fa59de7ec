"""How well an element model reads the held-out corpus elements, from their crops and from their true lines.

    python -m benchmarks.element_reading [--model models/pretrained/docmarkup-reader]
        [--corpus var/corpus] [--split test] [--limit N] [--decoder ar]

Every ``text``, ``title`` and ``code`` element of the split is read twice in one process: from its
crop (the model finds the lines itself, as under a ground-truth layout) and from the text layer's
own line boxes (each cropped as the front end crops a detected line: the input on which
``benchmarks.corpus_reading`` measures the recogniser's CTC head). Character error (whitespace
collapsed, pooled) per category for both, and what the element confidence says about the errors
(Spearman against element CER, the share of errors in the least confident tenth, a reliability
table). Writes ``benchmarks/results/element_reading.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from components.data.page_store import PageDataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.element_reading import read_store, summarize_readings

MODES = {"crop": False, "true_lines": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/pretrained/docmarkup-reader"))
    parser.add_argument("--corpus", type=Path, default=Path("var/corpus"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="elements (default: all)")
    parser.add_argument("--decoder", default="ar")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/element_reading.json"))
    args = parser.parse_args(argv)

    store = PageDataset(args.corpus / args.split)
    if not store.exists():
        print(f"no page store at {args.corpus / args.split} (./run pretrain --reader builds the corpus)", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    engine = DecodingEngine.from_pretrained(args.model)
    params = DecodeParams(decoder=args.decoder, max_new_tokens=768)
    results = {}
    for mode, true_lines in MODES.items():
        readings, seconds = read_store(engine, store, params, limit=args.limit, true_lines=true_lines)
        results[mode] = summarize_readings(readings, seconds)
    print("| input | elements | CER all | text | title | code | Spearman(conf, CER) | errors in least confident 10 % | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, summary in results.items():
        by = summary["by_category"]
        cells = " | ".join(f"{by[c]['cer'] * 100:.2f} %" if c in by else "–" for c in ("text", "title", "code"))
        report = summary.get("confidence", {})
        print(f"| {mode} | {summary['elements']} | {summary['cer'] * 100:.2f} % | {cells} | "
              f"{report.get('spearman_vs_element_cer')} | {report.get('errors_in_least_confident_tenth')} | "
              f"{summary['seconds']:.0f} |")
    for mode, summary in results.items():
        print(f"\nreliability ({mode}): confidence range, mean confidence, character accuracy")
        for row in summary.get("confidence", {}).get("reliability", []):
            print(f"  {row['confidence_range']} ({row['items']} elements): {row['mean_confidence']:.4f} vs "
                  f"{row['character_accuracy']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "corpus": str(args.corpus), "split": args.split,
                                    "decoder": args.decoder, "results": results}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
