"""The labelling interface: the Label Studio XML of the page view and the block view, and the
field names the predictions and corrections use."""

from __future__ import annotations

MARKUP_FIELD = "markup"
CONFIDENCE_FIELD = "annotator_confidence"
IMAGE_FIELD = "page"
LAYOUT_FIELD = "layout"  # block view: one rectangle per layout element, labelled by category
TRANSCRIPTION_FIELD = "transcription"  # block view: the markup of each rectangle
ORDER_VIEW_TITLE = "Lowest confidence first"
NEEDS_FIX_VIEW_TITLE = "Needs fix"
VALIDATION_META_KEY = "docmarkup_validation"
DEFAULT_BATCH_SIZE = 50
MAX_IMAGE_BYTES = 8 * 1024 * 1024
UNCERTAINTY_SAMPLING = "Uncertainty sampling"
# The one model_version every prediction is filed under, so Label Studio shows and scores all of
# them; which model made a task's prediction is in its data (see the module docstring).
CURRENT_PREDICTION = "current"

# Real pages must be readable on a 1366x768 laptop: a 1224x1584 manual page has body lines ~18 px
# high, so it needs about half scale (>= 9 px on screen). Label Studio fits an image into a box no
# taller than the window (its inline ``max-height: calc(100vh - 194px)``), which drew such a page at
# 212x300 px. So the page spans the labelling area's whole width, that cap is lifted (``<Style>``),
# the page is fitted to the width, and the labelling area scrolls; the editor comes below the page,
# and the block view's per-box texts are in the region list beside it. The labelling area's image
# container is found by its class prefix (CSS modules of Label Studio 1.23).
# The first screen must show the page's first lines of text (the page's top margin alone is ~300 px on a
# 1366x768 laptop): the headers above the page are one short line each, in a small type, tight together.
PAGE_STYLE = """.lsf-main-view .lsf-object [class^="container--"] { max-height: none !important; }
.lsf-main-view h1, .lsf-main-view h2, .lsf-main-view h3, .lsf-main-view h4, .lsf-main-view h5, .lsf-main-view h6 {
  font-size: 14px !important; line-height: 18px !important; margin: 2px 0 !important; }"""


def _page_first_config(image_extra: str, edit_side: str) -> str:
    """The page image across the whole labelling area, the editor under it. ``$validation_error``
    is empty until a submitted correction fails validation; then the reason shows above the page.
    The header says which prediction was prefilled and where its text came from (the PDF's text
    layer, OCR with the reason the text layer was not used, or a model, with its confidence).
    ``image_extra`` (the block view's label palette) sits right above the page."""
    return f"""<View>
  <Style>{PAGE_STYLE}</Style>
  <View style="color: #b00020; font-weight: bold;">
    <Header value="$validation_error" size="5"/>
  </View>
  <Header value="Prefilled: $prediction_source" size="6"/>
{image_extra}  <Image name="{IMAGE_FIELD}" value="$image" zoom="true" zoomControl="true" maxWidth="100%"/>
{edit_side}  <Header value="How sure are you of this correction?" size="6"/>
  <Choices name="{CONFIDENCE_FIELD}" toName="{IMAGE_FIELD}" choice="single" showInline="true" required="false">
    <Choice value="sure"/>
    <Choice value="unsure"/>
  </Choices>
</View>
"""


# The whole page's markup in one text box.
LABEL_CONFIG = _page_first_config("", f"""  <Header value="Page markup: fix it to match the page (blank line between blocks; tables as HTML)" size="6"/>
  <TextArea name="{MARKUP_FIELD}" toName="{IMAGE_FIELD}" editable="true" maxSubmissions="1" rows="28"
            showSubmitButton="false" placeholder="corrected page markup"/>
""")

_CATEGORY_COLOURS = {"title": "#d62728", "text": "#1f77b4", "table": "#2ca02c", "formula": "#9467bd",
                     "code": "#17becf", "header": "#7f7f7f", "footer": "#8c564b", "figure": "#e377c2"}

# Label Studio's OCR pattern: the pre-annotation's layout boxes as editable rectangles labelled by
# category, one transcription per box (``perRegion``); the page markup is rebuilt from the boxes
# in reading order on export. Headers and footers are boxes without markup (as in OmniDocBench).
BLOCKS_LABEL_CONFIG = _page_first_config(f"""  <Header value="Fix each box's text in the region list (tables: HTML, formulas: LaTeX); draw missing boxes" size="6"/>
  <RectangleLabels name="{LAYOUT_FIELD}" toName="{IMAGE_FIELD}" strokeWidth="2">
{chr(10).join(f'    <Label value="{c}" background="{colour}"/>' for c, colour in _CATEGORY_COLOURS.items())}
  </RectangleLabels>
""", f"""  <TextArea name="{TRANSCRIPTION_FIELD}" toName="{IMAGE_FIELD}" perRegion="true" editable="true" rows="4"
            displayMode="region-list" placeholder="what this box says"/>
""")
LABEL_CONFIGS = {"page": LABEL_CONFIG, "blocks": BLOCKS_LABEL_CONFIG}

PROJECT_DESCRIPTION = (
    "Correct the model's page markup. Pages are ordered lowest model confidence first. "
    "Submitted markup is validated on export; problems show in the validation_error column."
)
