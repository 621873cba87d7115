"""The label space of a mixture: each source's class ids mapped into one set of classes.

`offset`: each source's class ids after the previous sources' (the head covers the sum);
`by_name`: one class per distinct name, in the order first seen over the sources.
"""

from __future__ import annotations

import torch

from .index import DatasetError, DatasetIndex


class MixtureIndex:
    """What the trainer reads of a dataset, for the mixture: classes in the label space, labelled."""

    def __init__(self, indexes: list[DatasetIndex], urls: list[str], label_space: str):
        self.labelled = all(ix.labelled for ix in indexes)
        self.maps: list[torch.Tensor] = []
        if label_space == "offset":
            names: list[str] = []
            for ix in indexes:
                count = ix.num_classes or 0
                self.maps.append(torch.arange(len(names), len(names) + count))
                names += [f"{len(self.maps) - 1}/{c}" for c in (ix.classes or map(str, range(count)))]
        else:
            ids: dict[str, int] = {}
            for url, ix in zip(urls, indexes):
                if ix.num_classes and not ix.classes:
                    raise DatasetError(
                        f"{url}: data.label_space=by_name needs the class names of dataset.json; "
                        "these shards have class ids only"
                    )
                if ix.classes and len(set(ix.classes)) != len(ix.classes):
                    raise DatasetError(f"{url}: its class names repeat, so by name they would merge classes")
                self.maps.append(
                    torch.tensor([ids.setdefault(c, len(ids)) for c in (ix.classes or [])], dtype=torch.int64)
                )
            names = list(ids)
        self.classes = names
        self.num_classes = len(names) or None
        self.label_space = label_space
        self._first = indexes[0].classes if indexes else None

    def check_eval(self, classes: list[str] | None, url: str) -> None:
        """A held-out set scored against this label space: its class i must be the mixture's class
        i (by name; with `offset`, the first source's classes), else its accuracy would be wrong."""
        if not classes:
            return
        if self.label_space == "by_name":
            wrong = [(i, c) for i, c in enumerate(classes) if i >= len(self.classes) or self.classes[i] != c]
            mixture = self.classes
        else:
            wrong = [] if classes == (self._first or [])[: len(classes)] else [(0, classes[0])]
            mixture = self._first or []
        if wrong:
            i, name = wrong[0]
            raise DatasetError(
                f"data.val {url}: its class {i} is {name!r}, the mixture's is "
                f"{mixture[i] if i < len(mixture) else 'none'!r} (data.label_space={self.label_space}): "
                "evaluate on a set whose classes are the mixture's, in its order"
            )
