"""Does a training stage end above the model it started from? Both are read now, on the same
held-out pages (the validation split, pages with independent truth first), with greedy AR; the chain
continues from the better one, and from its input on a tie (unless ``training.keep_ties``).

A short CPU stage can make a model worse (too high a learning rate for a good starting point, too
few steps, a Stage-2 mix that overweights a few pages); without this check the next stage, the
gate and the served model silently inherit the loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from components.data.page_store import PageDataset
from components.data.provenance import INDEPENDENT_KINDS, describe_truth, truth_counts, truth_kind, truth_of
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import assert_held_out, evaluate_decoders
from components.metrics import reported_overall
from components.parsing import ParseSettings, trained_parse_mode
from components.pipeline import PipelineConfig


@dataclass
class StageCheck:
    stage: str
    input_model: str
    output_model: str
    input_overall: float
    output_overall: float
    pages: int
    kept: str  # the model the chain continues from
    truth: str = ""  # what the check pages' targets are, e.g. "text-layer 2" or "preannotation:rapidocr 2 (silver)"
    metric: str = "overall"  # the Overall compared: OmniDocBench's, or the mean of the terms present

    @property
    def below(self) -> bool:
        return self.output_overall < self.input_overall

    @property
    def tied(self) -> bool:
        return self.output_overall == self.input_overall

    def line(self) -> str:
        if self.below:
            verdict = "ENDED BELOW its input; the chain continues from the input"
        elif self.tied:
            verdict = ("TIED its input; kept (training.keep_ties)" if self.kept == self.output_model
                       else "TIED its input; the chain continues from the input (a tie is not an improvement)")
        else:
            verdict = "above its input"
        return (f"[train {self.stage}] AR {self.metric} {self.output_overall:.2f} vs {self.input_overall:.2f} for its input "
                f"on the same {self.pages} validation pages (truth: {self.truth}): {verdict}")

    def as_dict(self) -> dict:
        return {**asdict(self), "below": self.below, "tied": self.tied}


def overall_on(model_dir: Path, dataset: PageDataset, pages: list, max_new_tokens: int) -> tuple[float, str]:
    """Greedy AR Overall of a model on ``pages``, read as the model was trained (page or elements):
    OmniDocBench's when the pages have text, tables and formulas, else the mean of the terms present
    (a prose-only Overall is capped at 33.3); with its name."""
    parsing = ParseSettings(trained_parse_mode(model_dir), "ground-truth")
    report = evaluate_decoders(DecodingEngine.from_pretrained(model_dir), dataset,
                               [DecodeParams(decoder="ar", max_new_tokens=max_new_tokens)], pages=pages, parsing=parsing)
    overall, label = reported_overall(report.decoders["ar"].scores)
    return float(overall or 0.0), label


def check_pages(dataset: PageDataset, limit: int) -> list:
    """Up to ``limit`` pages with a target, those whose truth no model wrote (text layer, corrections,
    synthetic) first: a check graded on a model's own pre-annotation only measures agreement with it."""
    pages = [page for page in dataset.iter_pages() if page.markup.strip()]
    pages.sort(key=lambda page: truth_kind(truth_of(page)) not in INDEPENDENT_KINDS)  # stable: store order within
    return pages[:limit]


def describe_check_truth(pages: list) -> str:
    """``text-layer 2`` / ``preannotation:rapidocr-3.4 2 (silver: a model's pre-annotation)``."""
    counts = truth_counts(pages)
    silver = any(truth_kind(truth) not in INDEPENDENT_KINDS for truth in counts)
    return describe_truth(counts) + (" (silver: graded on a model's pre-annotation, not independent truth)" if silver else "")


def check_stage(cfg: PipelineConfig, stage: str, input_model: Path, output_model: Path) -> StageCheck:
    """Score the stage's output and its input on the same validation pages; keep the better one."""
    dataset = PageDataset(cfg.split_dir(cfg.training.check_split))
    for folder in (input_model, output_model):
        assert_held_out(folder, dataset)
    pages = check_pages(dataset, cfg.training.check_pages)
    if not pages:
        raise ValueError(f"no {cfg.training.check_split} page with ground truth to check stage {stage} on")
    budget = cfg.curation.mining.max_new_tokens
    before, metric = overall_on(input_model, dataset, pages, budget)
    after, _ = overall_on(output_model, dataset, pages, budget)
    before, after = round(before, 2), round(after, 2)
    worse = after < before or (after == before and not cfg.training.keep_ties)
    kept = input_model if worse and cfg.training.keep_better else output_model
    check = StageCheck(stage, str(input_model), str(output_model), before, after, len(pages), str(kept),
                       truth=describe_check_truth(pages), metric=metric)
    print(check.line(), flush=True)
    return check
