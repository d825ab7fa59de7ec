"""The life-cycle configuration the Prefect flows share, validated up front.

One YAML file (``configs/pipeline/*.yaml``) says where data lives, how curation, training,
evaluation, deployment and monitoring run. Unknown keys and impossible values are rejected
before any flow starts work, with the offending key named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from components.services.process import PROJECT_ROOT, VAR_DIR


class PipelineConfigError(ValueError):
    """A pipeline config that cannot run."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class IngestSection(_Strict):
    synthetic_pages: int = Field(160, ge=0)
    synthetic_seed: int = 0
    synthetic_preset: Literal["tiny", "standard"] = "tiny"
    pdf_dir: str | None = None  # bring your own pages: PDFs rendered with pypdfium2
    image_dir: str | None = None
    # Pages with their ground truth from another page store (a real-document corpus split, say):
    # copied in as they are; their truth trains and evaluates like the synthetic pages'.
    page_store: str | None = None
    # Records per shard of the page store made at ingest (curation tasks run one per shard).
    shard_rows: int = Field(10_000, ge=1)


class PreannotationSection(_Strict):
    # auto: a PDF page's own text layer where it is usable (exact, independent truth), else OCR
    # (options.fallback, RapidOCR by default); see components/curation/preannotate/pdf_text.py
    backend: str = "auto"
    options: dict[str, Any] = Field(default_factory=dict)
    max_pages: int | None = Field(16, ge=1)  # the demo pre-annotates a sample; None = all pages


class LabelStudioSection(_Strict):
    enabled: bool = True
    url: str | None = None  # an existing server; None = start the project's own
    api_key: str | None = None
    port: int = 8089
    project: str = "docmarkup pages"
    # "threshold": pages under queue_below_confidence, at most max_tasks per run; "budget": the
    # max_tasks least confident pages across every source, whatever their confidence.
    queue_policy: Literal["threshold", "budget"] = "threshold"
    queue_below_confidence: float = Field(0.9, ge=0.0, le=1.0)
    max_tasks: int = Field(50, ge=1)
    # "blocks": layout boxes labelled by category with one transcription each (markup rebuilt in
    # reading order); "page": one text box with the whole page's markup.
    view: Literal["blocks", "page"] = "blocks"


class MiningSection(_Strict):
    samples: int = Field(4, ge=2, description="T stochastic decodes per page")
    temperature: float = Field(1.0, gt=0.0)
    tau_train: float = Field(0.75, ge=0.0, le=1.0)
    kind: Literal["page", "text", "table", "formula"] = "page"
    max_pages: int | None = Field(32, ge=1)
    max_new_tokens: int = Field(192, ge=8)
    # "auto": as the mining model was trained. In element mode every element of a page gets its own
    # C (TEDS for tables, edit similarity for text and formulas) over the T samples; the page's C(x) is
    # their mean, and hard elements are marked on the page and in its Label Studio task.
    parse: Literal["auto", "page", "elements"] = "auto"
    layout: Literal["ground-truth", "rapid-layout"] = "ground-truth"


class CurationSection(_Strict):
    preannotation: PreannotationSection = Field(default_factory=PreannotationSection)
    label_studio: LabelStudioSection = Field(default_factory=LabelStudioSection)
    mining: MiningSection = Field(default_factory=MiningSection)
    splits: dict[str, float] = Field(default_factory=lambda: {"train": 0.8, "val": 0.1, "test": 0.1})


class StageSection(_Strict):
    """One training stage. Stages run in the order the config declares them; each continues the
    chain's model so far (the first: the base model), unless it trains ``beside_chain``."""

    config: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    # Mine the chain's model so far on the training split first (consistency mining, the hard pages
    # queued to Label Studio and versioned), and train on those hard pages beside the split.
    # None: on for a stage named stage2, the shipped chain's hard-example stage.
    hard_examples: bool | None = None
    # Train from the chain's start, beside it, and do not continue from it (an element model trained
    # beside a page model, compared with it). None: on for a stage named elements.
    beside_chain: bool | None = None


