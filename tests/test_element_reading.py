"""The element evaluation: crops or true line boxes, and what its confidence report says."""

from pathlib import Path

import pytest

from components.evaluation.confidence import least_confident_share, rank_correlation, reliability_table

CORPUS_PAGES = Path(__file__).parent / "fixtures" / "corpus_pages"


def test_the_least_confident_tenth_share_counts_errors_on_the_least_confident_items():
    confidences = [0.99, 0.2, 0.95, 0.9, 0.97, 0.98, 0.96, 0.94, 0.93, 0.92, 0.91, 0.5]
    errors = [0, 30, 1, 2, 0, 0, 1, 0, 3, 0, 3, 10]
    # 10 % of 12 items rounds up to 2: the two least confident (0.2 and 0.5) hold 40 of 50 errors
    assert least_confident_share(confidences, errors) == pytest.approx(0.8)
    assert least_confident_share(confidences, [0] * 12) is None
    # a confidence that ranks the errors the wrong way round catches none of them
    assert least_confident_share([0.1, 0.9], [0, 5], fraction=0.5) == 0.0


def test_rank_correlation_and_the_reliability_table():
    confidences = [0.5, 0.6, 0.7, 0.8, 0.9, 0.99]
    assert rank_correlation(confidences, [6, 5, 4, 3, 2, 1]) == -1.0
    assert rank_correlation(confidences, [1, 1, 1, 1, 1, 1]) is None
    table = reliability_table(confidences, errors=[5, 4, 3, 2, 1, 0], lengths=[10] * 6, bins=3)
    assert [row["items"] for row in table] == [2, 2, 2]
    assert [row["confidence_range"] for row in table] == [[0.5, 0.6], [0.7, 0.8], [0.9, 0.99]]
    assert [row["character_accuracy"] for row in table] == [0.55, 0.75, 0.95]


@pytest.fixture(scope="module")
def copy_prior_engine():
    from components.decoding.engine import DecodingEngine
    from models.reader import new_reader_model

    return DecodingEngine(*new_reader_model(seed=0))


def test_true_line_boxes_read_every_text_element_with_the_recogniser_s_accuracy(copy_prior_engine):
    """Read on the text layer's own line boxes, an untrained copy-prior reader writes what the
    recogniser reads: close to the truth on real corpus pages; on the same elements' crops (its own
    line finding) it reads each element too, and the report says how confidence tracks errors."""
    from components.data.page_store import PageDataset
    from components.decoding.types import DecodeParams
    from components.evaluation.element_reading import read_store, summarize_readings

    store = PageDataset(CORPUS_PAGES)
    params = DecodeParams(max_new_tokens=768)
    lines, _ = read_store(copy_prior_engine, store, params, limit=60, true_lines=True)
    crops, _ = read_store(copy_prior_engine, store, params, limit=60)
    assert len(lines) == len(crops) == 60
    assert [(r.page_id, r.truth) for r in lines] == [(r.page_id, r.truth) for r in crops]
    summary = summarize_readings(lines)
    # measured 0.50 % on true lines, 3.0 % on crops (line finding, and elements whose box holds more text)
    assert summary["cer"] < 0.012, summary["cer"]
    assert summarize_readings(crops)["cer"] < 0.08
    report = summary["confidence"]
    assert sum(row["items"] for row in report["reliability"]) == 60
    assert all(0.0 < r.confidence <= 1.0 for r in lines)
