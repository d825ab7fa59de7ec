"""How well an element model reads a page store's elements from their ground-truth boxes.

The second stage of a two-stage parse, measured alone: every ``text``, ``title`` and ``code``
element (and ``table`` / ``formula`` where the store has them) is cropped at native resolution
as the parser crops it, decoded, and compared with its content. Text-like elements score the
character error rate (Levenshtein over the truth's length, whitespace collapsed) and whether
the markup has the element's form (a title's ``#``, a code fence); tables score TEDS, formulas
the normalised edit distance. The reader's learning curve and its benchmark both use it.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image
from rapidfuzz.distance import Levenshtein

from components.data.markup import parse_markup
from components.data.page_store import PageDataset
from components.data.pages import MIN_IMAGE_SIDE
from components.decoding.engine import engine_capabilities
from components.decoding.types import DecodeParams
from components.evaluation.confidence import least_confident_share, rank_correlation, reliability_table
from components.metrics.table import teds
from components.parsing.assembly import element_content, element_markup
from components.parsing.crops import DEFAULT_CROP, crop_region
from components.parsing.frontend.sources import TEXT_LAYER_LINE_CROP, line_crop
from components.parsing.pieces import generate_groups, generate_in_pieces

TEXT_LIKE = ("text", "title", "code")


@dataclass
class ElementReading:
    page_id: str
    category: str
    truth: str
    markup: str
    errors: int  # character edits (text-like) ...
    length: int  # ... over this many truth characters
    form_kept: bool  # the markup is one block of the element's category
    score: float | None  # TEDS (tables) or 1 - normalised edit distance (formulas); None for text-like
    forwards: int
    tokens: int
    confidence: float | None = None  # the model's mean token confidence over the element
    content: str = ""  # the text read (the markup's content)


def _collapsed(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def store_elements(store: PageDataset, categories: tuple[str, ...], limit: int | None,
                   true_lines: bool = False) -> Iterator[tuple[str, str, str, Image.Image | list[Image.Image]]]:
    """(page id, category, content, crop) of the store's elements, page by page, up to ``limit``.

    ``true_lines``: instead of the crop, the element's true line boxes (``meta.element_lines``,
    from the text layer), each cropped as the front end crops a detected line: the decoder on the
    recogniser's own input, free of line finding (the same elements either way)."""
    count = 0
    for page in store.pages():
        image = None
        line_boxes = page.meta.get("element_lines") or []
        if len(line_boxes) != len(page.elements):  # no boxes, or elements edited since the corpus wrote them
            line_boxes = [[] for _ in page.elements]
        for element, boxes in zip(page.elements, line_boxes, strict=True):
            if element.category not in categories or not element.content.strip():
                continue
            if limit is not None and count >= limit:
                return
            image = image or store.load_image(page)
            crop = crop_region(image, element.bbox, DEFAULT_CROP)
            if crop.image is None:
                continue
            count += 1
            if true_lines:
                lines = (line_crop(image, tuple(box), TEXT_LAYER_LINE_CROP) for box in boxes)
                yield page.page_id, element.category, element.content, [c for c in lines if min(c.size) >= MIN_IMAGE_SIDE]
            else:
                yield page.page_id, element.category, element.content, crop.image


def score_element(page_id: str, category: str, truth: str, markup: str, forwards: int, tokens: int,
                  content: str | None = None, confidence: float | None = None) -> ElementReading:
    """``content``: what the model wrote when it writes bare text (the reader), else read off ``markup``."""
    blocks = parse_markup(markup) if markup.strip() else []
    form_kept = len(blocks) == 1 and blocks[0].category == category
    content = element_content(markup) if content is None else content.strip()
    score = None
    if category == "table":
        score = teds(content, truth)
    elif category == "formula":
        longer = max(len(truth), len(content), 1)
        score = 1.0 - Levenshtein.distance(content, truth) / longer
    collapsed_truth = _collapsed(truth)
    errors = Levenshtein.distance(_collapsed(content), collapsed_truth)
    return ElementReading(page_id, category, truth, markup, errors, len(collapsed_truth), form_kept, score, forwards,
                          tokens, confidence, content)


def read_store(engine, store: PageDataset, params: DecodeParams, categories: tuple[str, ...] = TEXT_LIKE,
               limit: int | None = None, batch: int = 16, true_lines: bool = False) -> tuple[list[ElementReading], float]:
    """Decode the store's elements in batches; the readings and the decoding seconds.
    ``true_lines``: read each element's true line boxes instead of its crop."""
    readings: list[ElementReading] = []
    seconds = 0.0
    writes_markup = engine_capabilities(engine).writes_markup
    pending: list[tuple] = []

    def flush() -> None:
        nonlocal seconds
        if not pending:
            return
        started = time.perf_counter()
        kinds = [item[1] for item in pending]
        if true_lines:
            results = generate_groups(engine, [item[3] for item in pending], params, categories=kinds)
        else:
            results = generate_in_pieces(engine, [item[3] for item in pending], params, categories=kinds)
        seconds += time.perf_counter() - started
        for (page_id, category, truth, _), result in zip(pending, results, strict=True):
            if writes_markup:
                markup, content = result.text, None
            else:  # bare text: its form comes from the (here: true) category, as the parser gives it
                markup, content = element_markup(category, result.text), result.text
            readings.append(score_element(page_id, category, truth, markup, result.stats.forward_passes,
                                          result.stats.new_tokens, content, result.stats.mean_confidence))
        pending.clear()

    for item in store_elements(store, categories, limit, true_lines):
        pending.append(item)
        if len(pending) == batch:
            flush()
    flush()
    return readings, seconds


def summarize_readings(readings: list[ElementReading], seconds: float | None = None) -> dict:
    """Pooled CER and form per category (text-like), mean score (tables, formulas), speed."""
    by_category: dict[str, list[ElementReading]] = defaultdict(list)
    for reading in readings:
        by_category[reading.category].append(reading)
    table = {}
    for category, rows in sorted(by_category.items()):
        entry = {"elements": len(rows), "characters": sum(r.length for r in rows),
                 "cer": sum(r.errors for r in rows) / max(1, sum(r.length for r in rows)),
                 "median_element_cer": statistics.median(r.errors / max(1, r.length) for r in rows),
                 "form_kept": sum(r.form_kept for r in rows) / len(rows)}
        scores = [r.score for r in rows if r.score is not None]
        if scores:
            entry["score"] = statistics.fmean(scores)
        table[category] = entry
    text_like = [r for r in readings if r.category in TEXT_LIKE]
    forwards, tokens = sum(r.forwards for r in readings), sum(r.tokens for r in readings)
    summary = {"elements": len(readings), "by_category": table,
               "cer": sum(r.errors for r in text_like) / max(1, sum(r.length for r in text_like)),
               "forwards": forwards, "tokens": tokens, "tokens_per_forward": tokens / max(1, forwards)}
    if seconds is not None:
        summary |= {"seconds": seconds, "tokens_per_second": tokens / max(seconds, 1e-9)}
    rated = [r for r in text_like if r.confidence is not None]
    if rated:
        summary["confidence"] = confidence_report(rated)
    return summary


def confidence_report(readings: list[ElementReading]) -> dict:
    """What the per-element confidence says about the element's errors (text-like elements)."""
    confidences = [float(r.confidence) for r in readings]
    return {"spearman_vs_element_cer": rank_correlation(confidences, [r.errors / max(1, r.length) for r in readings]),
            "errors_in_least_confident_tenth": least_confident_share(confidences, [r.errors for r in readings]),
            "reliability": reliability_table(confidences, [r.errors for r in readings], [r.length for r in readings])}