class TrainingSection(_Strict):
    # The checkpoint Stage 1 continues (your dots.ocr / Qwen2.5-VL / MinerU2.5 folder); None: what
    # the Stage-1 YAML names (the shipped docmarkup-base).
    base_model: str | None = None
    launcher: Literal["inprocess", "torchrun", "deepspeed"] = "inprocess"
    num_processes: int = Field(1, ge=1)  # per node (GPUs per node on a GPU cluster)
    nodes: int = Field(1, ge=1)
    # Multi-node: torchrun meets at a c10d rendezvous (the same command runs on every node);
    # the deepspeed launcher starts every node listed in an MPI-style hostfile from the first one.
    rdzv_endpoint: str | None = None  # host:port, for launcher torchrun
    hostfile: str | None = None  # "host slots=N" lines, for launcher deepspeed
    stages: dict[str, StageSection]
    # After each stage its output and its input are read (greedy AR) on the same held-out pages; a
    # stage that ends below its input is reported, and with keep_better the chain goes on from the input.
    check_pages: int = Field(16, ge=0)  # 0: no check
    check_split: Literal["val", "test"] = "val"
    keep_better: bool = True
    # A stage that ties its input (same score on the check pages) is not kept: the chain continues from
    # the input. True: keep the tying stage's output anyway.
    keep_ties: bool = False

    @model_validator(mode="after")
    def _multi_node_needs_a_meeting_point(self) -> TrainingSection:
        if self.nodes > 1:
            if self.launcher == "inprocess":
                raise ValueError("training.nodes > 1 needs launcher torchrun or deepspeed")
            if self.launcher == "torchrun" and not self.rdzv_endpoint:
                raise ValueError("training.nodes > 1 with torchrun needs training.rdzv_endpoint (host:port of node 0)")
            if self.launcher == "deepspeed" and not self.hostfile:
                raise ValueError("training.nodes > 1 with deepspeed needs training.hostfile")
        return self

    @field_validator("stages")
    @classmethod
    def _declared_stages(cls, stages: dict[str, StageSection]) -> dict[str, StageSection]:
        if not stages:
            raise ValueError("training needs at least one stage")
        for name, section in stages.items():
            if section.hard_examples is None:
                section.hard_examples = name == "stage2"
            if section.beside_chain is None:
                section.beside_chain = name == "elements"
        first = next(iter(stages))
        if stages[first].beside_chain or stages[first].hard_examples:
            raise ValueError(f"the first stage ({first}) starts the chain: it can neither train beside it nor "
                             "mine the chain's model before it")
        return stages


class GatesSection(_Strict):
    # A challenger must beat the incumbent (on the same pages) by more than min_improvement points of
    # the gated score; one that does not is promoted only when it reads tie_speed_gain times faster
    # (tokens/s, same run) and at most max_score_drop points below it. A tie is never a reload.
    min_improvement: float = Field(0.0, ge=0.0)
    tie_speed_gain: float = Field(1.2, gt=1.0)
    max_score_drop: float = Field(0.0, ge=0.0)
    min_speedup: float = 1.5
    speed_decoder: str = "sdb"
    speed_metric: Literal["forward_reduction", "tps_speedup", "wall_speedup"] = "forward_reduction"
    min_overall: float = 0.0
    # overall | overall_present | auto (overall_present when the test set lacks tables or formulas)
    score_metric: Literal["auto", "overall", "overall_present"] = "auto"


class EvaluationSection(_Strict):
    split: Literal["val", "test"] = "test"
    pages_dir: str | None = None  # any page folder (pages.jsonl + images) to evaluate on instead of the split
    max_pages: int | None = Field(24, ge=1)
    # Tokens each page may emit; "auto": from the test pages' own targets (the longest, +10 %), capped by
    # what the model's positions leave after its image prefix (pages longer than that are reported).
    max_new_tokens: Annotated[int, Field(ge=8)] | Literal["auto"] = 256
    decoders: list[Literal["ar", "sdb", "block", "ppc"]] = Field(default_factory=lambda: ["ar", "sdb", "block", "ppc"])
    threshold: float = 0.95
    window: int = 16
    # How the model reads pages: "auto" (as it was trained: training_meta.json's unit), "page", or
    # "elements" (two-stage: layout, then element crops; components/parsing). The layout of element
    # mode: "rapid-layout" (what serving runs) or "ground-truth" (the pages' own boxes: an oracle).
    parse: Literal["auto", "page", "elements"] = "auto"
    layout: Literal["rapid-layout", "ground-truth"] = "rapid-layout"
    # The Overall's formula term: "cdm" (the leaderboard's; needs ./run setup --cdm), "edit" (the
    # fallback), or "auto": CDM where pdflatex and Ghostscript are installed.
    formula_metric: Literal["auto", "cdm", "edit"] = "auto"
    model_name: str = "docmarkup"
    gates: GatesSection = Field(default_factory=GatesSection)
    # The free OCR scored on the same pages and reported beside the challenger and the incumbent
    # (never gated on): "rapidocr" (the offline pre-annotation's own OCR) or None.
    ocr_reference: Literal["rapidocr"] | None = None


