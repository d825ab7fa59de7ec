"""Matching predicted elements to ground-truth elements, OmniDocBench v1.5's ``quick_match``.

The official end-to-end evaluation matches text blocks and display formulas of a page together
(``match_gt2pred_quick`` in ``utils/match_quick.py``) and tables separately
(``match_gt2pred_simple``). We implement the same definitions; the steps of ``quick_match``:

1. ground-truth formulas whose LaTeX is a one-column ``array`` are split into one formula per
   row (order 7 -> 7.1, 7.2, …), predicted ones likewise; predictions are ordered by position,
   inline formulas last;
2. every element is normalized (text: ``normalize_text``; formula: ``normalize_formula``) and
   elements whose raw or normalized string is empty are dropped;
3. ground truth of an *ignored* category (headers, footers, captions, footnotes, page numbers,
   ...) claims every prediction within normalized edit distance 0.25; those predictions leave
   the pool and the ignored blocks are never scored;
4. **truncation**: for each ground-truth block without a prediction under 0.25, runs of
   consecutive free predictions are merged while each part fuzzily fits inside the block
   (``_merge_helps``), and non-overlapping runs are kept (lowest mean cost per overlap group);
5. Hungarian assignment on normalized edit distance; a pair above 0.7 counts as unmatched;
6. a prediction that contains an unmatched block as a fuzzy substring (< 0.4) absorbs it
   (one prediction, several ground-truth blocks);
7. leftovers are paired by a second Hungarian pass, the rest stays unmatched (edit 1).

The official code has a few bookkeeping effects that change scores, reproduced on purpose:
positions and categories are looked up by the index of the *filtered* line in the *unfiltered*
element list, and removing a prediction-only inline formula while iterating skips the next
entry, which is then not scored at all (``Match.gt_category`` is None).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
from rapidfuzz.distance import Levenshtein
from scipy.optimize import linear_sum_assignment

from components.metrics.extraction import DISPLAY_FORMULA, INLINE_FORMULA, TEXT
from components.metrics.formula import normalize_formula
from components.metrics.text import normalize_text, normalized_edit_distance

TEXT_CATEGORIES = (
    "text_block", "title", "code_txt", "code_txt_caption", "reference", "equation_caption", "figure_caption",
    "figure_footnote", "table_caption", "table_footnote", "code_algorithm", "code_algorithm_caption", "header",
    "footer", "page_footnote", "page_number",
)
IGNORED_CATEGORIES = (
    "figure_caption", "figure_footnote", "table_caption", "table_footnote", "code_algorithm",
    "code_algorithm_caption", "header", "footer", "page_footnote", "page_number", "equation_caption",
)
FORMULA_CATEGORY = "equation_isolated"
TABLE_CATEGORY = "table"
IGNORE_CLAIM_THRESHOLD = 0.25
UNMATCHED_ABOVE = 0.7
TRUNCATION_FIT = 0.6
FUZZY_ABSORB_BELOW = 0.4


@dataclass(frozen=True)
class Element:
    """An element to match. Ground truth: ``category`` is the OmniDocBench category and
    ``position`` its reading order. Prediction: ``category`` is ``text_all`` /
    ``equation_isolated`` / a table kind, ``fine_category`` the finer kind, ``position`` the offset."""

    category: str
    content: str
    position: float | int | str = ""
    fine_category: str = ""
    attribute: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.fine_category or self.category


@dataclass
class Match:
    """One scored entry: ground-truth indices (several when blocks were merged), prediction indices.

    ``norm_gt``/``norm_pred`` are what the edit distance is computed on. ``gt_category`` is ""
    for a prediction-only entry and None for an entry the official bookkeeping skips.
    """

    gt_indices: list[int]
    pred_indices: list[int]
    gt: str = ""
    pred: str = ""
    norm_gt: str = ""
    norm_pred: str = ""
    gt_category: str | None = ""
    pred_category: str = ""
    gt_positions: list = field(default_factory=list)
    pred_position: int | None = None
    gt_attributes: list[dict] = field(default_factory=list)


def distance_matrix(gt_lines: list[str], pred_lines: list[str]) -> np.ndarray:
    matrix = np.zeros((len(gt_lines), len(pred_lines)))
    for i, gt in enumerate(gt_lines):
        for j, pred in enumerate(pred_lines):
            matrix[i, j] = normalized_edit_distance(gt, pred)
    return matrix


# --- step 1: one-column arrays -------------------------------------------------------------------

_ARRAY_RE = re.compile(r"\\begin\{array\}\{(?P<spec>[^}]*)\}(?P<body>.*?)\\end\{array\}", re.S)


def _one_column(spec: str) -> bool:
    spec = re.sub(r"\s+|\|", "", spec)
    spec = re.sub(r"@{[^}]*}", "", spec)
    spec = re.sub(r"!{[^}]*}", "", spec)
    return spec in ("l", "c", "r")


def _array_rows(latex: str) -> tuple[re.Match, list[str]] | None:
    match = _ARRAY_RE.search(latex)
    if not match or not _one_column(match.group("spec")):
        return None
    rows = [row.strip() for row in re.split(r"\\\\", match.group("body")) if row.strip()]
    return match, rows


def split_gt_arrays(items: list[Element]) -> list[Element]:
    """Ground-truth formulas of a one-column ``array`` become one formula per row."""
    out: list[Element] = []
    for item in items:
        split = _array_rows(item.content) if item.category == FORMULA_CATEGORY and "\\begin{array" in item.content else None
        if split is None:
            out.append(item)
            continue
        base = float(item.position)  # type: ignore[arg-type]
        out.extend(replace(item, content=f"\\[{row}\\]", position=round(base + index / 10, 1))
                   for index, row in enumerate(split[1], start=1))
    return out


def split_pred_arrays(items: list[Element]) -> list[Element]:
    """Predicted one-column ``array`` formulas become one formula per row, positioned inside the array."""
    out: list[Element] = []
    for item in items:
        split = _array_rows(item.content) if item.category == DISPLAY_FORMULA and "\\begin{array" in item.content else None
        if split is None:
            out.append(item)
            continue
        match, rows = split
        body, body_start, cursor = match.group("body"), match.start("body"), 0
        for row in rows:
            offset = body.find(row, cursor)
            offset = cursor if offset == -1 else offset
            cursor = offset + len(row)
            out.append(replace(item, content=f"\\[{row.strip()}\\]", position=int(item.position) + body_start + offset))
    return out


# --- step 2: lines ---------------------------------------------------------------------------------

def gt_line(item: Element) -> tuple[str, str]:
    """(raw, normalized) string of a ground-truth element."""
    if item.category == FORMULA_CATEGORY:
        return item.content, normalize_formula(item.content)
    return item.content, normalize_text(item.content)


def pred_line(item: Element) -> tuple[str, str]:
    """(raw, normalized) string of a predicted element."""
    if item.category == TEXT:
        return item.content, normalize_text(item.content)
    if item.category == DISPLAY_FORMULA:
        return item.content, normalize_formula(item.content)
    return item.content, item.content


def _gt_position(item: Element) -> float | int | str:
    return item.position if item.position else ""


# --- steps 4-7 on the non-ignored lines ------------------------------------------------------------

def _fuzzy_inside(outer: str, inner: str) -> float | None:
    """Best windowed edit distance of ``inner`` inside ``outer``, per character of ``inner``; None if longer."""
    if not inner or len(outer) < len(inner):
        return None
    width = len(inner)
    return min(Levenshtein.distance(outer[i:i + width], inner) / width for i in range(len(outer) - width + 1))


def _merge_helps(gt: str, parts: list[str]) -> tuple[bool, bool]:
    """Whether adding the last part to the run still fits the block, and whether to try one more."""
    if len(parts) == 1:
        return False, False
    current, merged = " ".join(parts[:-1]), " ".join(parts)
    if normalized_edit_distance(gt, merged) > normalized_edit_distance(gt, current):
        return False, False
    for part in parts[:-1]:
        fit = _fuzzy_inside(gt, part)
        if fit is None or fit > TRUNCATION_FIT:
            return False, False
    last_fit = _fuzzy_inside(gt, parts[-1])
    if last_fit is None:
        return False, False
    return last_fit < TRUNCATION_FIT, len(merged) <= len(gt)


def _non_overlapping_runs(runs: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Group runs that overlap (in start order); in each group keep the path of lowest mean cost."""
    if not runs:
        return []
    ordered = sorted(zip(runs, costs, strict=True), key=lambda pair: pair[0][0])
    groups: list[list[tuple[list[int], float]]] = [[ordered[0]]]
    for run, cost in ordered[1:]:
        if any(index in other for other, _ in groups[-1] for index in run):
            groups[-1].append((run, cost))
        else:
            groups.append([(run, cost)])
    chosen: list[list[int]] = []
    for group in groups:
        if len(group) == 1:
            chosen.append(group[0][0])
            continue
        paths: list[list[tuple[list[int], float]]] = [[group[0]]]
        for run, cost in group[1:]:
            new_path = True
            for path in paths:
                overlaps = same = False
                for existing in list(path):
                    if existing[0] == run:
                        overlaps = same = True
                        if existing[1] > cost:
                            path.remove(existing)
                            path.append((run, cost))
                    elif set(existing[0]) & set(run):
                        overlaps = True
                if not overlaps:
                    path.append((run, cost))
                    new_path = False
                if same:
                    new_path = False
            if new_path:
                paths.append([(run, cost)])
        best, best_cost = [], float("inf")
        for path in paths:
            mean = sum(cost for _, cost in path) / len(path)
            if mean < best_cost:
                best, best_cost = [run for run, _ in path], mean
        chosen.extend(best)
    return chosen


