"""Drift checks and the production request log."""

from __future__ import annotations

import numpy as np
import pytest

from monitoring.drift import check_drift, load_reference, population_stability_index, save_reference
from monitoring.request_log import RequestLog, ServedPage


def _signals(rng: np.random.Generator, n: int, confidence: float, length: float) -> dict[str, list[float]]:
    return {
        "mean_confidence": list(np.clip(rng.normal(confidence, 0.03, n), 0, 1)),
        "new_tokens": list(rng.normal(length, 10, n)),
    }


def test_psi_is_zero_for_identical_and_large_for_shifted_distributions():
    rng = np.random.default_rng(0)
    reference = rng.normal(0, 1, 2000)
    assert population_stability_index(reference, reference) == pytest.approx(0.0, abs=1e-9)
    assert population_stability_index(reference, rng.normal(0, 1, 2000)) < 0.05
    assert population_stability_index(reference, rng.normal(1.5, 1, 2000)) > 0.5
    constant = np.full(50, 3.0)
    assert population_stability_index(constant, constant) == pytest.approx(0.0, abs=1e-9)


def test_drift_is_flagged_only_when_production_moves():
    rng = np.random.default_rng(1)
    reference = _signals(rng, 300, confidence=0.95, length=120)
    same = check_drift(reference, _signals(rng, 200, confidence=0.95, length=120))
    assert not same.drifted
    shifted = check_drift(reference, _signals(rng, 200, confidence=0.80, length=120))
    assert shifted.drifted
    by_name = {s.signal: s for s in shifted.signals}
    assert by_name["mean_confidence"].drifted and not by_name["new_tokens"].drifted
    assert shifted.flat_metrics()["drift.any"] == 1.0


def test_drift_check_refuses_tiny_windows_and_missing_reference(tmp_path):
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="not enough production pages: 5 < 20"):
        check_drift(_signals(rng, 100, 0.9, 100), _signals(rng, 5, 0.9, 100))
    with pytest.raises(FileNotFoundError, match="no drift reference"):
        load_reference(tmp_path / "missing.json")
    rows = [{"mean_confidence": 0.9, "new_tokens": 10, "page_id": "a"}]
    assert load_reference(save_reference(rows, tmp_path / "ref.json")) == {"mean_confidence": [0.9], "new_tokens": [10.0]}


def test_request_log_keeps_images_of_low_confidence_pages_only(tmp_path):
    log = RequestLog(tmp_path, keep_images_below=0.8)
    image = b"\x89PNG fake bytes"
    low = ServedPage(page_id=RequestLog.page_id_for(image), decoder="sdb", mean_confidence=0.5, new_tokens=10,
                     forward_passes=4, latency_s=0.1, truncated=False, text="x")
    high = ServedPage(page_id="prod-high", decoder="ar", mean_confidence=0.99, new_tokens=10, forward_passes=10,
                      latency_s=0.1, truncated=False, text="y")
    log.record(low, image)
    log.record(high, b"other")
    with log.path.open("a") as handle:
        handle.write('{"page_id": "torn')  # a crash mid-write leaves half a line
    entries = log.entries()
    assert [e.page_id for e in entries] == [low.page_id, "prod-high"]
    assert log.image_path(entries[0]).read_bytes() == image
    assert entries[1].image is None


def test_kept_images_are_pruned_by_age_then_by_size(tmp_path):
    import os
    import time

    log = RequestLog(tmp_path, keep_images_below=0.8, max_image_mb=2500 / 1024 / 1024, image_retention_days=1)
    now = time.time()
    entries = []
    for age_days, name in [(3.0, "ancient"), (0.5, "older"), (0.2, "newer"), (0.0, "newest")]:
        payload = name.encode() * (1000 // len(name))  # ~1000 bytes each
        entry = ServedPage(page_id=f"prod-{name}", decoder="ar", mean_confidence=0.1, new_tokens=1, forward_passes=1,
                           latency_s=0.1, truncated=False, text=name)
        log._last_prune = now  # keep record() from pruning before the ages are set
        log.record(entry, payload)
        os.utime(tmp_path / entry.image, (now - age_days * 86400, now - age_days * 86400))
        entries.append(entry)
    removed = log.prune_images(now)
    # "ancient" is past the 1-day retention; of the rest, the oldest goes until <= 2500 bytes remain
    assert sorted(p.stem for p in removed) == ["prod-ancient", "prod-older"]
    assert [log.image_path(e) is not None for e in log.entries()] == [False, False, True, True]
    assert len(log.entries()) == 4  # the JSON lines stay
