"""Serving benchmark: a real Triton server, the same pages sent one after another and all at once.

    .venv/bin/python -m benchmarks.serving [--model DIR] [--pages 16] [--max-batch-size 8]

Starts Triton on free 127.0.0.1 ports over a local model folder (or an MLflow URI), sends the
held-out pages through ``DocMarkupClient`` sequentially (never batched) and then concurrently
(Triton's dynamic batcher groups them), and prints pages/s of both, their ratio, the batch sizes
the backend reported and whether every page came back with the same tokens. Stops the server by
PID at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.decoding import benchmark_pages, decoder_names, resolve_model, write_report
from components.services.process import VAR_DIR
from deploy.triton.client import DocMarkupClient, Transcription, encode_image
from deploy.triton.server import TritonPorts, start_triton


def send_pages(client: DocMarkupClient, pages: list[bytes], decoder: str, max_new_tokens: int,
               concurrency: int) -> tuple[float, list[Transcription]]:
    """Wall seconds and results of transcribing ``pages`` with ``concurrency`` requests in flight."""
    started = time.perf_counter()
    results = client.transcribe_many(pages, concurrency=concurrency, decoder=decoder, max_new_tokens=max_new_tokens)
    return time.perf_counter() - started, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder, or an MLflow URI like models:/docmarkup@champion")
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--decoders", default="ar,sdb")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "serving.json")
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model)
    dataset = benchmark_pages(args.pages)
    pages = [encode_image(dataset.load_image(page)) for page in dataset.pages()]
    name = "triton-bench"  # logs stay in var/services/triton-bench; a second run while one is up is refused
    server = start_triton(str(model_dir), ports=TritonPorts.free(), name=name, max_batch_size=args.max_batch_size,
                          repository_dir=VAR_DIR / "bench" / name / "model_repository",
                          request_log_dir=VAR_DIR / "bench" / name / "requests")
    report: dict = {"model": str(model_dir), "pages": len(pages), "max_batch_size": args.max_batch_size, "decoders": {}}
    try:
        client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=600)
        client.transcribe(pages[0], max_new_tokens=4)  # warm-up: first request pays lazy initialisation
        print(f"model: {model_dir}\nTriton up in {server.startup_seconds:.1f}s; {len(pages)} pages, "
              f"max_batch_size {args.max_batch_size}\n")
        print(f"{'decoder':8} {'mode':11} {'wall s':>7} {'pages/s':>8} {'x':>6} {'batch sizes':>14} {'same':>5}")
        for decoder in decoder_names(args.decoders):
            seq_wall, sequential = send_pages(client, pages, decoder, args.max_new_tokens, 1)
            con_wall, concurrent = send_pages(client, pages, decoder, args.max_new_tokens, len(pages))
            same = sum(a.token_ids == b.token_ids for a, b in zip(sequential, concurrent, strict=True)) / len(pages)
            sizes = sorted({r.stats["batch_size"] for r in concurrent})
            speedup = seq_wall / con_wall
            print(f"{decoder:8} {'sequential':11} {seq_wall:7.1f} {len(pages) / seq_wall:8.2f} {1.0:6.2f} {'1':>14}")
            print(f"{decoder:8} {'concurrent':11} {con_wall:7.1f} {len(pages) / con_wall:8.2f} {speedup:6.2f} "
                  f"{','.join(map(str, sizes)):>14} {same:5.0%}")
            report["decoders"][decoder] = {
                "sequential_seconds": seq_wall, "concurrent_seconds": con_wall, "throughput_ratio": speedup,
                "batch_sizes": sizes, "same_output_fraction": same,
            }
    finally:
        server.stop()
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
