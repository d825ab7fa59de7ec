"""Training configuration: one YAML file per stage, validated before anything heavy starts.

Every section rejects unknown keys and every cross-field rule (objective names, flags that
cannot go together, paths that must exist) is checked when the file is loaded, so a typo costs
a second instead of a DeepSpeed start-up (the torchtune habit of rejecting bad recipes early).

Relative paths in a config are relative to the project root (the folder holding ``configs/``),
so the same file works from any working directory and under every launcher.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# name -> what it trains (shown in error messages)
OBJECTIVES: dict[str, str] = {
    "ar": "next-token cross-entropy on the clean sequence",
    "dar": "DARL window reconstruction (gt prefix + drafts + <INIT>, causal)",
    "darl": "DARL fine-tune: OMTG candidates, DAR on the greedy one + dtpo_coef * DTPO",
    "block_diffusion": "MinerU-Diffusion masked-diffusion loss in bidirectional blocks",
    "pabdm_csl": "PA-BDM causal intra-block denoising with the confidence-gated structural loss",
}


class TrainConfigError(ValueError):
    """A training config that cannot run; the message names the offending keys."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BootstrapSection(_Strict):
    """Train a tokenizer on the dataset's markup and create a fresh tiny model."""

    vocab_size: int = Field(512, ge=64, le=65536)
    min_frequency: int = Field(2, ge=1)
    architecture: Literal["tiny", "base"] = "tiny"  # models.docvlm.tiny_config / base_config


