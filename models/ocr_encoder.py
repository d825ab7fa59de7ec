"""PP-OCRv6's text-line recogniser, shipped inside the rapidocr wheel, as a trainable torch module.

A vision encoder that already reads characters (~2.8M parameters; 48-pixel-high line crops in,
one 18,710-way CTC distribution per 8-pixel column out) is the natural start for a reader of real
documents: the real-document reader's vision tower (issue 32). ``onnx2torch`` converts the ONNX
graph once three ``SAME_UPPER`` auto-pads (two 2×2 convolutions and a 2×2 max-pool, stride 1),
which it does not take, are rewritten as the explicit pads they mean: nothing before, one after.

``onnx2torch`` imports torchvision for its NMS and RoiAlign converters only, and PyPI's torchvision
does not import beside our torch pin, so a stub stands in for it while importing (``./run setup``
installs onnx2torch without its declared dependencies).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

LINE_HEIGHT = 48  # pixels: the recogniser's input height
COLUMN_STRIDE = 8  # input pixels per output column


def ppocr_recognizer_path() -> Path:
    """The ONNX file inside the installed rapidocr wheel."""
    import rapidocr  # deferred: its ONNX sessions load in seconds, only on this path

    path = Path(rapidocr.__file__).parent / "models" / "PP-OCRv6_rec_small.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the rapidocr wheel ships PP-OCRv6_rec_small.onnx from 3.x on")
    return path


@contextmanager
def _torchvision_stub():
    """A stand-in ``torchvision`` (with ``ops``) for the length of an import, unless a real one loads."""
    if "torchvision" in sys.modules:
        yield
        return
    stub, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    ops.roi_align = ops.nms = ops.box_convert = None
    stub.ops = ops
    sys.modules["torchvision"], sys.modules["torchvision.ops"] = stub, ops
    try:
        yield
    finally:
        sys.modules.pop("torchvision", None)
        sys.modules.pop("torchvision.ops", None)


def _explicit_pads(graph) -> int:
    """Rewrite every ``SAME_UPPER`` auto-pad (stride 1) as explicit pads; returns how many."""
    import onnx  # deferred: only converting the ONNX recogniser needs it

    rewritten = 0
    for node in graph.node:
        for attribute in list(node.attribute):
            if attribute.name == "auto_pad" and attribute.s == b"SAME_UPPER":
                kernel = next(a.ints for a in node.attribute if a.name == "kernel_shape")
                strides = next((a.ints for a in node.attribute if a.name == "strides"), [1] * len(kernel))
                if any(s != 1 for s in strides):
                    raise ValueError(f"{node.name}: SAME_UPPER with stride {list(strides)} is not a fixed pad")
                node.attribute.remove(attribute)
                node.attribute.append(onnx.helper.make_attribute(
                    "pads", [(k - 1) // 2 for k in kernel] + [k - 1 - (k - 1) // 2 for k in kernel]))
                rewritten += 1
    return rewritten


def load_ppocr_recognizer(path: str | Path | None = None) -> torch.nn.Module:
    """The recogniser as an ``nn.Module`` (eval mode): images (B, 3, 48, W) scaled to [-1, 1] in,
    CTC probabilities (B, W / 8, 18710) out, index 0 the blank."""
    import onnx  # deferred: only converting the ONNX recogniser needs it

    with _torchvision_stub():
        from onnx2torch import convert  # deferred: only converting the ONNX recogniser needs it

    model = onnx.load(str(path or ppocr_recognizer_path()))
    _explicit_pads(model.graph)
    return convert(model).eval()


FEATURE_TENSOR = "p2o.pd_op.transpose.8.0"  # the CTC head's input: the 120-d feature of each column


class OnnxRecognizer:
    """The recogniser in onnxruntime, with the CTC head's input as a second output: on CPU ~10x
    faster than the converted module, for a tower that is frozen anyway (nothing to backpropagate)."""

    def __init__(self, path: str | Path | None = None, threads: int | None = None):
        import onnx  # deferred: only converting the ONNX recogniser needs it
        import onnxruntime

        model = onnx.load(str(path or ppocr_recognizer_path()))
        model.graph.output.append(onnx.helper.make_tensor_value_info(FEATURE_TENSOR, onnx.TensorProto.FLOAT, None))
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = int(threads)
        self.session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                                    providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lines (B, 48, W) in [-1, 1] -> CTC probabilities (B, W / 8, classes), features (B, W / 8, 120)."""
        pixels = lines.detach().float().cpu()[:, None].expand(-1, 3, -1, -1).contiguous().numpy()
        probs, features = self.session.run(None, {self.input_name: pixels})
        return torch.from_numpy(probs), torch.from_numpy(features)


def ppocr_charset(path: str | Path | None = None) -> list[str]:
    """The recogniser's characters in output order after the blank (index i + 1 is ``charset[i]``);
    the last output is a space."""
    import onnx  # deferred: only converting the ONNX recogniser needs it

    model = onnx.load(str(path or ppocr_recognizer_path()), load_external_data=False)
    characters = next(p.value for p in model.metadata_props if p.key == "character")
    return [*characters.split("\n"), " "]


def greedy_ctc(probs: torch.Tensor, charset: list[str]) -> str:
    """The text of one line's CTC distribution (columns, classes): best class per column, repeats
    collapsed, blanks (0) dropped."""
    best = probs.argmax(-1).tolist()
    return "".join(charset[i - 1] for j, i in enumerate(best) if i and (j == 0 or i != best[j - 1]))
