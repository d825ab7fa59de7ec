"""Curation steps as the pipeline runs them, each idempotent and resumable.

The Prefect ``curate`` flow calls these one by one (as tasks, with retries where a service is
involved); they hold no Prefect code, so tests and notebooks run them directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from components.curation.labelstudio.api import connect, queued_page_ids
from components.curation.labelstudio.corrections import apply_corrections, export_corrections
from components.curation.labelstudio.interface import LABEL_CONFIGS
from components.curation.labelstudio.predictions import PagePrediction
from components.curation.labelstudio.project import ensure_project
from components.curation.labelstudio.queue import queue_pages
from components.curation.mining import mine_consistency, write_hard_examples
from components.curation.preannotate import PreAnnotation, make_preannotator, preannotate_dataset
from components.curation.splits import make_splits
from components.curation.targets import TargetReport, page_with_target
from components.data.page_records import PREANNOTATED
from components.data.page_store import PageDataset
from components.data.pages import LayoutElement
from components.data.pdf import import_images, import_pdfs
from components.data.synthetic import SyntheticConfig, generate_page
from components.data.versioning import DataVersion, DataVersioner
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.parsing import ParseSettings, read_pages, resolve_parse
from components.parsing.assembly import element_content, recognition_category
from components.pipeline import PipelineConfig
from components.progress import Progress
from components.services.labelstudio import start_label_studio

logger = logging.getLogger(__name__)


@dataclass
class LabelStudioHandle:
    client: object
    url: str
    project_id: int
    view: str = "page"


def ingest_pages(cfg: PipelineConfig) -> dict:
    """Add the configured synthetic pages (and PDFs / images) to ``data/pages``; existing pages stay."""
    dataset = PageDataset(cfg.pages_dir, shard_rows=cfg.ingest.shard_rows)
    synthetic = SyntheticConfig.preset(cfg.ingest.synthetic_preset)
    total, first = cfg.ingest.synthetic_pages, cfg.ingest.synthetic_seed
    report_every = max(1, total // 10)
    added, pending = 0, []
    for start in range(0, total, cfg.ingest.shard_rows):  # one id lookup and one upsert per shard's worth
        seeds = range(first + start, first + min(total, start + cfg.ingest.shard_rows))
        existing = set(dataset.get_many(f"syn-{seed:08d}" for seed in seeds))
        for seed in seeds:
            offset = seed - first
            if offset and offset % report_every == 0:
                print(f"[ingest] synthetic pages {offset}/{total} ({added + len(pending)} new) -> {cfg.pages_dir}", flush=True)
            page_id = f"syn-{seed:08d}"
            if page_id in existing:
                continue
            page, image = generate_page(seed, synthetic, page_id=page_id)
            page.image = dataset.save_image(page_id, image)
            pending.append(page)
        if pending:
            dataset.upsert(pending)
            added, pending = added + len(pending), []
    report = {"synthetic_added": added}
    if cfg.ingest.pdf_dir or cfg.ingest.image_dir:
        if cfg.ingest.pdf_dir:
            report["pdf"] = import_pdfs(cfg.ingest.pdf_dir, cfg.pages_dir, on_error="skip").summary()
        if cfg.ingest.image_dir:
            report["images"] = import_images(cfg.ingest.image_dir, cfg.pages_dir, on_error="skip").summary()
    if cfg.ingest.page_store:
        report["page_store_added"] = copy_pages(PageDataset(cfg.repository / cfg.ingest.page_store), dataset)
    report["total_pages"] = len(dataset)
    return report


def copy_pages(source: PageDataset, target: PageDataset) -> int:
    """Copy ``source``'s pages (records and images) that ``target`` lacks; how many were added."""
    if not source.exists():
        raise FileNotFoundError(f"ingest.page_store: no page store at {source.root}")
    ids = source.ids()
    existing = set(target.get_many(ids))
    pending = []
    for page in source.iter_pages():
        if page.page_id in existing:
            continue
        page.image = target.save_image(page.page_id, source.load_image(page))
        pending.append(page)
    if pending:
        target.upsert(pending)
    return len(pending)


