"""The one prepared device check: engine, shipped model, Triton and training on a lent GPU, in one run.

    python -m benchmarks.gpu_check                 # on the device: ~8 minutes on one H100/H200, writes under $OUT
    python -m benchmarks.gpu_check --smoke         # the same parts at toy sizes on the CPU (the test suite)
    python -m benchmarks.gpu_check --parts shipped,triton --out DIR

Parts, each run in turn with its own share of ``--budget-s``; one that fails is recorded with its
error and the others still run, so a short device slot always brings back what it could measure:

- ``decoding`` (:mod:`benchmarks.gpu_decoding`): the ~1B random Qwen2.5-VL in bf16: engine AR against
  the checkpoint's own ``generate()`` token for token and in tokens/s, SDB at w = 4/16/32 (seconds per
  forward at Q = 1/5/17/33), host syncs per step, peak memory;
- ``shipped``: the shipped models (the base on synthetic pages, the reader on real element crops): SDB = AR
  token for token, batch 8 = batch 1, AR/SDB/PPC/block
  tokens/s and tokens per forward; the engine's GPU switches (CUDA graphs, ``torch.compile`` of the
  fixed-shape step) token for token against the default step, and their tokens/s;
- ``triton``: Triton with ``device: cuda`` (``KIND_GPU`` instances) serving the shipped base, unary and
  streaming requests through ``tritonclient``: latency and its overhead over the bare engine on the
  same pages;
- ``training`` (:mod:`benchmarks.gpu_training`): DeepSpeed steps of the ~0.5B model (step time, peak
  memory).

Writes ``gpu_check.json`` (every part's report, errors and seconds) and ``gpu_check.md`` (one table)
under ``--out`` (default ``$OUT``, else ``var/bench/gpu_check``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from components.data.page_store import PageDataset
from components.data.synthetic import generate_page
from components.decoding.engine import DecodingEngine
from components.decoding.types import DecodeParams
from components.evaluation.element_reading import store_elements
from deploy.triton.client import DocMarkupClient, encode_image
from deploy.triton.server import TritonPorts, start_triton
from models.loading import model_family

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "models" / "pretrained" / "docmarkup-base", ROOT / "models" / "pretrained" / "docmarkup-reader"]
READER_CROPS = ROOT / "tests" / "fixtures" / "corpus_pages"  # real pages whose element crops the reader reads
PARTS = ("decoding", "shipped", "triton", "training")
PAGE_SEED = 94_000_000


def _pages(count: int):
    return [generate_page(PAGE_SEED + i)[1] for i in range(count)]


def _element_crops(count: int):
    """The first ``count`` text-like element crops of the shipped real pages (the reader's input)."""

    return [crop for *_, crop in store_elements(PageDataset(READER_CROPS), ("text", "title", "code"), count)]


def _timed_one_by_one(engine, images: list, params, device: str) -> tuple[list, float]:
    """Each image decoded alone (batch 1) after one warm-up decode (kernels, capture, compile), and
    the seconds all of them took, the device synchronised at both ends."""
    engine.generate(images[:1], params)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = [engine.generate([image], params)[0] for image in images]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return results, time.perf_counter() - started


def shipped_part(device: str, pages: int, max_new_tokens: int, out: Path) -> dict:
    """Each shipped model on ``device``: exactness (SDB = AR, batch 8 = batch 1) and decoder speed."""

    report = {}
    for folder in SHIPPED:
        if not (folder / "config.json").is_file():
            continue
        reader = model_family(folder) == "docmarkup_reader"
        images = _element_crops(pages) if reader else _pages(pages)
        engine = DecodingEngine.from_pretrained(folder, device=device)
        rows = {}
        reference = None
        for decoder in ("ar", "sdb", "ppc", "block"):
            params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)
            single, seconds = _timed_one_by_one(engine, images, params, device)
            tokens = sum(r.stats.new_tokens for r in single)
            forwards = sum(r.stats.forward_passes for r in single)
            batched = engine.generate(images[:8], params)
            rows[decoder] = {
                "tokens_per_second": tokens / seconds, "tokens_per_forward": tokens / max(1, forwards),
                "batch8_equals_batch1": all(b.token_ids == s.token_ids for b, s in zip(batched, single, strict=False)),
            }
            if decoder == "ar":
                reference = [r.token_ids for r in single]
            elif decoder == "sdb":
                rows[decoder]["equals_ar"] = [r.token_ids for r in single] == reference
        rows["switches"] = _switch_rows(folder, device, images, max_new_tokens, reference)
        report[folder.name] = rows
    return report


