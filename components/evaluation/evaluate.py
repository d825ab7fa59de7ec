"""Score and time every decoder on one dataset with one model, in one run.

Quality is OmniDocBench v1.5 (``components.metrics``); speed is forward passes per page,
tokens per forward and tokens/s from the shared engine's accounting. Ratios against AR are
taken inside the same run on the same pages, so machine load affects both sides alike.
Used by the benchmark script, the evaluation flow and the registry's promotion gates.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from components.data.page_store import PageDataset
from components.data.pages import Page
from components.data.provenance import describe_truth, truth_counts, truth_of, written_by
from components.data.seeds import seen_seeds, synthetic_seeds
from components.decoding.engine import DecodingEngine, decode_stats_summary
from components.decoding.types import DECODERS, DecodeParams, DecodeResult
from components.metrics import (
    aggregate_scores,
    present_terms,
    reported_overall,
    resolve_formula_metric,
    score_page,
)
from components.parsing import ParseSettings, make_layout, read_pages
from components.progress import Progress

CATEGORY_METRICS = ("text_edit", "table_teds", "table_teds_s", "formula_edit", "reading_order_edit", "overall")


@dataclass
class DecoderEvaluation:
    """One decoder's quality and speed on a dataset."""

    name: str
    params: dict
    scores: dict[str, float]
    speed: dict
    pages: list[dict] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # page_id -> generated token ids
    texts: dict[str, str] = field(default_factory=dict)  # page_id -> decoded markup
    wall_seconds: float = 0.0
    # Kept so that evaluations of disjoint page sets (store shards) merge exactly: see merge_reports.
    page_scores: list = field(default_factory=list, repr=False)
    results: list[DecodeResult] = field(default_factory=list, repr=False)
    formula_metric: str = "edit"  # the Overall's formula term: "cdm" or the "edit" fallback

    @property
    def overall(self) -> float:
        return float(self.scores.get("overall", 0.0))