def preannotation_units(cfg: PipelineConfig) -> list[dict]:
    """One unit per store shard: the first ``max_pages`` pages (a fixed sample of pages that have
    ground truth, pre-annotated for the annotators' queue) plus every page with no truth of its own
    (imported PDFs and images), whose pre-annotation is the only target they can have."""
    dataset = PageDataset(cfg.pages_dir)
    units = dataset.shard_units(cfg.curation.preannotation.max_pages)
    if cfg.curation.preannotation.max_pages is None:
        return units
    untargeted = [page_id for table in dataset.scan(["elements", "markup_override"])
                  for page_id, elements, override in zip(table.column("page_id").to_pylist(),
                                                         table.column("elements").to_pylist(),
                                                         table.column("markup_override").to_pylist(), strict=True)
                  if elements in ("[]", "", None) and not override]
    wanted = {unit["shard"]: list(unit["page_ids"]) for unit in units}
    listed = {page_id for ids in wanted.values() for page_id in ids}
    for page_id, shard in dataset.shard_of(untargeted).items():
        if page_id not in listed:
            wanted.setdefault(shard, []).append(page_id)
    return [{"shard": shard.name, "page_ids": wanted[shard.name]} for shard in dataset.shards() if shard.name in wanted]


def preannotate_shard(cfg: PipelineConfig, unit: dict) -> dict:
    """Pre-annotate one store shard into its own folder (disjoint writers: safe in parallel tasks).
    Pages that already carry this model version's pre-annotation are skipped; an interrupted run
    resumes from the folder's journal (named after the shard, which only the merge changes)."""
    section = cfg.curation.preannotation
    annotator = make_preannotator({"backend": section.backend, **section.options})
    dataset = PageDataset(cfg.pages_dir)
    pages = dataset.unit_pages(unit)
    todo = [page.page_id for page in pages
            if (page.meta.get("preannotation") or {}).get("model_version") != annotator.model_version]
    out = PageDataset(cfg.run_dir / "preannotation" / unit["shard"].removesuffix(".parquet"))
    report = preannotate_dataset(dataset, annotator, out=out, page_ids=todo,
                                 progress=_preannotation_progress(unit["shard"], len(todo), annotator.model_version))
    return {"shard": unit["shard"], "out": str(out.root), "annotated": len(report.annotated),
            "skipped": len(report.skipped) + len(pages) - len(todo), "failed": report.failed,
            "seconds": round(report.seconds, 1), "model_version": annotator.model_version}


def _preannotation_progress(shard: str, total: int, model_version: str):
    """A progress callback printing one line per page (slow backends take seconds a page), naming the
    page as its owner knows it (PDF file and page) and where its text came from."""
    progress = Progress(f"pre-annotate {model_version} {shard}", total)

    def report(page, annotation) -> None:
        progress.update(f"{page_name(page)}: {annotation_source(annotation)}", always=True)

    return report


def page_name(page) -> str:
    """``manual.pdf p3`` for an imported PDF page, the image file for an image, else the page id."""
    meta = page.meta
    if meta.get("pdf_path"):
        return f"{Path(meta['pdf_path']).name} p{meta.get('page_number', '?')}"
    if page.source and ":" in page.source and not page.source.startswith("synthetic"):
        return page.source.split(":", 1)[1]
    return page.page_id


def annotation_source(annotation) -> str:
    """``text layer, confidence 1.000`` / ``OCR (the text layer is empty), confidence 0.912`` / ``failed``."""
    if annotation is None:
        return "failed (see the warning above)"
    extra = annotation.extra or {}
    source = extra.get("source") or annotation.model_version
    if source == "text-layer":
        where = "text layer"
    elif str(source).startswith("ocr"):
        where = f"OCR ({extra['fallback_reason']})" if extra.get("fallback_reason") else "OCR"
    else:
        where = str(source)
    return f"{where}, confidence {annotation.confidence:.3f}"


def merge_preannotations(cfg: PipelineConfig, shard_reports: list[dict]) -> str:
    """Fold every shard's pre-annotations into ``data/pages`` (one writer, one shard at a time);
    returns the pre-annotator's model version. The queue reads its candidates from the store
    (:func:`preannotated_candidates`), so pages annotated by earlier runs count too."""
    section = cfg.curation.preannotation
    model_version = make_preannotator({"backend": section.backend, **section.options}).model_version
    dataset = PageDataset(cfg.pages_dir)
    for shard_report in shard_reports:
        out = PageDataset(shard_report["out"])
        if not out.exists():
            continue
        found = {}
        for page in out.iter_pages():
            record = page.meta.get("preannotation")
            if record and record.get("model_version") == model_version:
                found[page.page_id] = record
        updated = []
        for page in dataset.get_many(found).values():
            if page.meta.get("preannotation") != found[page.page_id]:
                page.meta["preannotation"] = found[page.page_id]
                updated.append(page)
        if updated:
            dataset.upsert(updated)
    return model_version


