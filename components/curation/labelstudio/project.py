"""The project: created once with its interface, its views (lowest confidence first, needs fix)."""

from __future__ import annotations

from components.curation.labelstudio.api import call
from components.curation.labelstudio.interface import (
    LABEL_CONFIG,
    NEEDS_FIX_VIEW_TITLE,
    ORDER_VIEW_TITLE,
    PROJECT_DESCRIPTION,
    UNCERTAINTY_SAMPLING,
)


def ensure_project(client, title: str, label_config: str = LABEL_CONFIG) -> int:
    """Id of the project called ``title``, creating it (and its Data Manager tabs) if needed."""
    projects = call(client, "list projects", lambda: list(client.projects.list(title=title, page_size=100)))
    matching = sorted(p.id for p in projects if p.title == title)
    if matching:
        project_id = matching[0]
        project = call(client, f"read project {project_id}", lambda: client.projects.get(id=project_id))
        if project.label_config != label_config:  # our XML changed since the project was made
            call(
                client,
                f"update the labeling config of project {project_id}",
                lambda: client.projects.update(id=project_id, label_config=label_config),
            )
    else:
        project = call(
            client,
            f"create project {title!r}",
            lambda: client.projects.create(
                title=title,
                description=PROJECT_DESCRIPTION,
                label_config=label_config,
                sampling=UNCERTAINTY_SAMPLING,
                show_collab_predictions=True,
            ),
        )
        project_id = project.id
    _ensure_views(client, project_id)
    return project_id


def _ensure_views(client, project_id: int) -> None:
    """The two Data Manager tabs annotators work from; created once, found by title after."""
    wanted = {
        # The task's own confidence, kept current with its one prediction: Label Studio's
        # prediction-score column counts only the project's model version.
        ORDER_VIEW_TITLE: {"title": ORDER_VIEW_TITLE, "ordering": ["tasks:data.confidence"],
                           "columnsDisplayType": {"tasks:data.confidence": "Number"}},
        NEEDS_FIX_VIEW_TITLE: {
            "title": NEEDS_FIX_VIEW_TITLE,
            "filters": {
                "conjunction": "and",
                "items": [
                    {"filter": "filter:tasks:data.validation_error", "operator": "empty", "type": "String", "value": False}
                ],
            },
        },
    }
    existing = call(client, "list Data Manager views", lambda: client.views.list(project=project_id))
    by_title = {(view.data or {}).get("title"): view for view in existing}
    for title, data in wanted.items():  # dict order: the ordering tab comes first
        view = by_title.get(title)
        if view is None:
            call(client, f"create view {title!r}", lambda d=data: client.views.create(project=project_id, data=d))
        elif any((view.data or {}).get(key) != value for key, value in data.items()):  # made by an older version
            call(client, f"update view {title!r}", lambda v=view, d=data: client.views.update(
                id=v.id, project=project_id, data={**(v.data or {}), **d}))


def view_id(client, project_id: int, title: str = ORDER_VIEW_TITLE) -> int:
    """Id of one of our Data Manager tabs (for listing tasks the way annotators see them)."""
    for view in call(client, "list Data Manager views", lambda: client.views.list(project=project_id)):
        if (view.data or {}).get("title") == title:
            return view.id
    raise LookupError(f"project {project_id} has no Data Manager view {title!r}; run ensure_project first")