@dataclass
class EvaluationReport:
    """All decoders on the same pages, with their ratios against the AR baseline."""

    n_pages: int
    decoders: dict[str, DecoderEvaluation]
    baseline: str = "ar"
    # Pages left out because they have no ground truth (imported, never pre-annotated or corrected):
    # scoring them against the empty string would report 0 for a model that may read them well.
    refused_no_truth: int = 0
    # Pages left out because the model under test (or one it descends from) wrote their truth.
    refused_own_output: int = 0
    truth: dict[str, int] = field(default_factory=dict)  # provenance of the scored pages' truth -> pages

    @property
    def truth_line(self) -> str:
        """What the scores rest on, e.g. ``truth: text-layer 3, correction 1 (2 pages refused: ...)``."""
        refused = (f" ({self.refused_own_output} pages refused: their truth is the model's own output)"
                   if self.refused_own_output else "")
        return f"truth: {describe_truth(self.truth)}{refused}"

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per decoder: speedups over AR (>1 = faster) and score delta (points of Overall)."""
        base = self.decoders[self.baseline]
        table = {}
        for name, ev in self.decoders.items():
            table[name] = {
                "forward_reduction": _ratio(base.speed["forward_passes"], ev.speed["forward_passes"]),
                "tps_speedup": _ratio(ev.speed["tokens_per_second"], base.speed["tokens_per_second"]),
                "wall_speedup": _ratio(base.wall_seconds, ev.wall_seconds),
                "overall_delta": ev.overall - base.overall,
                "same_output_as_ar": _same_output_fraction(ev, base),
            }
        return table

    def as_dict(self) -> dict:
        return {
            "n_pages": self.n_pages,
            "refused_no_truth": self.refused_no_truth,
            "refused_own_output": self.refused_own_output,
            "truth": dict(self.truth),
            "baseline": self.baseline,
            "formula_metric": next(iter(self.decoders.values())).formula_metric,
            "decoders": {
                # vars, not asdict: asdict would deep-copy the per-page scores and results only to drop them
                name: {k: v for k, v in vars(ev).items() if k not in ("pages", "outputs", "texts", "page_scores", "results")}
                | {"overall": ev.overall}
                for name, ev in self.decoders.items()
            },
            "ratios": self.ratios(),
        }

    def flat_metrics(self) -> dict[str, float]:
        """``<decoder>.<metric>`` floats for MLflow."""
        flat: dict[str, float] = {}
        ratios = self.ratios()
        for name, ev in self.decoders.items():
            for key, value in ev.scores.items():
                flat[f"{name}.{key}"] = float(value)
            for key in ("forward_passes", "new_tokens", "tokens_per_forward", "tokens_per_second", "mean_confidence"):
                flat[f"{name}.{key}"] = float(ev.speed[key])
            flat[f"{name}.forwards_per_page"] = ev.speed["forward_passes"] / max(1, self.n_pages)
            for key, value in ratios[name].items():
                flat[f"{name}.{key}"] = float(value)
        return flat

    def table(self) -> str:
        """A fixed-width table for terminals and logs."""
        ratios = self.ratios()
        header = f"{'decoder':<8} {'Overall':>8} {'text_ed':>8} {'TEDS':>6} {'form_ed':>8} {'CDM':>6} {'fwd/page':>9} {'TPF':>6} {'tok/s':>8} {'fwd x':>7} {'tok/s x':>8} {'=AR':>5}"
        first = next(iter(self.decoders.values())).scores
        _, label = reported_overall(first)
        formulas = f"; its formula term: {self.formula_metric_label}" if "formulas" in present_terms(first) else ""
        lines = [f"{label}{formulas}; {self.truth_line}", header, "-" * len(header)]
        for name, ev in self.decoders.items():
            s, r = ev.scores, ratios[name]
            overall, _ = reported_overall(s)
            lines.append(
                f"{name:<8} {overall or 0.0:8.2f} {_fmt(s.get('text_edit')):>8} {_fmt(s.get('table_teds')):>6} "
                f"{_fmt(s.get('formula_edit')):>8} {_fmt(s.get('formula_cdm')):>6} "
                f"{ev.speed['forward_passes'] / max(1, self.n_pages):9.1f} "
                f"{ev.speed['tokens_per_forward']:6.2f} {ev.speed['tokens_per_second']:8.1f} "
                f"{r['forward_reduction']:7.2f} {r['tps_speedup']:8.2f} {r['same_output_as_ar']:5.2f}"
            )
        return "\n".join(lines)

    @property
    def formula_metric_label(self) -> str:
        metric = next(iter(self.decoders.values())).formula_metric
        return "CDM" if metric == "cdm" else "1 - formula edit distance (fallback: CDM's toolchain not installed)"

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2))
        return path


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator else 0.0


def _same_output_fraction(ev: DecoderEvaluation, base: DecoderEvaluation) -> float:
    shared = [pid for pid in ev.outputs if pid in base.outputs]
    if not shared:
        return 0.0
    return sum(ev.outputs[pid] == base.outputs[pid] for pid in shared) / len(shared)


class NotHeldOutError(ValueError):
    """An evaluation set holding pages the model was trained on."""


@dataclass(frozen=True)
class TokenBudget:
    """How many tokens evaluation lets each page emit, from the pages' own targets and the model."""

    max_new_tokens: int
    longest_target: int  # tokens of the longest target (markup + <eos>)
    room: int  # tokens the model's positions leave after its image prefix
    too_long: int  # pages whose target the model cannot emit whole

    def describe(self) -> str:
        text = (f"max_new_tokens {self.max_new_tokens} (longest target {self.longest_target} tokens, "
                f"the model can emit {self.room})")
        return text + (f"; {self.too_long} pages are longer than the model can emit" if self.too_long else "")


def token_budget(engine: DecodingEngine, pages: Sequence[Page], margin: float = 1.1, multiple: int = 32) -> TokenBudget:
    """The longest target among ``pages`` plus ``margin``, rounded up to ``multiple``, within the room
    the model's positions leave (a page longer than that is counted, never silently cut)."""
    if not pages:
        raise ValueError("no pages to size a token budget on")
    lengths = [len(engine.tokenizer(page.markup, add_special_tokens=False)["input_ids"]) + 1 for page in pages]
    room = engine.token_room()
    wanted = math.ceil(max(lengths) * margin / multiple) * multiple
    return TokenBudget(max_new_tokens=max(1, min(room, wanted)), longest_target=max(lengths), room=room,
                       too_long=sum(length > room for length in lengths))


class OwnOutputTruthError(ValueError):
    """Every page's truth was written by the model under test (or its lineage)."""


class NoGroundTruthError(ValueError):
    """No page offered for evaluation has anything to be scored against."""