def preannotation_elements(record: dict) -> list:
    """The layout boxes of a stored pre-annotation record (for the block view)."""
    return PreAnnotation.from_json(record).elements


def label_studio(cfg: PipelineConfig) -> LabelStudioHandle:
    """Connect to the configured Label Studio, starting the project's own server if none is given."""
    section = cfg.curation.label_studio
    if section.url:
        if not section.api_key:
            raise ValueError("curation.label_studio.url is set but api_key is not")
        url, api_key = section.url, section.api_key
    else:
        connection = start_label_studio(section.port)
        url, api_key = connection.url, connection.api_key
    client = connect(url, api_key)
    project_id = ensure_project(client, section.project, LABEL_CONFIGS[section.view])
    return LabelStudioHandle(client=client, url=url, project_id=project_id, view=section.view)


def choose_for_queue(candidates: list[PagePrediction], *, policy: str, below: float, max_tasks: int,
                     already_queued: int = 0) -> list[PagePrediction]:
    """The pages to queue now, lowest confidence first.

    ``threshold``: pages under ``below`` confidence, at most ``max_tasks`` per run. ``budget``: the
    least confident pages whatever their confidence, until the project holds ``max_tasks`` tasks
    from every source (pre-annotation, hard examples, production) together — a confident
    pre-annotator (RapidOCR reports 0.97–0.99998 on real pages) still fills the annotators' queue.
    """
    ranked = sorted((p for p in candidates if admits(policy, below, p.confidence)), key=lambda p: (p.confidence, p.page_id))
    return ranked[: max(0, max_tasks - already_queued)] if policy == "budget" else ranked[:max_tasks]


def admits(policy: str, below: float, confidence: float) -> bool:
    """Whether the queue policy takes a page of this confidence at all (a budget takes any)."""
    if policy not in ("threshold", "budget"):
        raise ValueError(f"queue policy must be 'threshold' or 'budget', not {policy!r}")
    return policy == "budget" or confidence < below


def queue_for_annotation(cfg: PipelineConfig, dataset: PageDataset, predictions: list[PagePrediction], model_version: str) -> dict:
    """Queue the least confident pages by the configured policy (threshold or budget), lowest first.
    Pages already queued stay as they are; a page the policy newly admits (a raised threshold, a
    larger budget) is queued on the next run."""
    section = cfg.curation.label_studio
    if not predictions:
        return {"queued": 0, "already_queued": 0, "policy": section.queue_policy}
    handle = label_studio(cfg)
    existing = queued_page_ids(handle.client, handle.project_id)
    fresh = [p for p in predictions if p.page_id not in existing]
    chosen = choose_for_queue(fresh, policy=section.queue_policy, below=section.queue_below_confidence,
                              max_tasks=section.max_tasks, already_queued=len(existing))
    # Queued pages this model re-scored keep their task and get its prediction (as the policy admits them).
    rescored = [p for p in predictions if p.page_id in existing
                and admits(section.queue_policy, section.queue_below_confidence, p.confidence)]
    result = queue_pages(handle.client, handle.project_id, dataset, chosen + rescored, model_version, view=handle.view)
    return {"queued": len(result.queued), "already_queued": len(result.already_queued), "policy": section.queue_policy,
            "candidates": len(predictions), "url": handle.url, "project_id": handle.project_id}


def preannotated_candidates(dataset: PageDataset) -> list[PagePrediction]:
    """Every page of the store holding a pre-annotation and no annotator's correction yet, with its
    latest pre-annotation: the queue reconsiders them all on each run, not only this run's pages."""
    candidates = []
    for page in dataset.iter_pages(filter=PREANNOTATED):
        record = page.meta.get("preannotation")
        if isinstance(record, dict) and not page.meta.get("correction"):
            candidates.append(PagePrediction(page.page_id, record["markup"], float(record["confidence"]),
                                             tuple(preannotation_elements(record))))
    return candidates


def import_corrections(cfg: PipelineConfig) -> dict:
    """Apply annotators' accepted corrections to ``data/pages``; report the rejected ones."""
    handle = label_studio(cfg)
    corrections = export_corrections(handle.client, handle.project_id)
    changed = apply_corrections(PageDataset(cfg.pages_dir), corrections)
    rejected = [{"page_id": c.page_id, "reason": c.reason} for c in corrections if not c.accepted]
    return {"corrections": len(corrections), "applied": len(changed), "rejected": rejected}