def _switch_rows(folder: Path, device: str, images: list, max_new_tokens: int, reference: list) -> dict:
    """The engine's GPU switches on the same images, batch 1: CUDA graphs and torch.compile on CUDA
    (the fixed-shape step alone on the CPU, where graphs do not exist): AR token for token against
    the default step, and tokens/s."""

    switches = ({"cuda_graphs": {"cuda_graphs": True}, "compiled": {"compile_step": True}}
                if device.startswith("cuda") else {"fixed_shapes": {"fixed_shapes": True}})
    rows = {}
    for name, flags in switches.items():
        try:
            engine = DecodingEngine.from_pretrained(folder, device=device, **flags)
            for decoder in ("ar", "sdb"):
                params = DecodeParams(decoder=decoder, max_new_tokens=max_new_tokens)
                results, seconds = _timed_one_by_one(engine, images, params, device)
                rows[f"{name}.{decoder}"] = {
                    "tokens_per_second": sum(r.stats.new_tokens for r in results) / seconds,
                    "equals_default_ar": [r.token_ids for r in results] == reference,
                    "captures": getattr(engine._fixed_step, "captures", 0)}
        except Exception as error:  # a switch that fails on this device is reported, the rest still run
            rows[name] = {"error": f"{type(error).__name__}: {error}"}
    return rows


def triton_part(device: str, pages: int, max_new_tokens: int, out: Path) -> dict:
    """Triton serving the shipped base on ``device``: unary and streamed latency against the bare engine."""

    images = _pages(pages)
    encoded = [encode_image(image) for image in images]
    engine = DecodingEngine.from_pretrained(SHIPPED[0], device=device)
    params = DecodeParams(decoder="sdb", max_new_tokens=max_new_tokens)
    engine.generate(images[:1], params)
    bare = []
    for image in images:
        started = time.perf_counter()
        engine.generate([image], params)
        bare.append(time.perf_counter() - started)
    del engine
    server = start_triton(str(SHIPPED[0]), ports=TritonPorts.free(), name="triton-gpu-check", device=device,
                          repository_dir=out / "triton" / "model_repository", request_log_dir=out / "triton" / "requests")
    try:
        client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=300)
        client.transcribe(encoded[0], decoder="sdb", max_new_tokens=max_new_tokens)  # warm-up
        unary, streamed, same = [], [], 0
        for page in encoded:
            started = time.perf_counter()
            answer = client.transcribe(page, decoder="sdb", max_new_tokens=max_new_tokens)
            unary.append(time.perf_counter() - started)
            started = time.perf_counter()
            with client.stream_transcribe(page, decoder="sdb", max_new_tokens=max_new_tokens) as stream:
                text = "".join(chunk.text for chunk in stream)
            streamed.append(time.perf_counter() - started)
            same += text == answer.text
    finally:
        server.stop()
    bare_s, unary_s, stream_s = statistics.median(bare), statistics.median(unary), statistics.median(streamed)
    return {"bare_engine_s": bare_s, "unary_s": unary_s, "streamed_s": stream_s,
            "unary_overhead": unary_s / bare_s - 1, "stream_equals_unary": same, "pages": pages,
            "startup_s": server.startup_seconds}


def _module_part(module: str, argv: list[str], report_name: str, out: Path) -> dict:
    importlib.import_module(module).main([*argv, "--out", str(out)])
    return json.loads((out / report_name).read_text())


