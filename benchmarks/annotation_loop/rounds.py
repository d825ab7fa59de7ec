"""What every round of both annotation loops does after the policy has picked its pages: some of the
corrected pages are set aside for the stage check, and the retrained model goes on only if it reads
them at least as well as its input (the chain's stage check, on corrections never trained on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def set_aside(chosen: list[str], share: float, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(pages to train on, pages for the check): ``share`` of the round's corrected pages, drawn at random,
    as a team keeps some of its corrections for validation."""
    n_check = round(len(chosen) * share)
    for_check = set(rng.permutation(chosen)[:n_check].tolist()) if n_check else set()
    return [p for p in chosen if p not in for_check], [p for p in chosen if p in for_check]


def keep_better(input_dir: Path, output_dir: Path, score: Callable[[Path], float],
                higher_is_better: bool) -> tuple[Path, dict[str, float]]:
    """The retrained model if it scores at least as well as its input on the check pages, else the input."""
    before, after = score(input_dir), score(output_dir)
    better = after >= before if higher_is_better else after <= before
    return (output_dir if better else input_dir), {"check_input": before, "check_output": after,
                                                   "kept_output": float(better)}
