"""Does a training stage end at or above the model it started from? Both are read now, on the
same held-out pages (the validation split), with greedy AR; the chain continues from the better one.

A short CPU stage can make a model worse (too high a learning rate for a good starting point, too
few steps, a Stage-2 mix that overweights a few pages); without this check the next stage, the
gate and the served model silently inherit the loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from components.data.page_store import PageDataset
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.evaluate import assert_held_out, evaluate_decoders
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

    @property
    def below(self) -> bool:
        return self.output_overall < self.input_overall

    def line(self) -> str:
        verdict = "ENDED BELOW its input; the chain continues from the input" if self.below else "at or above its input"
        return (f"[train {self.stage}] AR Overall {self.output_overall:.2f} vs {self.input_overall:.2f} for its input on "
                f"the same {self.pages} validation pages: {verdict}")

    def as_dict(self) -> dict:
        return {**asdict(self), "below": self.below}


def overall_on(model_dir: Path, dataset: PageDataset, pages: list, max_new_tokens: int) -> float:
    """Greedy AR Overall of a model on ``pages``, read as the model was trained (page or elements)."""
    parsing = ParseSettings(trained_parse_mode(model_dir), "ground-truth")
    report = evaluate_decoders(DecodingEngine.from_pretrained(model_dir), dataset,
                               [DecodeParams(decoder="ar", max_new_tokens=max_new_tokens)], pages=pages, parsing=parsing)
    return report.decoders["ar"].overall


def check_stage(cfg: PipelineConfig, stage: str, input_model: Path, output_model: Path) -> StageCheck:
    """Score the stage's output and its input on the same validation pages; keep the better one."""
    dataset = PageDataset(cfg.split_dir(cfg.training.check_split))
    for folder in (input_model, output_model):
        assert_held_out(folder, dataset)
    pages = [page for page in dataset.iter_pages(page_ids=dataset.ids(limit=cfg.training.check_pages))
             if page.markup.strip()]
    if not pages:
        raise ValueError(f"no {cfg.training.check_split} page with ground truth to check stage {stage} on")
    budget = cfg.curation.mining.max_new_tokens
    before = overall_on(input_model, dataset, pages, budget)
    after = overall_on(output_model, dataset, pages, budget)
    kept = input_model if after < before and cfg.training.keep_better else output_model
    check = StageCheck(stage, str(input_model), str(output_model), round(before, 2), round(after, 2), len(pages),
                       str(kept))
    print(check.line(), flush=True)
    return check
