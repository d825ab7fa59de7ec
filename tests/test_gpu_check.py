"""The prepared device check runs every part at toy sizes on the CPU, so a lent GPU's 15 minutes
never go to a script that breaks."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.services  # the triton part starts a real Triton server


def test_gpu_check_smoke_runs_every_part_and_writes_one_report(tmp_path):
    from benchmarks.gpu_check import PARTS, main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["parts"]) == set(PARTS) and all("report" in part for part in report["parts"].values())
    shipped = report["parts"]["shipped"]["report"]["docmarkup-base"]
    switches = shipped.pop("switches")
    assert shipped["sdb"]["equals_ar"] and all(row["batch8_equals_batch1"] for row in shipped.values())
    assert switches and all(row["equals_default_ar"] for row in switches.values())  # the fixed-shape step on CPU
    assert report["parts"]["triton"]["report"]["stream_equals_unary"] == 1
    assert report["parts"]["decoding"]["report"]["generate_equals_ar_pages"] == 1
    assert "| triton |" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    import benchmarks.gpu_check as gpu_check

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpu_check, "shipped_part", broken)
    assert gpu_check.main(["--smoke", "--parts", "shipped,training", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["parts"]["shipped"]["error"] == "RuntimeError: CUDA error: out of memory"
    assert "report" in report["parts"]["training"]