def _truncation_columns(cost: np.ndarray, gt_lines: list[str], pred_lines: list[str]) -> tuple[np.ndarray, list]:
    """Columns after merging runs of predictions that together make one truncated block."""
    claimed = np.argwhere(cost < IGNORE_CLAIM_THRESHOLD)
    claimed_gt = {int(i) for i, _ in claimed}
    claimed_pred = {int(j) for _, j in claimed}
    free_gt = [i for i in range(cost.shape[0]) if i not in claimed_gt]
    free_pred = [j for j in range(cost.shape[1]) if j not in claimed_pred]
    runs, run_costs = [], []
    for gt_index in free_gt:
        candidates, candidate_costs = [], []
        for start in free_pred:
            step, parts = 1, [pred_lines[start]]
            while start + step not in claimed_pred and start + step < len(pred_lines):
                parts.append(pred_lines[start + step])
                fits, more = _merge_helps(gt_lines[gt_index], parts)
                if not fits:
                    break
                step += 1
                if not more:
                    break
            candidates.append(list(range(start, start + step)))
            joined = " ".join(pred_lines[start:start + step])
            candidate_costs.append(normalized_edit_distance(gt_lines[gt_index], joined))
        if candidate_costs:
            best = candidate_costs.index(min(candidate_costs))
            runs.append(candidates[best])
            run_costs.append(candidate_costs[best])
    chosen = _non_overlapping_runs(runs, run_costs)
    if not chosen:
        return cost, list(range(len(pred_lines)))
    columns: list = list(range(len(pred_lines)))
    for run in chosen:
        at = columns.index(run[0])
        del columns[at:at + len(run)]
        columns.insert(at, run)
    merged_lines = [" ".join(pred_lines[c[0]:c[-1] + 1]) if isinstance(c, list) else pred_lines[c] for c in columns]
    return distance_matrix(gt_lines, merged_lines), columns


