"""Two-stage parsing: layout, then every element of a page recognised from its native-resolution
crop, the elements of all pages in one engine batch, assembled into page markup.

This is how MinerU2.5 and PaddleOCR-VL read pages, and how an element model trained with
``data.unit: element`` is used everywhere (evaluation, benchmarks, pre-annotation, Triton).
Failures stay local: a region outside the image or blank is skipped with its reason, an element
whose decode fails is reported with its error while the rest of the page comes back, and a page
where layout finds nothing returns an empty parse that says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from components.data.markup import render_block
from components.data.pages import Page
from components.decoding.engine import engine_capabilities
from components.decoding.types import DecodeParams, DecodeResult, DecodeStats
from components.parsing.assembly import assemble, element_markup, order_elements, recognition_category
from components.parsing.crops import DEFAULT_CROP, CropSettings, crop_region
from components.parsing.frontend import FrontEndPage, ModelLines, shared_front_end
from components.parsing.layout import LAYOUTS, Layout, make_layout
from components.parsing.layout.region import Box
from components.parsing.pieces import generate_in_pieces, joiner, merge_results
from components.parsing.prompts import prompt_style_of, task_prompt

logger = logging.getLogger(__name__)

PARSE_MODES = ("page", "elements")
NO_REGIONS = "layout found no regions"
NO_LINES = "no text line found on the page"
LAYOUT_ONLY = "layout-only category"


def reads_detected_lines(engine, layout: Layout) -> bool:
    """Whether pages go through the page front end with the model reading its lines: a model that
    says it reads single text lines (the reader), under a detected layout. Under the ground-truth
    layout (oracle evaluation) every true element's crop is read instead."""
    return engine_capabilities(engine).reads_text_lines and layout.name != "ground-truth"


def trained_parse_mode(model_dir: str | Path) -> str:
    """How a model folder reads pages: "elements" when its training (``training_meta.json`` /
    ``pretrain.json`` ``unit``) was on element crops, else "page"."""
    for name in ("training_meta.json", "pretrain.json"):
        meta_file = Path(model_dir) / name
        if meta_file.is_file():
            unit = json.loads(meta_file.read_text()).get("unit", "page")
            return "elements" if unit in ("element", "elements") else "page"
    return "page"


def resolve_parse(mode: str, model_dir: str | Path) -> str:
    """``auto`` becomes the mode the model was trained in; "page" and "elements" stay as they are."""
    return trained_parse_mode(model_dir) if mode == "auto" else mode


