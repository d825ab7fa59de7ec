"""The free OCR scored on the challenger's own pages: what a trained model has to beat.

A team's model is worth training only if it reads their pages better than the OCR that
pre-annotates for free (RapidOCR: :mod:`components.curation.preannotate.rapidocr`). The reference
reads the same evaluation pages and is scored with the same page metrics; it is reported beside
the challenger and the incumbent, never gated on (the incumbent is the promotion's yardstick).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from components.curation.preannotate.rapidocr import RapidOCRAnnotator
from components.data.page_store import PageDataset
from components.data.pages import Page
from components.metrics import aggregate_scores, score_page

OCR_REFERENCES = {"rapidocr": RapidOCRAnnotator}


def ocr_reference_scores(name: str, dataset: PageDataset, pages: Sequence[Page], formula_metric: str) -> dict:
    """The reference OCR's scores on ``pages`` (their own truth) and its seconds per page."""
    annotator = OCR_REFERENCES[name]()
    started = time.perf_counter()
    page_scores = [score_page(annotator.annotate(dataset.load_image(page), page.page_id).markup, page.markup)
                   for page in pages]
    seconds = time.perf_counter() - started
    scores = aggregate_scores(page_scores, formula_metric).as_dict()
    return {"name": name, "model_version": annotator.model_version, "pages": len(pages),
            "seconds_per_page": round(seconds / max(1, len(pages)), 3),
            **{key: None if scores.get(key) is None else round(scores[key], 4)
               for key in ("overall", "overall_present", "text_edit", "table_teds", "formula_edit")}}
