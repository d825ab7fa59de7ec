"""Write a runnable Triton model repository for one model URI.

The committed repository (``deploy/triton/model_repository``) is the template: two models,
``docmarkup`` (one response per request) and ``docmarkup_stream`` (decoupled, one response per
commit), sharing ``deploy/triton/backend.py``. A deployment copies it under ``var/`` and sets
the config parameters that say where the weights come from, so the template never changes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from components.decoding.fixed_step import STEP_SWITCHES

TEMPLATE_REPOSITORY = Path(__file__).resolve().parent / "model_repository"
MODEL_NAME = "docmarkup"
STREAM_MODEL_NAME = "docmarkup_stream"
MODEL_NAMES = (MODEL_NAME, STREAM_MODEL_NAME)
DECODERS = ("ar", "sdb", "block", "ppc")
PARSE_MODES = ("auto", "page", "elements")  # auto: as the model was trained (components.parsing.resolve_parse)
BATCHING_MODES = ("continuous", "closed")  # deploy/triton/backend.py: an engine loop, or each execute's batch
LAYOUTS = ("rapid-layout",)  # layouts a server can run on a bare page (ground truth needs the page record)

_PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"(?P<key>[^"]+)"\s*value:\s*\{\s*string_value:\s*"(?:[^"\\]|\\.)*"\s*\}\s*\}')
_INSTANCE_GROUP = re.compile(r"instance_group\s*\[\s*\{\s*kind:\s*KIND_CPU\s+count:\s*\d+\s*\}\s*\]")
_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


def instance_group(device: str, count: int) -> str:
    """Triton's instance group for ``device``: ``cpu``, or ``cuda`` / ``cuda:N`` (GPU N, default 0);
    each instance loads its own engine (the backend puts it on the instance's GPU)."""
    if device == "cpu":
        return f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]"
    match = _CUDA_DEVICE.fullmatch(device)
    if match is None:
        raise ValueError(f"device {device!r} is not cpu, cuda or cuda:N")
    return f"instance_group [ {{ kind: KIND_GPU count: {count} gpus: [ {int(match.group(1) or 0)} ] }} ]"
_MAX_BATCH_SIZE = re.compile(r"^max_batch_size:\s*\d+", re.MULTILINE)
_DYNAMIC_BATCHING = re.compile(r"^dynamic_batching\s*\{(?:[^{}]|\{[^{}]*\})*\}\n?", re.MULTILINE)
_MAX_QUEUE_SIZE = re.compile(r"max_queue_size:\s*\d+")


def instance_device(configured: str | None, args: dict) -> str:
    """The torch device of this model instance: a ``KIND_GPU`` instance runs on the GPU Triton gave
    it (``model_instance_device_id``), whatever index the configured ``cuda:N`` named."""
    configured = configured or "cpu"
    if configured.startswith("cuda") and args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id') or 0)}"
    return configured


def _pbtxt_string(value: str) -> str:
    # JSON string escaping is a subset of protobuf text-format escaping.
    return json.dumps(value, ensure_ascii=False)


def set_parameters(config_text: str, parameters: Mapping[str, str]) -> str:
    """``config.pbtxt`` text with each string parameter replaced, or appended if it was absent."""
    remaining = dict(parameters)

    def replace(match: re.Match[str]) -> str:
        key = match.group("key")
        if key not in remaining:
            return match.group(0)
        return f'parameters {{ key: "{key}" value: {{ string_value: {_pbtxt_string(str(remaining.pop(key)))} }} }}'

    text = _PARAMETER.sub(replace, config_text)
    for key, value in remaining.items():
        text = text.rstrip("\n") + f'\nparameters {{ key: "{key}" value: {{ string_value: {_pbtxt_string(str(value))} }} }}\n'
    return text


def set_max_batch_size(config_text: str, max_batch_size: int) -> str:
    """``config.pbtxt`` text batching up to ``max_batch_size`` requests; 0 also drops the dynamic
    batcher, which Triton only accepts on a batching model."""
    text, count = _MAX_BATCH_SIZE.subn(f"max_batch_size: {max_batch_size}", config_text)
    if count != 1:
        raise RuntimeError("config has no max_batch_size line to set")
    return _DYNAMIC_BATCHING.sub("", text) if max_batch_size == 0 else text


def set_max_queue_size(config_text: str, max_queue_size: int) -> str:
    """``config.pbtxt`` text whose dynamic batcher keeps at most ``max_queue_size`` requests waiting
    (0: unbounded) and refuses the next one at once; a config without a batcher is left as it is."""
    if not _DYNAMIC_BATCHING.search(config_text):
        return config_text
    text, count = _MAX_QUEUE_SIZE.subn(f"max_queue_size: {max_queue_size}", config_text)
    if count != 1:
        raise RuntimeError("config's dynamic batcher has no max_queue_size to set")
    return text


