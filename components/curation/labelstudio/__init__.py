"""The human correction loop on Label Studio: queue low-confidence pages, read corrections back.

Flow: :func:`ensure_project` → :func:`queue_pages` (page image + model markup as a prediction)
→ annotators fix the markup in Label Studio → :func:`export_corrections` validates what they
submitted → :func:`apply_corrections` writes the accepted fixes into the :class:`PageDataset`.

Design choices, each against a known Label Studio pain point:

- **Images travel as base64 data URIs** inside the task. That works offline, needs no storage
  connection, no ``LOCAL_FILES_DOCUMENT_ROOT`` covering the dataset and no shared filesystem
  with the server, and the task stays valid if the dataset moves. The cost is ~1.33× the PNG
  size per task in Label Studio's database and in task listings, which is fine for page-sized
  PNGs (tens of KB here); :data:`MAX_IMAGE_BYTES` refuses absurdly large pages loudly.
- **One current prediction per task**, and the task says which model made it. Label Studio's
  labelling stream pre-fills, and its uncertainty sampling scores, only predictions whose
  ``model_version`` equals the project's, while the task view lists every prediction as a tab.
  Pages come from several makers (pre-annotation, hard-example mining, production feedback), so
  every prediction is filed under one project-wide name, :data:`CURRENT_PREDICTION`; the maker
  is the task's ``model_version`` field and its header ("Prefilled: <maker> (confidence ...)").
  A page re-scored by a newer model gets that prediction in place of the old one, never beside
  it, and the replaced ones are listed in the task's ``prediction_history`` (maker, score, when).
- **Lowest confidence first**, in every place an annotator looks: tasks are imported in rising
  confidence (Data Manager default order is task id), the project samples by uncertainty
  (``Label All Tasks`` picks the lowest prediction score), and a Data Manager tab orders by
  prediction score, which stays right across several import rounds.
- **Imports are batched** (bulk prediction imports time out otherwise) and **idempotent**: each
  task carries ``page_id`` and pages already in the project are never imported twice.
- **Broken corrections are never dropped silently**: the annotation is kept as submitted, the
  task gets a ``validation_error`` (a Data Manager column, and shown in red above the page in
  the labeling view) plus a machine-readable record in ``meta``, a "Needs fix" tab lists such
  tasks, and the returned :class:`Correction` says ``accepted=False`` with the reasons.

The package, one concept a file: :mod:`.interface` (the labelling XML), :mod:`.api` (connection and
errors), :mod:`.project`, :mod:`.predictions`, :mod:`.queue`, :mod:`.markup_check`, :mod:`.corrections`.
"""