class LoraSection(_Strict):
    """Train LoRA adapters instead of all weights; the saved folder holds the merged weights."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None  # default: the decoder's attention and MLP projections
    trainable: list[str] = Field(default_factory=list)  # also train parameters whose name contains these


class ModelSection(_Strict):
    init_from: str | None = None  # a model folder (save_markup_model layout)
    bootstrap: BootstrapSection | None = None
    lora: LoraSection | None = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSection:
        if (self.init_from is None) == (self.bootstrap is None):
            raise ValueError("set exactly one of model.init_from (a model folder) or model.bootstrap")
        return self


class DataSection(_Strict):
    dataset: str  # PageDataset folder: the broad (Stage-1) pages
    hard_examples: str | None = None  # PageDataset of curated hard pages (Stage 2)
    hard_ratio: float = Field(0.0, ge=0.0, le=1.0)  # fraction of each batch drawn from hard_examples
    consistency_beta: float = Field(0.0, ge=0.0)  # per-sample weight 1 + beta * (1 - C(x))
    max_tokens: int = Field(256, ge=8)  # <bos> + markup + <eos>, truncated beyond
    # "page": a whole page per example; "element": each body element's crop (two-stage parsers)
    unit: Literal["page", "element"] = "page"
    prompt_style: str | None = None  # element task prompts (components.parsing.prompts); None: the family's own
    workers: int = Field(0, ge=0)  # DataLoader processes decoding and preprocessing pages ahead of the step
    version: str | None = None  # data version (e.g. a DVC revision), recorded in training_meta.json and MLflow

    @model_validator(mode="after")
    def _hard_examples_need_a_ratio(self) -> DataSection:
        if self.hard_examples is None and self.hard_ratio > 0:
            raise ValueError("data.hard_ratio > 0 needs data.hard_examples")
        if self.hard_examples is not None and self.hard_ratio == 0:
            raise ValueError("data.hard_examples is set but data.hard_ratio is 0, so it would never be sampled")
        return self


class DarSection(_Strict):
    window: int = Field(16, ge=2, le=256)  # w
    draft: Literal["gt", "corrupt", "model"] = "corrupt"  # what fills the l_p candidate slots without OMTG
    corrupt_prob: float = Field(0.25, ge=0.0, le=1.0)


class DarlSection(_Strict):
    candidates: int = Field(4, ge=2, le=16)  # K
    temperature: float = Field(1.2, gt=0.0)
    dtpo_coef: float = Field(0.1, ge=0.0)
    advantage_eps: float = Field(1e-4, gt=0.0)
    max_retries: int = Field(20, ge=0)  # duplicate-candidate resampling budget per sample
    # components/training/darl.py says which default follows the authors' code and why; each
    # older choice stays a switch (and a row of benchmarks.darl_ablation).
    policy_context: Literal["init", "candidate"] = "init"  # where DTPO's log-probs come from
    ar_slot: Literal["skip", "score"] = "skip"  # the exact AR token: never a candidate, or scored
    lookahead_slots: Literal["window", "init"] = "window"  # what r2 scores after the rerun
    credit: Literal["pickup", "lcp", "lcp_per_candidate"] = "pickup"  # which candidate tokens get the advantage
    draft_alignment: Literal["own", "left"] = "own"  # DAR's drafts at their own token's position
    reward: Literal["lcp", "edit"] = "lcp"
    lookahead: bool = True  # r2 (the look-ahead reward) on top of r1
    permute_advantages: bool = False  # control: advantages shuffled within each group

    @model_validator(mode="after")
    def _left_needs_the_skipped_ar_slot(self) -> DarlSection:
        if self.draft_alignment == "left" and self.ar_slot != "skip":
            raise ValueError("darl.draft_alignment: left places drafts after the AR token; it needs ar_slot: skip")
        return self


class BlockDiffusionSection(_Strict):
    block_length: int = Field(32, ge=2, le=512)


class PabdmSection(_Strict):
    block_length: int = Field(32, ge=2, le=512)
    tau: float = Field(0.9, gt=0.0, le=1.0)  # supervise up to the first target with P(gold) < tau


class OptimSection(_Strict):
    lr: float = Field(2e-5, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    warmup_steps: int = Field(500, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # floor of the linear/cosine decay
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping


class TrainSection(_Strict):
    """How long and in what batches; set exactly one of ``steps`` and ``epochs``."""

    steps: int | None = Field(None, ge=1)  # optimizer steps of the whole run ...
    epochs: float | None = Field(None, gt=0)  # ... or passes over the broad pages (steps follow from the data)
    micro_batch_size: int = Field(8, ge=1)  # per process
    grad_accum: int = Field(1, ge=1)
    save_every: int | None = Field(None, ge=1)  # checkpoint period in steps (None: only at the end)
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = True  # continue from the newest checkpoint in output_dir if there is one
    threads: int | None = Field(None, ge=1)  # torch intra-op threads per process (None: cores / local procs)
    progress: bool = True
    # Recompute each decoder layer's activations in the backward pass instead of keeping them:
    # activation memory from O(layers) to O(1) layers, for about a third more compute.
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _one_length(self) -> TrainSection:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.steps or train.epochs")
        return self


class MlflowSection(_Strict):
    enabled: bool = True
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite under var/mlflow/
    experiment: str = "docmarkup-training"
    log_model: bool = True  # upload the final model folder as run artifacts


class TrainConfig(_Strict):
    name: str = Field(min_length=1)
    seed: int = 0
    output_dir: str
    deepspeed: str  # a DeepSpeed JSON file; "auto" values are filled from this config
    model: ModelSection
    data: DataSection
    objectives: dict[str, float]
    dar: DarSection = DarSection()
    darl: DarlSection = DarlSection()
    block_diffusion: BlockDiffusionSection = BlockDiffusionSection()
    pabdm: PabdmSection = PabdmSection()
    optim: OptimSection = OptimSection()
    train: TrainSection
    mlflow: MlflowSection = MlflowSection()

    @field_validator("objectives")
    @classmethod
    def _known_objectives(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(OBJECTIVES))
        if unknown:
            known = ", ".join(f"{k} ({v})" for k, v in OBJECTIVES.items())
            raise ValueError(f"unknown objective(s) {unknown}; known: {known}")
        negative = sorted(k for k, v in mix.items() if v < 0)
        if negative:
            raise ValueError(f"objective weights must be >= 0, got negative weights for {negative}")
        if not any(v > 0 for v in mix.values()):
            raise ValueError("at least one objective needs a positive weight")
        return mix

    @model_validator(mode="after")
    def _compatible(self) -> TrainConfig:
        active = self.active_objectives
        if "dar" in active and "darl" in active:
            raise ValueError("objectives 'dar' and 'darl' cannot be combined: 'darl' already trains the DAR loss "
                             "(on its greedy OMTG candidate); drop 'dar'")
        longest_block = max(self.block_diffusion.block_length if "block_diffusion" in active else 0,
                            self.pabdm.block_length if "pabdm_csl" in active else 0)
        if longest_block > self.data.max_tokens:
            raise ValueError(f"block length {longest_block} exceeds data.max_tokens {self.data.max_tokens}")
        return self

    def with_feasible_warmup(self) -> TrainConfig:
        """A decaying schedule needs steps after its warmup (checked again once epochs become steps).

        A run shorter than its warmup is a smoke run (``--set train.steps=3`` on a shipped recipe):
        it warms up for half its steps instead, and says so.
        """
        steps = self.train.steps
        if steps is not None and self.optim.schedule != "constant" and self.optim.warmup_steps >= steps:
            warnings.warn(f"optim.warmup_steps ({self.optim.warmup_steps}) >= train.steps ({steps}): warming up "
                          f"for {steps // 2} steps so the {self.optim.schedule!r} schedule still decays", stacklevel=3)
            return self.model_copy(update={"optim": self.optim.model_copy(update={"warmup_steps": steps // 2})})
        return self

    def with_steps_for(self, n_examples: int, global_batch: int) -> TrainConfig:
        """The config with ``train.epochs`` turned into optimizer steps over ``n_examples`` broad
        pages taken ``global_batch`` per step (unchanged when ``train.steps`` is set)."""
        if self.train.steps is not None:
            return self
        steps = max(1, math.ceil(self.train.epochs * n_examples / global_batch))
        resolved = self.model_copy(update={"train": self.train.model_copy(update={"steps": steps})})
        return resolved.with_feasible_warmup()

    @property
    def active_objectives(self) -> dict[str, float]:
        return {k: v for k, v in self.objectives.items() if v > 0}

    def path(self, value: str) -> Path:
        """A config path resolved against the project root."""
        return resolve_path(value)

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, for MLflow params."""
        return flatten(self.model_dump(mode="json"))


