"""Reading an element crop in pieces, for models that read long elements better that way.

A model may offer ``reading_pieces(crop) -> list[crop]`` (the reader cuts an element into runs of
whole lines no longer than the prefixes it was trained on). The pieces of every crop go to the
engine as one batch, and each crop's pieces come back as one :class:`DecodeResult`: texts joined
by the element's line joiner (a newline in code, a space in running text), tokens and
confidences concatenated, speed accounting added up. Models without the method read crops whole.
"""

from __future__ import annotations

from PIL import Image

from components.decoding.engine import engine_capabilities
from components.decoding.types import DecodeParams, DecodeResult, DecodeStats

JOINERS = {"code": "\n"}  # how a category's lines are joined in its text; a space otherwise


def joiner(category: str | None) -> str:
    return JOINERS.get(category or "", " ")


def generate_in_pieces(engine, crops: list[Image.Image], params: DecodeParams, prompts: list[str | None] | None = None,
                       categories: list[str | None] | None = None) -> list[DecodeResult]:
    """``engine.generate`` over crops, each read as its model's pieces and merged back in order."""
    in_pieces = engine_capabilities(engine).reads_in_pieces
    pieces = [engine.reading_pieces(crop) if in_pieces else [crop] for crop in crops]
    return generate_groups(engine, pieces, params, prompts, categories)


def generate_groups(engine, groups: list[list[Image.Image]], params: DecodeParams,
                    prompts: list[str | None] | None = None,
                    categories: list[str | None] | None = None) -> list[DecodeResult]:
    """Every group's images in one ``engine.generate`` batch, each group's results merged in order
    (a group: one element's pieces, or its text lines)."""
    flat = [piece for group in groups for piece in group]
    if not flat:
        results: list[DecodeResult] = []
    elif prompts is not None:
        flat_prompts = [prompt for prompt, group in zip(prompts, groups, strict=True) for _ in group]
        results = engine.generate(flat, params, prompts=flat_prompts)
    else:
        results = engine.generate(flat, params)
    categories = categories or [None] * len(groups)
    merged, start = [], 0
    for group, category in zip(groups, categories, strict=True):
        merged.append(merge_results(results[start: start + len(group)], joiner(category)))
        start += len(group)
    return merged


def merge_results(results: list[DecodeResult], join: str) -> DecodeResult:
    """One element's result from its pieces' (a single piece comes back unchanged)."""
    if len(results) == 1:
        return results[0]
    stats = DecodeStats.merge((result.stats for result in results), concurrent=True)  # the pieces decode in one batch
    # Lines keep their leading spaces where they are code (a piece's first line may be indented).
    texts = [r.text.strip("\n") if join == "\n" else r.text.strip() for r in results]
    return DecodeResult(
        token_ids=[t for r in results for t in r.token_ids],
        text=join.join(text for text in texts if text.strip()),
        stats=stats, confidences=[c for r in results for c in r.confidences],
        finished=all(r.finished for r in results), truncated=any(r.truncated for r in results),
    )