@dataclass(frozen=True)
class ParseSettings:
    """How a model reads pages: whole (``page``) or layout + element crops (``elements``)."""

    mode: str = "page"
    layout: str = "rapid-layout"  # components.parsing.layout.LAYOUTS
    prompt_style: str | None = None  # None: the model family's own task prompts

    def __post_init__(self) -> None:
        if self.mode not in PARSE_MODES:
            raise ValueError(f"parse must be one of {PARSE_MODES}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def elements(self) -> bool:
        return self.mode == "elements"


@dataclass
class ParsedElement:
    category: str  # the layout's category
    box: Box
    markup: str = ""
    confidence: float = 0.0
    stats: DecodeStats | None = None
    skipped: str | None = None  # why it was not decoded (layout-only, outside, degenerate, blank)
    error: str | None = None  # its decode failed (the rest of the page is unaffected)
    truncated: bool = False
    token_ids: list[int] = field(default_factory=list, repr=False)
    confidences: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        return {"category": self.category, "box": [round(v, 1) for v in self.box], "markup": self.markup,
                "confidence": round(self.confidence, 4), "skipped": self.skipped, "error": self.error,
                "truncated": self.truncated, **({"stats": self.stats.as_dict()} if self.stats else {})}


@dataclass
class PageParse:
    width: int
    height: int
    elements: list[ParsedElement] = field(default_factory=list)  # in reading order
    reason: str | None = None  # set when nothing could be read
    # The page carries ink a person reads but (nearly) nothing was read: why (confidence 0).
    empty_page_reason: str | None = None

    @property
    def markup(self) -> str:
        return assemble([e.markup for e in self.elements])

    @property
    def decoded(self) -> list[ParsedElement]:
        return [e for e in self.elements if e.stats is not None]

    @property
    def stats(self) -> DecodeStats:
        """The page's elements pooled (forwards and tokens add up; seconds is the batch's wall time)."""
        return DecodeStats.merge((element.stats for element in self.decoded), concurrent=True)

    @property
    def confidence(self) -> float:
        """Token-weighted mean confidence of the decoded elements (0 when none was decoded, and
        when a page with ink was read as empty)."""
        return 0.0 if self.empty_page_reason else self.stats.mean_confidence

    @property
    def truncated(self) -> bool:
        return any(e.truncated for e in self.elements)

    def as_dict(self) -> dict:
        return {"width": self.width, "height": self.height, "reason": self.reason, "markup": self.markup,
                "elements": [e.as_dict() for e in self.elements]}


def parse_pages(
    images: list[Image.Image], engine, layout: Layout, params: DecodeParams | None = None,
    pages: list[Page | None] | None = None, crop: CropSettings = DEFAULT_CROP, prompt_style: str | None = None,
) -> list[PageParse]:
    """Parse pages: layout per page, then every element of every page as one engine batch."""
    params = params or DecodeParams()
    pages = pages or [None] * len(images)
    if reads_detected_lines(engine, layout):
        source = ModelLines(engine, params)
        return [front_end_parse(shared_front_end().read(image, source)) for image in images]
    capabilities = engine_capabilities(engine)
    style = prompt_style_of(capabilities, prompt_style)
    writes_markup = capabilities.writes_markup
    parses: list[PageParse] = []
    jobs: list[tuple[ParsedElement, Image.Image, str | None]] = []
    for image, page in zip(images, pages, strict=True):
        regions = layout.detect(image, page)
        parse = PageParse(image.width, image.height)
        parses.append(parse)
        if not regions:
            parse.reason = NO_REGIONS
            continue
        ordered = order_elements(regions, image.width, detected=layout.name != "ground-truth")
        for region in ordered:
            parse.elements.append(element := ParsedElement(region.category, region.box))
            read_as = recognition_category(region.category)
            if read_as is None:
                element.skipped = LAYOUT_ONLY
                continue
            cropped = crop_region(image, region.box, crop)
            element.box = cropped.box
            if cropped.skipped:
                element.skipped = cropped.skipped
                continue
            jobs.append((element, cropped.image, task_prompt(style, read_as) if style != "none" else None))
        if parse.elements and not any(e.skipped is None for e in parse.elements):
            parse.reason = "no region holds anything to read"
    if jobs:
        for (element, _, _), outcome in zip(jobs, _decode(engine, jobs, params, style), strict=True):
            if isinstance(outcome, Exception):
                element.error = f"{type(outcome).__name__}: {outcome}"
                continue
            element.markup = element_markup(recognition_category(element.category) or "text", outcome.text,
                                            native=style != "none" or not writes_markup)
            element.stats, element.truncated = outcome.stats, outcome.truncated
            element.token_ids, element.confidences = outcome.token_ids, outcome.confidences
            element.confidence = outcome.stats.mean_confidence
    return parses


def front_end_parse(page: FrontEndPage) -> PageParse:
    """The front end's blocks as a page parse: each block one element, its decode the merged decodes
    of the lines it holds (furniture and figures layout-only, as in region parsing)."""
    parse = PageParse(page.width, page.height)
    for block in page.blocks:
        parse.elements.append(element := ParsedElement(block.category, block.box))
        if recognition_category(block.category) is None:
            element.skipped = LAYOUT_ONLY
            continue
        element.markup = render_block(block.category, block.content or "")
        decoded = [piece.decoded for line in block.lines for piece in line.pieces if piece.decoded is not None]
        if decoded:
            result = merge_results(decoded, joiner(block.category))
            element.stats, element.truncated = result.stats, result.truncated
            element.token_ids, element.confidences = result.token_ids, result.confidences
            element.confidence = result.stats.mean_confidence
    if not page.blocks:
        parse.reason = NO_LINES
    if page.empty_reason:
        parse.reason = parse.empty_page_reason = page.empty_reason
    return parse


def parse(image: Image.Image, engine, layout: Layout, params: DecodeParams | None = None, page: Page | None = None,
          **options) -> PageParse:
    """One page (see :func:`parse_pages`)."""
    return parse_pages([image], engine, layout, params, [page], **options)[0]


def _decode(engine, jobs, params: DecodeParams, style: str) -> list[DecodeResult | Exception]:
    """All crops in one batch (each as its model's reading pieces); if the batch fails, each crop
    alone, so one bad element is reported on its own and the others still come back."""
    crops = [image for _, image, _ in jobs]
    prompts = [prompt for _, _, prompt in jobs] if style != "none" else None
    categories = [recognition_category(element.category) for element, _, _ in jobs]
    try:
        return generate_in_pieces(engine, crops, params, prompts, categories)
    except Exception as batch_error:
        logger.warning("element batch failed (%s); decoding its %d elements one by one", batch_error, len(crops))
    outcomes: list[DecodeResult | Exception] = []
    for i, crop in enumerate(crops):
        try:
            [result] = generate_in_pieces(engine, [crop], params, [prompts[i]] if prompts else None, [categories[i]])
            outcomes.append(result)
        except Exception as error:
            outcomes.append(error)
    return outcomes


def parse_result(parse: PageParse) -> DecodeResult:
    """A page's parse as one :class:`DecodeResult` (markup, pooled stats, the elements' tokens in
    reading order), so scoring, speed accounting and serving treat both parse modes alike; the
    elements ride along in ``parse``."""
    decoded = parse.decoded
    return DecodeResult(token_ids=[t for e in decoded for t in e.token_ids], text=parse.markup, stats=parse.stats,
                        confidences=[c for e in decoded for c in e.confidences], finished=not parse.truncated,
                        truncated=parse.truncated, parse=parse)


def read_pages(engine, images: list[Image.Image], params: DecodeParams, settings: ParseSettings | None = None,
               pages: list[Page | None] | None = None, layout: Layout | None = None) -> list[DecodeResult]:
    """Decode pages the way ``settings`` says: one engine call per batch of pages, or a two-stage
    parse whose elements (of every page) form one engine batch."""
    if settings is None or not settings.elements:
        return engine.generate(images, params)
    layout = layout or make_layout(settings.layout)
    parses = parse_pages(images, engine, layout, params, pages, prompt_style=settings.prompt_style)
    return [parse_result(p) for p in parses]