def read_parameters(config_text: str) -> dict[str, str]:
    """The string parameters of a ``config.pbtxt`` (what the backend will see)."""
    found = {}
    for match in re.finditer(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*("(?:[^"\\]|\\.)*")', config_text):
        found[match.group(1)] = json.loads(match.group(2))
    return found


def materialize_repository(
    model_uri: str | Path,
    destination: str | Path,
    *,
    tracking_uri: str | None = None,
    device: str = "cpu",
    default_decoder: str = "ar",
    default_parse: str = "auto",
    layout: str = "rapid-layout",
    max_new_tokens_limit: int = 2048,
    instance_count: int = 1,
    max_batch_size: int = 8,
    max_queue_size: int = 32,
    batching: str = "continuous",
    overlap_prefill: bool = True,
    torch_threads: int = 1,
    engine_step: str = "default",
    model_cache_dir: str | Path | None = None,
    request_log_dir: str | Path | None = None,
    request_log_max_image_mb: float = 1024.0,
    request_log_retention_days: float = 30.0,
    probe_key_file: str | Path | None = None,
) -> Path:
    """Copy the template repository to ``destination`` with the model source filled in.

    ``model_uri`` is an MLflow URI (``models:/docmarkup@champion``) or a local model folder
    (made absolute, since the server's working directory may differ). ``max_batch_size`` caps
    how many concurrent requests either model decodes together (0: no batching);
    ``max_queue_size`` how many more may wait before the next is refused (0: unbounded): Triton's
    queue in front of ``execute`` and, under ``batching="continuous"`` (the engine loop every
    request joins; ``"closed"``: each execute's requests together), the pages waiting for a row;
    ``overlap_prefill``: continuous batching prefills new pages on a thread beside the engine loop.
    ``probe_key_file``: the 0600 file holding the deployment's probe key (requests that carry it are
    the platform's own and leave no record; without it every ``PROBE`` is refused).
    Returns ``destination``.
    """
    if default_decoder not in DECODERS:
        raise ValueError(f"default_decoder {default_decoder!r} is not one of {DECODERS}")
    if default_parse not in PARSE_MODES:
        raise ValueError(f"default_parse {default_parse!r} is not one of {PARSE_MODES}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if instance_count < 1:
        raise ValueError("instance_count must be at least 1")
    instance_group(device, instance_count)  # refuses an unknown device before anything is written
    if max_batch_size < 0:
        raise ValueError("max_batch_size must be >= 0 (0 = no batching)")
    if max_queue_size < 0:
        raise ValueError("max_queue_size must be >= 0 (0 = unbounded)")
    if batching not in BATCHING_MODES:
        raise ValueError(f"batching {batching!r} is not one of {BATCHING_MODES}")
    if torch_threads < 0:
        raise ValueError("torch_threads must be >= 0 (0 = torch default)")
    if engine_step not in STEP_SWITCHES:
        raise ValueError(f"engine_step {engine_step!r} is not one of {sorted(STEP_SWITCHES)}")
    if engine_step.startswith("cuda_graphs") and device == "cpu":
        raise ValueError("engine_step cuda_graphs needs device cuda or cuda:N")
    uri = str(model_uri)
    if "://" not in uri and not uri.startswith(("models:/", "runs:/")):
        folder = Path(uri).expanduser().resolve()
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} is not a model folder (no config.json)")
        uri = str(folder)
    destination = Path(destination)
    staging = destination.with_name(f".{destination.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(TEMPLATE_REPOSITORY, staging, ignore=shutil.ignore_patterns("__pycache__"))
    parameters = {
        "model_uri": uri,
        "mlflow_tracking_uri": tracking_uri or "",
        "device": device,
        "default_decoder": default_decoder,
        "default_parse": default_parse,
        "layout": layout,
        "max_new_tokens_limit": str(max_new_tokens_limit),
        "torch_threads": str(torch_threads),
        "batching": batching,
        "overlap_prefill": "true" if overlap_prefill else "false",
        "max_waiting": str(max_queue_size),
        "engine_step": engine_step,
        "model_cache_dir": str(Path(model_cache_dir).resolve()) if model_cache_dir else "",
        "request_log_dir": str(Path(request_log_dir).resolve()) if request_log_dir else "",
        "request_log_max_image_mb": str(request_log_max_image_mb),
        "request_log_retention_days": str(request_log_retention_days),
        "probe_key_file": str(Path(probe_key_file).resolve()) if probe_key_file else "",
    }
    for model in MODEL_NAMES:
        config = staging / model / "config.pbtxt"
        text = set_parameters(config.read_text(), parameters)
        text, count = _INSTANCE_GROUP.subn(instance_group(device, instance_count), text)
        if count != 1:
            raise RuntimeError(f"template {config} has no KIND_CPU instance_group to replace")
        config.write_text(set_max_batch_size(set_max_queue_size(text, max_queue_size), max_batch_size))
    # Swap in the new repository whole, so a server never reads a half-written one.
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)
    return destination