class DeploySection(_Strict):
    enabled: bool = True
    model_uri: str | None = None  # default: models:/<model_name>@champion
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    smoke_pages: int = Field(4, ge=0)
    smoke_timeout_s: float = Field(120.0, gt=0)  # per request of the smoke test and the served-version check
    # How the Triton models serve (deploy/triton/repository.py): torch device of the backend
    # ("cuda" or "cuda:N" on GPU nodes: KIND_GPU instances on that GPU), model instances, requests
    # decoded together, torch threads per instance.
    device: str = "cpu"
    instance_count: int = Field(1, ge=1)
    max_batch_size: int = Field(8, ge=0)
    # Requests that may wait per model before the next is refused at once (UNAVAILABLE, "Exceeds
    # maximum queue size"; the client's ServerBusyError); 0: unbounded.
    max_queue_size: int = Field(32, ge=0)
    torch_threads: int = Field(1, ge=0)
    # The engine's decode step: "default", "fixed_shapes", "compile" (torch.compile), "cuda_graphs"
    # (device cuda only), "cuda_graphs_compiled" — components/decoding/fixed_step.py.
    engine_step: Literal["default", "fixed_shapes", "compile", "cuda_graphs", "cuda_graphs_compiled"] = "default"


class MonitoringSection(_Strict):
    low_confidence: float = Field(0.8, ge=0.0, le=1.0)
    psi_threshold: float = Field(0.2, gt=0)
    ks_pvalue_threshold: float = Field(0.01, gt=0, lt=1)
    # Served pages a drift verdict needs (at least monitoring.drift.MIN_VERDICT_PAGES = 20: fewer is noise).
    min_production_pages: int = Field(20, ge=20)
    # Page images the serving log keeps for low-confidence requests (monitoring/request_log.py):
    # at most this many MB, none older than this many days.
    max_image_mb: float = Field(1024.0, gt=0)
    image_retention_days: float = Field(30.0, gt=0)


class ExecutionSection(_Strict):
    """How Prefect runs parallel tasks: threads in the flow process, or a Dask cluster."""

    task_runner: Literal["threads", "dask"] = "threads"
    workers: int = Field(2, ge=1)
    dask_address: str | None = None  # an existing scheduler (tcp://...); None = a local cluster
    prefect_port: int = Field(4200, ge=1, le=65535)  # the project's Prefect server (API + UI) on 127.0.0.1


class PipelineConfig(_Strict):
    name: str = "docmarkup"
    repo_root: str = "."  # the git/DVC repository that versions data_dir (relative: to the project)
    data_dir: str = "data"  # relative to repo_root; versioned as <repo_root>/<data_dir>.dvc
    work_dir: str | None = None  # run state (training outputs, shard journals); None = var/pipeline/<name>
    ingest: IngestSection = Field(default_factory=IngestSection)
    curation: CurationSection = Field(default_factory=CurationSection)
    training: TrainingSection
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    deploy: DeploySection = Field(default_factory=DeploySection)
    monitoring: MonitoringSection = Field(default_factory=MonitoringSection)
    execution: ExecutionSection = Field(default_factory=ExecutionSection)

    @model_validator(mode="after")
    def _data_inside_its_repository(self) -> PipelineConfig:
        """DVC versions only what lies inside its repository: refuse it now, not after ingestion."""
        root, data = self.repository.resolve(), self.data_root.resolve()
        if data == root or root not in data.parents:
            raise ValueError(f"data_dir {self.data_dir!r} resolves to {data}, which is not inside repo_root {root}: "
                             "DVC versions only a folder inside its repository; give data_dir relative to repo_root, "
                             "or point repo_root at the repository that holds the data")
        return self

    # ----- derived paths (one place, so flows never disagree about where things are) -------
    @property
    def repository(self) -> Path:
        return _resolve(self.repo_root)

    @property
    def data_root(self) -> Path:
        return self.repository / self.data_dir

    @property
    def pages_dir(self) -> Path:
        return self.data_root / "pages"

    @property
    def splits_dir(self) -> Path:
        return self.data_root / "splits"

    def split_dir(self, split: str) -> Path:
        return self.splits_dir / split

    @property
    def evaluation_dir(self) -> Path:
        """The pages the evaluation scores: ``evaluation.pages_dir`` if set, else the held-out split."""
        return _resolve(self.evaluation.pages_dir) if self.evaluation.pages_dir else self.split_dir(self.evaluation.split)

    @property
    def hard_dir(self) -> Path:
        return self.data_root / "hard"

    @property
    def production_dir(self) -> Path:
        return self.data_root / "production"

    @property
    def run_dir(self) -> Path:
        return _resolve(self.work_dir) if self.work_dir else VAR_DIR / "pipeline" / self.name


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else (PROJECT_ROOT / path)


def load_pipeline_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read and validate a pipeline YAML; ``overrides`` use dotted keys (``evaluation.max_pages``)."""
    path = _resolve(path)
    if not path.exists():
        raise PipelineConfigError(f"pipeline config {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise PipelineConfigError(f"{path} is not valid YAML: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise PipelineConfigError(f"{path}: {problems}") from exc