def run_parts(parts: list[str], *, smoke: bool, device: str, out: Path, budget_s: float) -> dict:
    deadline = time.monotonic() + budget_s
    results: dict = {"device": device, "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                     "smoke": smoke, "parts": {}}
    plans = {
        "decoding": lambda: _module_part("benchmarks.gpu_decoding", [
            "--device", device, *(["--size", "tiny", "--pages", "1", "--max-new-tokens", "6", "--repeats", "1",
                                   "--windows", "4"] if smoke else [])], "gpu_decoding.json", out / "decoding"),
        "shipped": lambda: shipped_part(device, 2 if smoke else 8, 8 if smoke else 128, out),
        "triton": lambda: triton_part(device, 1 if smoke else 8, 8 if smoke else 128, out),
        "training": lambda: _module_part("benchmarks.gpu_training", [
            "--size", "tiny", "--steps", "2", "--pages", "4", "--max-tokens", "96", "--deepspeed",
            "configs/deepspeed/zero2.json"] if smoke else ["--steps", "30"], "gpu_training.json", out / "training"),
    }
    for part in parts:
        if time.monotonic() > deadline:
            results["parts"][part] = {"skipped": "the time budget was spent"}
            continue
        started = time.perf_counter()
        try:
            results["parts"][part] = {"report": plans[part](), "seconds": time.perf_counter() - started}
        except Exception as exc:  # one failing part must not cost the others their device time
            results["parts"][part] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:],
                                      "seconds": time.perf_counter() - started}
        print(f"[gpu_check] {part}: {'error' if 'error' in results['parts'][part] else 'done'} "
              f"in {results['parts'][part]['seconds']:.0f} s", flush=True)
    return results


def table(results: dict) -> str:
    lines = [f"GPU check on {results['device_name']} ({'smoke' if results['smoke'] else 'full'})", "",
             "| part | result | seconds |", "| --- | --- | --- |"]
    for part, outcome in results["parts"].items():
        if "error" in outcome or "skipped" in outcome:
            lines.append(f"| {part} | {outcome.get('error') or outcome['skipped']} | {outcome.get('seconds', 0):.0f} |")
            continue
        report = outcome["report"]
        if part == "shipped":
            cells = "; ".join(f"{model}: " + ", ".join(
                f"{d} {r['tokens_per_second']:.0f} tok/s TPF {r['tokens_per_forward']:.2f}"
                + (" =AR" if r.get("equals_ar") else " ≠AR" if "equals_ar" in r else "")
                + ("" if r["batch8_equals_batch1"] else " b8≠b1") for d, r in rows.items() if d != "switches")
                + "; " + ", ".join(r["error"][:80] if "error" in r else
                                   f"{name} {r['tokens_per_second']:.0f} tok/s{' =AR' if r['equals_default_ar'] else ' ≠AR'}"
                                   for name, r in rows.get("switches", {}).items())
                for model, rows in report.items())
        elif part == "triton":
            cells = (f"unary {report['unary_s'] * 1000:.0f} ms vs engine {report['bare_engine_s'] * 1000:.0f} ms "
                     f"(overhead {report['unary_overhead']:+.0%}), stream {report['streamed_s'] * 1000:.0f} ms")
        elif part == "decoding":
            contenders = report.get("contenders", {})
            cells = ", ".join(f"{name} {row['tokens_per_second']:.0f} tok/s ({row.get('vs_generate', 1.0):.2f}× generate)"
                              for name, row in contenders.items()) \
                + f"; generate = AR on {report.get('generate_equals_ar_pages')}/{report.get('compared_pages')} pages; " \
                f"syncs/step {report.get('host_syncs_per_step')}"
        else:
            cells = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()
                              if not isinstance(v, (dict, list)))[:300]
        lines.append(f"| {part} | {cells} | {outcome['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (what the test suite runs)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--device", default=None, help="default: cuda when a GPU is visible, else cpu")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting parts after this long")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else
                        ROOT / "var" / "bench" / "gpu_check")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_parts(parts, smoke=args.smoke, device=device, out=args.out, budget_s=args.budget_s)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    rendered = table(results)
    (args.out / "gpu_check.md").write_text(rendered + "\n")
    print(rendered)
    return 0 if all("error" not in outcome for outcome in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
