"""Matching the rendered tokens of a prediction to the ground truth's, as the official CDM does.

1. **Assignment** (Hungarian, :func:`scipy.optimize.linear_sum_assignment`) on
   ``1·token + 0.05·position + 0.15·order``: token cost 0 for the same token, 0.005 for tokens
   that draw the same symbol (``\\leq``/``\\le``, ``\\cdot``/``.``, ``\\left(``/``(``…), 1 otherwise;
   position the mean L1 distance of the boxes in image-relative coordinates; order the distance
   of the tokens' relative indices.
2. **Spatial consistency**: the matched pairs' box centres must agree with one translation-and-
   scale transform. RANSAC (2-point samples, residual threshold 20 pixels, 50 trials, generator
   seeded 42) is run up to 5 times, each time on the pairs not yet explained; pairs it never
   explains do not count.
3. Pairs of different tokens (token cost 1) never count. **F1** = 2·matched / (n_gt + n_pred),
   rounded to 3 decimals as the official code reports it.

RANSAC is written out here rather than taken from scikit-image: the official code pins
scikit-image 0.20, whose loop (sampling order, dynamic trial count, tie-break on residuals) later
releases changed, and the score depends on it. Ours follows 0.20's.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist

TOKEN_WEIGHT, POSITION_WEIGHT, ORDER_WEIGHT = 1.0, 0.05, 0.15
SAME_SYMBOL_COST = 0.005
RANSAC_ROUNDS, MIN_SAMPLES, RESIDUAL_THRESHOLD, MAX_TRIALS, SEED = 5, 2, 20.0, 50, 42

SAME_SYMBOL = {
    "\\dot": ".", "\\Dot": ".", "\\cdot": ".", "\\cdotp": ".", "\\ldotp": ".", "\\mid": "|", "\\rightarrow": "\\to",
    "\\top": "T", "\\Tilde": "\\tilde", "\\prime": "'", "\\ast": "*", "\\left<": "\\langle", "\\right>": "\\rangle",
    "\\lbrace": "\\{", "\\rbrace": "\\}", "\\lbrack": "[", "\\rbrack": "]", "\\blackslash": "/", "\\slash": "/",
    "\\leq": "\\le", "\\geq": "\\ge", "\\Vert": "\\|", "\\lVert": "\\|", "\\rVert": "\\|", "\\vert": "|",
    "\\lvert": "|", "\\rvert": "|", "\\colon": ":", "\\Ddot": "\\ddot", "\\Bar": "\\bar", "\\Vec": "\\vec",
    "\\parallel": "\\|", "\\dag": "\\dagger", "\\ddag": "\\ddagger", "\\textlangle": "<", "\\textrangle": ">",
    "\\textgreater": ">", "\\textless": "<", "\\textbackslash": "n", "\\textunderscore": "_", "\\=": "_",
    "\\neg": "\\lnot", "\\neq": "\\not=",
}


def same_symbol(token: str) -> str:
    """The spelling-independent name of what a token draws (``\\left(`` and ``\\big(`` are ``(``)."""
    if token.startswith(("\\left", "\\right")) and not any(part in token for part in ("arrow", "<", ">", "harpoon")):
        token = token.replace("\\left", "").replace("\\right", "")
    if token.startswith(("\\big", "\\Big")):
        token = "\\" + token[4:].split("\\")[-1] if "\\" in token[4:] else token[-1]
    token = SAME_SYMBOL.get(token, token)
    for prefix in ("\\wide", "\\var"):
        if token.startswith(prefix):
            return token.replace(prefix[1:], "")
    if token.startswith("\\string"):
        return token.replace("\\string", "")
    return token


def token_costs(gt_tokens: list[str], pred_tokens: list[str]) -> np.ndarray:
    """(n_gt, n_pred): 0 same token, 0.005 same symbol, 1 otherwise."""
    gt, pred = np.array(gt_tokens, dtype=object), np.array(pred_tokens, dtype=object)
    cost = (gt[:, None] != pred[None, :]).astype(float)
    gt_symbol = np.array([same_symbol(t) for t in gt_tokens], dtype=object)
    pred_symbol = np.array([same_symbol(t) for t in pred_tokens], dtype=object)
    cost[(cost == 1) & (gt_symbol[:, None] == pred_symbol[None, :])] = SAME_SYMBOL_COST
    return cost


def _relative_boxes(boxes: list[list[int]], size: tuple[int, int]) -> np.ndarray:
    width, height = size
    return np.array([[x0 / width, y0 / height, x1 / width, y1 / height] for x0, y0, x1, y1 in boxes])


def assign(gt: list[tuple[str, list[int]]], pred: list[tuple[str, list[int]]], gt_size: tuple[int, int],
           pred_size: tuple[int, int]) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The Hungarian assignment of ground-truth to predicted tokens, and the token costs."""
    tokens = token_costs([t for t, _ in gt], [t for t, _ in pred])
    position = cdist(_relative_boxes([b for _, b in gt], gt_size), _relative_boxes([b for _, b in pred], pred_size),
                     "minkowski", p=1) / 4
    longest = max(len(gt), len(pred))
    order = cdist(np.arange(len(gt))[:, None] / longest, np.arange(len(pred))[:, None] / longest, "minkowski", p=1)
    cost = TOKEN_WEIGHT * tokens + POSITION_WEIGHT * position + ORDER_WEIGHT * order
    cost[np.isnan(cost) | np.isinf(cost)] = 100
    rows, columns = linear_sum_assignment(cost)
    return list(zip(rows.tolist(), columns.tolist(), strict=True)), tokens


class ShiftAndScale:
    """A translation plus one scale about the points' own centre (the official ``SimpleAffineTransform``)."""

    def __init__(self) -> None:
        self.translation = np.zeros(2)
        self.scale = 1.0

    def estimate(self, src: np.ndarray, dst: np.ndarray) -> None:
        src_centre, dst_centre = src.mean(axis=0), dst.mean(axis=0)
        self.translation = dst_centre - src_centre
        spread = np.linalg.norm(src - src_centre, axis=1).mean()
        self.scale = np.linalg.norm(dst - dst_centre, axis=1).mean() / (spread + 1e-10)

    def __call__(self, points: np.ndarray) -> np.ndarray:
        centre = points.mean(axis=0)
        return self.scale * (points - centre) + centre + self.translation

    def residuals(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        return np.sqrt(((self(src) - dst) ** 2).sum(axis=1))


def _trials_needed(inliers: int, samples: int) -> float:
    """scikit-image 0.20's dynamic trial count at stop probability 1."""
    epsilon = np.spacing(1)
    if inliers == 0:
        return np.inf
    failure = max(epsilon, 1 - (inliers / samples) ** MIN_SAMPLES)
    return float(np.ceil(np.log(epsilon) / np.log(failure)))


def ransac(src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """The inliers of the best shift-and-scale model (scikit-image 0.20's loop and sampling)."""
    rng = np.random.default_rng(SEED)
    count = len(src)
    best_inliers: np.ndarray | None = None
    best_count, best_sum = 0, np.inf
    sample = rng.choice(count, MIN_SAMPLES, replace=False)
    max_trials, trials = MAX_TRIALS, 0
    model = ShiftAndScale()
    while trials < max_trials:
        trials += 1
        chosen = sample
        sample = rng.choice(count, MIN_SAMPLES, replace=False)
        model.estimate(src[chosen], dst[chosen])
        residuals = np.abs(model.residuals(src, dst))
        inliers = residuals < RESIDUAL_THRESHOLD
        residual_sum = residuals.dot(residuals)
        inlier_count = int(np.count_nonzero(inliers))
        if inlier_count > best_count or (inlier_count == best_count and residual_sum < best_sum):
            best_count, best_sum, best_inliers = inlier_count, residual_sum, inliers
            max_trials = min(max_trials, _trials_needed(best_count, count))
            if best_sum <= 0:
                break
    if best_inliers is None or not best_inliers.any():
        return None
    return best_inliers


def consistent_pairs(pairs: list[tuple[int, int]], gt_boxes: list[list[int]],
                     pred_boxes: list[list[int]]) -> np.ndarray:
    """Which matched pairs one shift-and-scale of the box centres explains (up to 5 RANSAC rounds)."""

    def centre(box: list[int]) -> list[float]:
        return [(box[1] + box[3]) / 2, (box[0] + box[2]) / 2]

    src = np.array([centre(gt_boxes[a]) for a, _ in pairs]).reshape(-1, 2)
    dst = np.array([centre(pred_boxes[b]) for _, b in pairs]).reshape(-1, 2)
    if len(src) <= MIN_SAMPLES:
        return np.ones(len(pairs), dtype=bool)
    explained = np.zeros(len(pairs), dtype=bool)
    for _ in range(RANSAC_ROUNDS):
        rest = np.flatnonzero(~explained)
        if len(rest) <= MIN_SAMPLES:
            break
        found = ransac(src[rest], dst[rest])
        if found is None:
            break
        explained[rest[found]] = True
        if explained.all():
            break
    return explained


def f1(gt: list[tuple[str, list[int]]], pred: list[tuple[str, list[int]]], gt_size: tuple[int, int],
       pred_size: tuple[int, int]) -> float:
    """CDM's F1 of two renderings' drawn tokens (0 when the prediction drew nothing)."""
    if not pred:
        return 0.0
    pairs, tokens = assign(gt, pred, gt_size, pred_size)
    kept = consistent_pairs(pairs, [b for _, b in gt], [b for _, b in pred])
    for k, (a, b) in enumerate(pairs):
        if tokens[a, b] == 1:
            kept[k] = False
    return round(2 * int(kept.sum()) / (len(gt) + len(pred)), 3)