def assert_held_out(model_dir: str | Path, dataset: PageDataset) -> None:
    """Refuse to score a model on synthetic pages whose seeds its training (or its base's) used."""
    ranges = seen_seeds(model_dir)
    if not ranges:
        return
    overlap = [seed for seed in synthetic_seeds(dataset.root) if any(lo <= seed <= hi for lo, hi in ranges)]
    if overlap:
        raise NotHeldOutError(
            f"{len(overlap)} pages of {dataset.root} (seeds {overlap[:5]}...) were seen in training of {model_dir}; "
            "evaluate on another seed (--seed) or page folder (--pages-dir)")


def evaluate_decoder(
    engine: DecodingEngine, dataset: PageDataset, params: DecodeParams, pages: Sequence[Page] | None = None,
    batch_size: int = 1, parsing: ParseSettings | None = None, formula_metric: str = "auto",
) -> DecoderEvaluation:
    """Decode every page and score it against its ground-truth markup.

    ``batch_size=1`` gives per-page latency and tokens/s comparable across decoders. With
    ``parsing.mode == "elements"`` each page is parsed in two stages (its elements one batch) and
    the assembled markup is scored. ``formula_metric``: the Overall's formula term, "cdm", "edit"
    or "auto" (CDM where pdflatex is installed).
    """
    pages = list(pages if pages is not None else dataset.pages())
    if not pages:
        raise ValueError(f"dataset {dataset.root} has no pages to evaluate")
    results: list[DecodeResult] = []
    layout = make_layout(parsing.layout) if parsing is not None and parsing.elements else None
    started = time.perf_counter()
    progress = Progress(f"evaluate {params.decoder}", len(pages), quiet_s=10.0)
    for first in range(0, len(pages), batch_size):
        chunk = pages[first : first + batch_size]
        results.extend(read_pages(engine, [dataset.load_image(p) for p in chunk], params, parsing, chunk, layout))
        progress.update(chunk[-1].page_id, count=len(chunk))
    wall = time.perf_counter() - started
    page_scores = [score_page(r.text, p.markup) for p, r in zip(pages, results, strict=True)]
    return _decoder_evaluation(params.decoder, asdict(params), [p.page_id for p in pages], page_scores, results, wall,
                               resolve_formula_metric(formula_metric))


def _decoder_evaluation(name: str, params: dict, page_ids: Sequence[str], page_scores: list,
                        results: list[DecodeResult], wall: float, formula_metric: str) -> DecoderEvaluation:
    rows = [
        {
            "page_id": page_id,
            **{k: getattr(s, k) for k in CATEGORY_METRICS},
            "forward_passes": r.stats.forward_passes,
            "new_tokens": r.stats.new_tokens,
            "truncated": r.truncated,
            "mean_confidence": r.stats.mean_confidence,
        }
        for page_id, r, s in zip(page_ids, results, page_scores, strict=True)
    ]
    scores = aggregate_scores(page_scores, formula_metric).as_dict() | {
        "truncated_pages": float(sum(r.truncated for r in results))}
    return DecoderEvaluation(
        name=name, params=params, scores=scores,
        speed=decode_stats_summary(results).as_dict(), pages=rows,
        outputs={page_id: r.token_ids for page_id, r in zip(page_ids, results, strict=True)},
        texts={page_id: r.text for page_id, r in zip(page_ids, results, strict=True)}, wall_seconds=wall,
        page_scores=page_scores, results=results, formula_metric=formula_metric,
    )


def merge_reports(reports: Sequence[EvaluationReport]) -> EvaluationReport:
    """One report from reports on disjoint pages (one per store shard): the page-level scores and
    the per-page speed accounting are pooled, so the result equals one evaluation of all pages."""
    if not reports:
        raise ValueError("no evaluation reports to merge")
    if len(reports) == 1:
        return reports[0]
    decoders = {}
    for name, first in reports[0].decoders.items():
        parts = [report.decoders[name] for report in reports]
        decoders[name] = _decoder_evaluation(
            name, first.params, [row["page_id"] for part in parts for row in part.pages], [s for part in parts for s in part.page_scores],
            [r for part in parts for r in part.results], sum(part.wall_seconds for part in parts), first.formula_metric)
    truth = sum((Counter(report.truth) for report in reports), Counter())
    return EvaluationReport(n_pages=sum(report.n_pages for report in reports), decoders=decoders,
                            baseline=reports[0].baseline,
                            refused_no_truth=sum(report.refused_no_truth for report in reports),
                            refused_own_output=sum(report.refused_own_output for report in reports),
                            truth=dict(truth.most_common()))