def resolve_path(value: str | Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else PROJECT_ROOT / path


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def apply_overrides(raw: dict[str, Any], overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a raw config tree."""
    if not overrides:
        return raw
    items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
    tree = json.loads(json.dumps(raw))
    for dotted, value in items:
        node = tree
        keys = dotted.split(".")
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise TrainConfigError(f"override {dotted!r}: {key!r} is not a section")
            node = child
        node[keys[-1]] = value
    return tree


def _split_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise TrainConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def parse_train_config(raw: dict[str, Any], source: str = "<dict>", check_paths: bool = True) -> TrainConfig:
    """Validate a raw config tree; all problems are reported together with dotted key paths.
    ``check_paths=False`` skips ``model.init_from`` (a pipeline validates stages before the
    earlier stages have written the folders later ones start from)."""
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "config"
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            problems.append(f"  {where}: {message}")
        raise TrainConfigError(f"invalid training config {source}:\n" + "\n".join(problems)) from None
    deepspeed_file = config.path(config.deepspeed)
    if not deepspeed_file.is_file():
        raise TrainConfigError(f"invalid training config {source}: deepspeed file {deepspeed_file} does not exist")
    if check_paths and config.model.init_from is not None and not (config.path(config.model.init_from) / "config.json").is_file():
        raise TrainConfigError(
            f"invalid training config {source}: model.init_from {config.path(config.model.init_from)} is not a model "
            "folder (no config.json); train the previous stage first or point it at a saved model"
        )
    return config.with_feasible_warmup()


def load_train_config(
    path: str | Path, overrides: list[str] | dict[str, Any] | None = None, check_paths: bool = True
) -> TrainConfig:
    path = resolve_path(path)
    if not path.is_file():
        raise TrainConfigError(f"training config {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise TrainConfigError(f"training config {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise TrainConfigError(f"training config {path} must be a mapping at the top level")
    return parse_train_config(apply_overrides(raw, overrides), source=str(path), check_paths=check_paths)