def _match_lines(gt_lines: list[str], pred_lines: list[str]) -> list[tuple[list, list]]:
    """Steps 4-7: (gt indices, pred indices) entries; an empty list marks the missing side."""
    cost, columns = _truncation_columns(distance_matrix(gt_lines, pred_lines), gt_lines, pred_lines)
    rows, cols = linear_sum_assignment(cost)
    assigned = {int(r): (columns[c], float(cost[r, c])) for r, c in zip(rows, cols, strict=True)}

    matches: dict[int, list[int]] = {}
    unmatched_gt: list[int] = []
    for gt_index in range(len(gt_lines)):
        if gt_index not in assigned:
            unmatched_gt.append(gt_index)
            continue
        column, edit = assigned[gt_index]
        preds = list(range(column[0], column[-1] + 1)) if isinstance(column, list) else [column]
        if edit > UNMATCHED_ABOVE:
            unmatched_gt.append(gt_index)
        else:
            matches[gt_index] = preds

    absorbed: dict[int, list[int]] = {}
    for pred_index, pred in enumerate(pred_lines):
        fits = {g: _fuzzy_inside(pred, gt_lines[g]) for g in unmatched_gt}
        inside = [g for g, fit in fits.items() if fit is not None and fit < FUZZY_ABSORB_BELOW]
        if inside:
            absorbed[pred_index] = inside

    # One entry per prediction key; a ground-truth block joins the first key that claims it.
    by_key: dict[tuple[int, ...], list[int]] = {}
    taken: set[int] = set()
    for gt_index, preds in matches.items():
        key = tuple(sorted(preds))
        if key in by_key:
            if gt_index not in taken:
                by_key[key].append(gt_index)
                taken.add(gt_index)
        else:
            by_key[key] = [gt_index]
            taken.add(gt_index)
    for pred_index, gts in absorbed.items():
        key = (pred_index,)
        if key in by_key:
            for gt_index in gts:
                if gt_index not in taken:
                    by_key[key].append(gt_index)
                    taken.add(gt_index)
        else:
            by_key[key] = [g for g in gts if g not in taken]
            taken.update(by_key[key])

    pairs: list[tuple[int | None, list[int]]] = []
    for key, gts in by_key.items():
        pairs.extend((g, list(key)) for g in sorted(set(gts)))
    all_gt, all_pred = set(range(len(gt_lines))), set(range(len(pred_lines)))
    left_gt = all_gt - set().union(*[set(g) for g in by_key.values()])
    left_pred = all_pred - {p for key in by_key for p in key}
    if left_pred and left_gt:
        gt_list, pred_list = list(left_gt), list(left_pred)
        leftover = [[normalized_edit_distance(gt_lines[g], pred_lines[p]) for p in pred_list] for g in gt_list]
        for r, c in zip(*linear_sum_assignment(leftover), strict=True):
            pairs.append((gt_list[r], [pred_list[c]]))
    elif left_pred:
        pairs.append((None, list(left_pred)))
    else:
        pairs.extend((g, []) for g in left_gt)

    # Entries sharing a prediction key collapse into one; blocks nobody matched come last.
    entries: list[tuple[list, list]] = []
    seen_keys: set[tuple[int, ...]] = set()
    covered: set[int] = set()
    for gt_index, preds in pairs:
        key = tuple(preds)
        if not preds or key in seen_keys:
            continue
        gts = [gt_index] + [other_gt for other_gt, other_preds in pairs
                            if tuple(other_preds) == key and other_gt != gt_index]
        entries.append(([g for g in gts if g is not None], preds))
        seen_keys.add(key)
        covered.update(g for g in gts if g is not None)
    entries.extend(([g], []) for g in range(len(gt_lines)) if g not in covered)
    return entries