def evaluate_decoders(
    engine: DecodingEngine, dataset: PageDataset, decoders: Sequence[DecodeParams] | None = None,
    limit: int | None = None, batch_size: int = 1, pages: Sequence[Page] | None = None,
    parsing: ParseSettings | None = None, formula_metric: str = "auto", lineage: Collection[str] = (),
) -> EvaluationReport:
    """Run each decoder on the same pages (``pages``, else the first ``limit`` of the store);
    AR is always included as the baseline. Pages whose truth a model of ``lineage`` (weight
    fingerprints: :func:`components.data.provenance.model_lineage`) wrote are refused."""
    decoders = list(decoders or [DecodeParams(decoder=name) for name in DECODERS])
    if not any(p.decoder == "ar" for p in decoders):
        decoders.insert(0, DecodeParams(decoder="ar", max_new_tokens=decoders[0].max_new_tokens))
    names = [p.decoder for p in decoders]
    if len(set(names)) != len(names):
        raise ValueError(f"each decoder may appear once per report, got {names}")
    offered = list(pages if pages is not None else dataset.iter_pages(page_ids=dataset.ids(limit=limit)))
    with_truth = [page for page in offered if page.markup.strip()]
    refused = len(offered) - len(with_truth)
    if not with_truth:
        raise NoGroundTruthError(
            f"none of the {len(offered)} pages of {dataset.root} has ground truth (no markup, correction or "
            "pre-annotation); pre-annotate or correct them before evaluating")
    pages = [page for page in with_truth if not written_by(truth_of(page), lineage)]
    own = len(with_truth) - len(pages)
    if own:
        writers = sorted({truth_of(page) for page in with_truth} - {truth_of(page) for page in pages})
        print(f"[evaluate] refused {own} of {len(with_truth)} pages: their truth ({', '.join(writers)}) was written "
              "by the model under test or a model it descends from", flush=True)
    if not pages:
        raise OwnOutputTruthError(
            f"all {len(with_truth)} pages of {dataset.root} with truth were pre-annotated by the model under test or its "
            "lineage: there is nothing independent to score it against; correct pages in Label Studio or pre-annotate "
            "with the text layer (backend auto) or another model")
    if refused:
        print(f"[evaluate] {refused} of {len(offered)} pages of {dataset.root} have no ground truth; left out", flush=True)
    formula_metric = resolve_formula_metric(formula_metric)  # once, so every decoder is scored alike
    evaluations = {p.decoder: evaluate_decoder(engine, dataset, p, pages, batch_size, parsing, formula_metric)
                   for p in decoders}
    for params in decoders:
        cut = int(evaluations[params.decoder].scores["truncated_pages"])
        if cut:
            print(f"[evaluate] {params.decoder}: {cut} of {len(pages)} pages stopped at max_new_tokens={params.max_new_tokens} "
                  "or the model's positions before <eos>; their scores count the missing rest", flush=True)
    return EvaluationReport(n_pages=len(pages), decoders=evaluations, refused_no_truth=refused,
                            refused_own_output=own, truth=truth_counts(pages))


def plot_score_vs_speed(report: EvaluationReport, path: str | Path) -> Path:
    """Overall score against tokens/s, one point per decoder (an MLflow artifact)."""
    import matplotlib  # deferred: plotting only, with the Agg backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: plotting only, with the Agg backend chosen first

    # Decoders often sit on top of each other (equal scores, close speeds): a legend under the
    # axes names each marker, so no label can overlap another or leave the figure.
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    markers = "osD^vP*X"
    for index, (name, ev) in enumerate(report.decoders.items()):
        ax.scatter(ev.speed["tokens_per_second"], ev.overall, s=70, marker=markers[index % len(markers)], alpha=0.85,
                   label=f"{name}: Overall {ev.overall:.1f}, {ev.speed['tokens_per_second']:.0f} tok/s, "
                         f"TPF {ev.speed['tokens_per_forward']:.2f}")
    ax.margins(x=0.15, y=0.15)
    ax.set_xlabel("tokens / s")
    ax.set_ylabel(f"Overall (OmniDocBench v1.5, formula term: {next(iter(report.decoders.values())).formula_metric})")
    ax.set_title(f"Score vs speed on {report.n_pages} pages")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def write_category_tables(report: EvaluationReport, folder: str | Path) -> list[Path]:
    """Per-page, per-category CSV of each decoder (an MLflow artifact)."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, ev in report.decoders.items():
        path = folder / f"{name}_pages.csv"
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(ev.pages[0].keys()))
            writer.writeheader()
            writer.writerows(ev.pages)
        written.append(path)
    return written
