"""PP-OCRv6's recogniser as a torch module: the same outputs as onnxruntime, a line read, every
parameter trainable."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("onnx2torch") is None:  # it cannot be imported plainly: it wants torchvision
    pytest.skip("onnx2torch is not installed (./run setup installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def recognizer():
    from models.ocr_encoder import load_ppocr_recognizer

    return load_ppocr_recognizer()


def _line_image(text: str) -> torch.Tensor:
    """``text`` in DejaVu Sans (matplotlib's font), 48 pixels high, scaled to [-1, 1]."""
    from matplotlib import font_manager
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.truetype(font_manager.findfont("DejaVu Sans"), 30)
    width = int(font.getlength(text)) + 16
    image = Image.new("RGB", (width, 48), "white")
    ImageDraw.Draw(image).text((8, 6), text, font=font, fill="black")
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1)[None]


def test_the_converted_network_equals_onnxruntime_and_reads_a_line(recognizer):
    import onnxruntime as ort

    from models.ocr_encoder import greedy_ctc, ppocr_charset, ppocr_recognizer_path

    line = _line_image("Page 12: results, 3.5% better")
    session = ort.InferenceSession(str(ppocr_recognizer_path()))
    reference = session.run(None, {session.get_inputs()[0].name: line.numpy()})[0]
    with torch.no_grad():
        probs = recognizer(line)
    assert probs.shape == reference.shape and float((probs.numpy() - reference).__abs__().max()) < 1e-4
    charset = ppocr_charset()
    assert len(charset) + 1 == probs.shape[-1]
    assert greedy_ctc(probs[0], charset).strip() == "Page 12: results, 3.5% better"


def test_every_parameter_receives_a_gradient(recognizer):
    recognizer.zero_grad()
    recognizer(_line_image("trainable")).log().mean().backward()
    missing = [name for name, p in recognizer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing and sum(p.numel() for p in recognizer.parameters()) == pytest.approx(2.76e6, rel=0.01)


def test_same_upper_pads_become_explicit_and_strided_ones_are_refused():
    import onnx

    from models.ocr_encoder import _explicit_pads, ppocr_recognizer_path

    model = onnx.load(str(ppocr_recognizer_path()))
    assert _explicit_pads(model.graph) == 3
    assert _explicit_pads(model.graph) == 0  # nothing left to rewrite
    node = onnx.helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER")
    with pytest.raises(ValueError, match="stride"):
        _explicit_pads(onnx.helper.make_graph([node], "g", [], []))