def quick_match(gt_items: list[Element], pred_items: list[Element]) -> list[Match]:
    """Match a page's text blocks and display formulas (the module docstring gives the steps)."""
    gt_items = split_gt_arrays(gt_items)
    order = sorted(enumerate(pred_items), key=lambda ip: (ip[1].fine_category == INLINE_FORMULA, ip[1].position, ip[0]))
    pred_items = split_pred_arrays([item for _, item in order])

    gt_rows = [(raw, norm, item.category) for item in gt_items for raw, norm in [gt_line(item)] if raw and norm]
    pred_rows = [(raw, norm) for item in pred_items for raw, norm in [pred_line(item)] if raw and norm]

    def gt_match(index: int, *, pred: int | None = None, category: str | None = None) -> Match:
        raw, norm, cat = gt_rows[index]
        match = Match([index], [], gt=raw, norm_gt=norm, gt_category=category or cat,
                      gt_positions=[_gt_position(gt_items[index])], gt_attributes=[gt_items[index].attribute])
        if pred is not None:
            match.pred_indices, match.pred, match.norm_pred = [pred], *pred_rows[pred]
            match.pred_category, match.pred_position = pred_items[pred].kind, pred_items[pred].position
        return match

    if not gt_rows:
        return [Match([], [p], pred=raw, norm_pred=norm, pred_category=pred_items[p].kind,
                      pred_position=pred_items[p].position) for p, (raw, norm) in enumerate(pred_rows)]
    if not pred_rows:
        return [gt_match(g) for g in range(len(gt_rows))]
    if len(gt_rows) == 1 and len(pred_rows) == 1:
        return [gt_match(0, pred=0)]

    ignored = [g for g, row in enumerate(gt_rows) if row[2] in IGNORED_CATEGORIES]
    kept = [g for g, row in enumerate(gt_rows) if row[2] not in IGNORED_CATEGORIES]
    claimed: set[int] = set()
    if ignored:
        claim = distance_matrix([gt_rows[g][1] for g in ignored], [norm for _, norm in pred_rows])
        claimed = {int(p) for _, p in np.argwhere(claim < IGNORE_CLAIM_THRESHOLD)}
    free_pred = [p for p in range(len(pred_rows)) if p not in claimed]

    # Local lists, looked up (as the official code does) by local index in the global item lists.
    local_gt_items = [gt_items[g] for g in kept]
    local_pred_items = [pred_items[p] for p in free_pred]
    entries = _match_lines([gt_rows[g][1] for g in kept], [pred_rows[p][1] for p in free_pred])

    results: list[Match] = []
    skip_next = False
    for gt_local, pred_local in entries:
        if skip_next:  # the official loop removed the previous entry while iterating and skips this one
            skip_next = False
            results.append(Match([kept[g] for g in gt_local], [free_pred[p] for p in pred_local], gt_category=None))
            continue
        match = Match([kept[g] for g in gt_local], [free_pred[p] for p in pred_local])
        if gt_local:
            categories = [gt_rows[kept[g]][2] for g in gt_local]
            match.gt_category = Counter(categories).most_common(1)[0][0]
            match.gt_positions = [_gt_position(local_gt_items[g]) for g in gt_local]
            match.gt_attributes = [local_gt_items[g].attribute for g in gt_local]
            raws = [gt_rows[kept[g]][0] for g in gt_local]
            if match.gt_category == FORMULA_CATEGORY and len(gt_local) > 1:
                match.gt = _as_array(raws)
            else:
                match.gt = "".join(raws)
            match.norm_gt = "".join(gt_rows[kept[g]][1] for g in gt_local)
        if pred_local:
            first = local_pred_items[pred_local[0]]
            match.pred_category = first.kind
            match.pred_position = first.position
            raws = [pred_rows[free_pred[p]][0] for p in pred_local]
            match.pred = _as_array(raws) if "equation" in match.pred_category and len(pred_local) > 1 else "".join(raws)
            match.norm_pred = "".join(pred_rows[free_pred[p]][1] for p in pred_local)
        if not gt_local and match.pred_category == INLINE_FORMULA:
            skip_next = True
            continue
        results.append(match)
    return results


def _as_array(formulas: list[str]) -> str:
    rows = " \\\\ ".join("{" + formula.strip("$").strip("\n") + "}" for formula in formulas)
    return "\\begin{array}{l} " + rows + " \\end{array}"


def simple_match(gt_lines: list[str], pred_lines: list[str]) -> tuple[list[tuple[int, int | None]], list[int]]:
    """Hungarian matching on normalized edit distance of the strings themselves (tables).

    Returns ((gt index, pred index or None) for every gt line, unmatched pred indices).
    """
    if not gt_lines:
        return [], list(range(len(pred_lines)))
    if not pred_lines:
        return [(g, None) for g in range(len(gt_lines))], []
    rows, cols = linear_sum_assignment(distance_matrix(gt_lines, pred_lines))
    pred_of = {int(r): int(c) for r, c in zip(rows, cols, strict=True)}
    pairs = [(g, pred_of.get(g)) for g in range(len(gt_lines))]
    return pairs, [p for p in range(len(pred_lines)) if p not in set(cols.tolist())]
