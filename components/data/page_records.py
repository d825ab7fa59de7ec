"""A page as a row of the page store's Parquet shards: the Arrow schema (curation state promoted
to its own columns so that filtered scans read one small column), the filters scans take, and the
conversions both ways."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from components.data.pages import InvalidPageError, LayoutElement, Page

SCHEMA = pa.schema([
    ("page_id", pa.string()),
    ("ord", pa.int64()),  # order of first appearance: pages() lists pages in it
    ("image", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("source", pa.string()),
    ("elements", pa.string()),  # JSON list of {category, bbox, content}
    ("meta", pa.string()),  # JSON object
    ("markup_override", pa.string()),
    # Curation state promoted out of ``meta`` so that filtered scans read one small column.
    ("hard", pa.bool_()),
    ("consistency", pa.float64()),
    ("preannotated", pa.bool_()),
    ("confidence", pa.float64()),  # the pre-annotation's page confidence
])
RECORD_COLUMNS = ["page_id", "ord", "image", "width", "height", "source", "elements", "meta", "markup_override"]

# Filters for ``PageDataset.scan`` / ``PageDataset.iter_pages``.
HARD = pc.field("hard")
NOT_PREANNOTATED = ~pc.field("preannotated")
PREANNOTATED = pc.field("preannotated")


def page_columns(pages: list[Page], ords: list[int]) -> pa.Table:
    """Page records as one Arrow table in :data:`SCHEMA`."""
    metas = [page.meta for page in pages]
    preannotations = [meta.get("preannotation") if isinstance(meta.get("preannotation"), dict) else None
                      for meta in metas]

    def number(value) -> float | None:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    columns = {
        "page_id": [page.page_id for page in pages],
        "ord": ords,
        "image": [page.image for page in pages],
        "width": [page.width for page in pages],
        "height": [page.height for page in pages],
        "source": [page.source for page in pages],
        "elements": [json.dumps([{"category": e.category, "bbox": list(e.bbox), "content": e.content}
                                 for e in page.elements], ensure_ascii=False) for page in pages],
        "meta": [json.dumps(meta, ensure_ascii=False) for meta in metas],
        "markup_override": [page.markup_override for page in pages],
        "hard": [bool(meta.get("hard")) for meta in metas],
        "consistency": [number(meta.get("consistency")) for meta in metas],
        "preannotated": [record is not None for record in preannotations],
        "confidence": [number(record.get("confidence")) if record else None for record in preannotations],
    }
    return pa.table(columns, schema=SCHEMA)


def pages_from_table(table: pa.Table) -> list[Page]:
    """Arrow rows (at least :data:`RECORD_COLUMNS`) back into :class:`Page` objects."""
    rows = table.select(RECORD_COLUMNS).to_pylist()
    pages = []
    for row in rows:
        try:
            elements = [LayoutElement(e["category"], tuple(e["bbox"]), e.get("content", ""))
                        for e in json.loads(row["elements"])]
            pages.append(Page(page_id=row["page_id"], image=row["image"], width=row["width"], height=row["height"],
                              elements=elements, source=row["source"], meta=json.loads(row["meta"]),
                              markup_override=row["markup_override"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidPageError(f"malformed page record {row.get('page_id', '?')!r}: {exc}") from exc
    return pages