def split_pages(cfg: PipelineConfig) -> dict:
    """Assign splits (by document) and write the split stores with each page's target; pages with
    nothing to learn from are left out and counted, once, in the log."""
    targets = TargetReport()
    result = make_splits(PageDataset(cfg.pages_dir), cfg.curation.splits, out_dir=cfg.splits_dir,
                         target=lambda page: page_with_target(page, targets))
    if targets.dropped:
        print(f"[split] dropped {sum(targets.dropped.values())} unusable pages: {dict(targets.dropped)}", flush=True)
    written = {name: len(store) for name, store in result.datasets.items()}
    return {**written, "assigned": result.counts(), "targets": targets.summary()}


def mining_units(cfg: PipelineConfig) -> list[dict]:
    return PageDataset(cfg.split_dir("train")).shard_units(cfg.curation.mining.max_pages)


def mining_parse(cfg: PipelineConfig, model_dir) -> ParseSettings:
    """How the mining model reads pages (``curation.mining.parse``; "auto": as it was trained)."""
    section = cfg.curation.mining
    return ParseSettings(resolve_parse(section.parse, model_dir), section.layout)


def mine_shard(cfg: PipelineConfig, model_dir, model_version: str, unit: dict) -> dict:
    """C(x) for the training pages of one store shard under the given model (its own journal, so
    shards mine in parallel tasks and each resumes on its own)."""

    section = cfg.curation.mining
    train = PageDataset(cfg.split_dir("train"))
    report = mine_consistency(
        DecodingEngine.from_pretrained(model_dir), train, T=section.samples, temperature=section.temperature,
        tau_train=section.tau_train, kind=section.kind, max_new_tokens=section.max_new_tokens,
        model_version=model_version, page_ids=train.unit_page_ids(unit),
        journal_name=f"consistency-{unit['shard'].removesuffix('.parquet')}.journal.jsonl",
        parsing=mining_parse(cfg, model_dir),
    )
    return {"shard": unit["shard"], "mined": len(report.mined), "skipped": len(report.skipped), "hard": len(report.hard),
            "scores": report.scores, "seconds": round(report.seconds, 1)}


def collect_hard_examples(cfg: PipelineConfig, model_dir, shard_reports: list[dict]) -> tuple[dict, list[PagePrediction]]:
    """Write the hard pages to ``data/hard``; returns a summary and, per hard page, the model's
    greedy markup as the prediction an annotator starts from, with C(x) as its confidence (least
    consistent first in the queue)."""

    section = cfg.curation.mining
    hard = write_hard_examples(PageDataset(cfg.split_dir("train")), cfg.hard_dir)
    engine = DecodingEngine.from_pretrained(model_dir)
    parsing = mining_parse(cfg, model_dir)
    predictions = []
    # a model consistent on every page leaves no hard page, and then no store: nothing to queue
    for page in hard.iter_pages() if hard.exists() else ():
        [result] = read_pages(engine, [hard.load_image(page)], DecodeParams(max_new_tokens=section.max_new_tokens),
                              parsing, [page])
        elements, notes = (), ()
        if result.parse is not None:  # element mode: the elements pre-drawn, the hard ones marked
            hard_boxes = {tuple(e["box"]): e["consistency"] for e in page.meta.get("hard_elements", [])}
            decoded = [e for e in result.parse.elements if e.stats is not None]
            elements = tuple(LayoutElement(recognition_category(e.category) or "text", e.box, element_content(e.markup))
                             for e in decoded)
            notes = tuple(hard_boxes.get(tuple(round(v, 1) for v in e.box)) for e in decoded)
        predictions.append(PagePrediction(page.page_id, result.text, float(page.meta.get("consistency", 0.0)),
                                          elements, notes))
    scores = [c for report in shard_reports for c in report["scores"].values()]
    summary = {"shards": len(shard_reports), "mined": sum(r["mined"] for r in shard_reports),
               "skipped": sum(r["skipped"] for r in shard_reports), "hard": sum(r["hard"] for r in shard_reports),
               "mean_consistency": sum(scores) / len(scores) if scores else None,
               "seconds": round(sum(r["seconds"] for r in shard_reports), 1)}
    return summary, predictions


def version_data(cfg: PipelineConfig, message: str) -> DataVersion:
    """``dvc add data`` + push to the local remote; the version every later run records."""
    return DataVersioner(cfg.repository, data_dir=cfg.data_dir).commit(message)


def current_data_version(cfg: PipelineConfig) -> DataVersion | None:
    return DataVersioner(cfg.repository, data_dir=cfg.data_dir).current_version()
