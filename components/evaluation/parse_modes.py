"""Page mode against element mode (two-stage parsing) on the same pages, interleaved.

Contenders, per decoder: a page model reading whole pages; an element model reading each page's
elements (one engine batch per page) with the pages' ground-truth boxes and with a detector's
boxes. On every page all contenders run back to back in rotating order, so machine load hits
them alike. Reported per contender: Overall (OmniDocBench), forwards per page, tokens per
forward, pages/s (median over repeats, min-max) and its ratio to page mode; the gap between
ground-truth and detected boxes is split into recognition error (100 − Overall with ground-truth
boxes) and layout error (ground-truth boxes − detected boxes). Used by
``benchmarks/parse_modes.py`` and the demo.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from components.data.pages import Page
from components.decoding.types import DecodeParams
from components.metrics import aggregate_scores, resolve_formula_metric, score_page
from components.parsing import ParseSettings, make_layout, read_pages


def contenders(page_engine, element_engine, layouts: dict) -> dict:
    """name -> (engine, settings, layout) for every mode compared."""
    out = {"page": (page_engine, None, None)}
    for name, layout in layouts.items():
        out[f"elements/{name}"] = (element_engine, ParseSettings("elements", name), layout)
    return out


def compare_parse_modes(page_engine, element_engine, pages: Sequence[Page], images: Sequence, decoders: Sequence[DecodeParams],
                        repeats: int = 1, layouts: Sequence[str] = ("ground-truth", "rapid-layout"),
                        formula_metric: str = "auto") -> dict:
    """The comparison as a JSON-able dict (see the module docstring); render it with :func:`table`.
    ``formula_metric``: the Overall's formula term (CDM where installed, with "auto")."""
    pages, images = list(pages), list(images)
    built = {name: make_layout(name) for name in layouts}
    formula_metric = resolve_formula_metric(formula_metric)
    report: dict = {"n_pages": len(pages), "repeats": repeats, "formula_metric": formula_metric, "decoders": {}}
    for params in decoders:
        modes = contenders(page_engine, element_engine, built)
        names = list(modes)
        seconds = {name: [0.0] * repeats for name in names}
        results: dict[str, list] = {name: [None] * len(pages) for name in names}
        for repeat in range(repeats):
            for index, (page, image) in enumerate(zip(pages, images, strict=True)):
                shift = (index + repeat) % len(names)
                for name in names[shift:] + names[:shift]:
                    engine, settings, layout = modes[name]
                    started = time.perf_counter()
                    [result] = read_pages(engine, [image], params, settings, [page], layout)
                    seconds[name][repeat] += time.perf_counter() - started
                    results[name][index] = result
        rows = {}
        for name in names:
            scores = aggregate_scores([score_page(r.text, p.markup) for r, p in zip(results[name], pages, strict=True)],
                                      formula_metric)
            rates = [len(pages) / s for s in seconds[name]]
            rows[name] = {
                "overall": scores.overall, "text_edit": scores.text_edit, "table_teds": scores.table_teds,
                "formula_edit": scores.formula_edit,
                "forwards_per_page": statistics.mean(r.stats.forward_passes for r in results[name]),
                "tokens_per_forward": (sum(r.stats.new_tokens for r in results[name])
                                       / max(1, sum(r.stats.forward_passes for r in results[name]))),
                "pages_per_second": statistics.median(rates), "pages_per_second_min": min(rates),
                "pages_per_second_max": max(rates),
                "elements_per_page": (statistics.mean(len(r.parse.decoded) for r in results[name])
                                      if results[name][0].parse is not None else None),
            }
        for name, row in rows.items():
            ratios = [p / e for p, e in zip(seconds["page"], seconds[name], strict=True)]
            row["pages_per_second_vs_page"] = statistics.median(ratios)
            row["vs_page_min"], row["vs_page_max"] = min(ratios), max(ratios)
        if "elements/ground-truth" in rows and "elements/rapid-layout" in rows:
            gt, detected = rows["elements/ground-truth"]["overall"], rows["elements/rapid-layout"]["overall"]
            report.setdefault("error_split", {})[params.decoder] = {
                "recognition_error": 100.0 - gt, "layout_error": gt - detected}
        report["decoders"][params.decoder] = rows
    return report


def table(report: dict) -> str:
    term = "CDM" if report.get("formula_metric") == "cdm" else "1 - formula edit (fallback)"
    lines = [f"Overall's formula term: {term}", "",
             "| decoder | mode | Overall | forwards/page | tokens/forward | pages/s (min-max) | vs page |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for decoder, rows in report["decoders"].items():
        for name, r in rows.items():
            lines.append(f"| {decoder} | {name} | {r['overall']:.2f} | {r['forwards_per_page']:.1f} | "
                         f"{r['tokens_per_forward']:.2f} | {r['pages_per_second']:.2f} ({r['pages_per_second_min']:.2f}-"
                         f"{r['pages_per_second_max']:.2f}) | {r['pages_per_second_vs_page']:.2f}x |")
    for decoder, split in report.get("error_split", {}).items():
        lines.append(f"\n{decoder}: recognition error {split['recognition_error']:.2f} points, "
                     f"layout error {split['layout_error']:.2f} points")
    return "\n".join(lines)


