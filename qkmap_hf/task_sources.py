"""Task sources: generated tasks that ``qkmap compare --task`` trains on and ``qkmap analyze --task`` probes.

The plugin ships no task. A package registers a source under the ``qkmap_hf.task_sources`` entry-point group, and
the plugin finds it by that group, so it never imports who provides the tasks. This repository's research lab
(``qkmap_lab``) registers its synthetic tasks (mqar, salience, copy) that way; a user's package can register its own:

    [project.entry-points."qkmap_hf.task_sources"]
    my_tasks = "my_package.tasks:SOURCE"

A source is any object with the attributes of ``TaskSource``.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points
from typing import Any, Protocol

ENTRY_POINT_GROUP = "qkmap_hf.task_sources"
# ``qkmap analyze --task``'s defaults: the command line owns them, so a source's probe receives them as arguments.
DEFAULT_PROBE_EXAMPLES = 32
DEFAULT_KEY_SCALES = (0.5, 2.0)


class TaskSource(Protocol):
    """What the plugin needs of a task source: parse a ``NAME[:FIELD=VALUE,...]`` spec, build datasets, score."""

    names: tuple[str, ...]
    probed_names: tuple[str, ...]

    def parse(self, spec: str) -> Any: ...

    def spec(self, task: Any) -> str: ...

    def datasets(self, task: Any, length: int, train_examples: int, heldout_blocks: int) -> tuple: ...

    def compute_metrics(self, eval_prediction: Any) -> dict[str, Any]: ...

    def preprocess_logits_for_metrics(self, logits: Any, labels: Any) -> Any: ...

    def probe(
        self, model: Any, task: Any, length: int, examples: int, seed: int, key_scales: tuple[float, ...]
    ) -> dict[str, Any]: ...


@cache
def task_sources() -> tuple[TaskSource, ...]:
    """Every installed source, in entry-point name order (loaded once per process)."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name)
    return tuple(point.load() for point in found)


def source_for(spec: str) -> TaskSource:
    """The source that provides ``spec``'s task name; a name no source provides is refused in one line."""
    name = spec.partition(":")[0]
    sources = task_sources()
    for source in sources:
        if name in source.names:
            return source
    offered = sorted(n for source in sources for n in source.names)
    if not offered:
        raise ValueError(
            f"--task {spec!r}: no task source is installed (entry-point group {ENTRY_POINT_GROUP!r}); "
            "the synthetic tasks come with the research lab: pip install -e . in the qkmap-hf repository."
        )
    raise ValueError(f"--task {spec!r}: unknown task {name!r}; choose one of: {', '.join(offered)}.")


def parse_task(spec: str) -> tuple[TaskSource, Any]:
    """``(source, task)`` for a ``--task`` spec; the source's own parser refuses unknown fields."""
    source = source_for(spec)
    return source, source.parse(spec)
