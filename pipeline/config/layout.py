"""How a split's rows become the model's input and target, as ``source.*`` says (:class:`Layout`): read by the data
layer to build the batches and by the training workers to take them apart."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from pipeline.config.schema import OnMissing, SourceConfig


@dataclass(frozen=True)
class Layout:
    """How rows become the model's input and target, as ``source`` says: the ``inputs`` columns are read,
    stacked into one vector column ``features`` when ``source.feature_column`` lists several (a table);
    ``model_input`` is the column the model takes, ``label`` its target."""

    inputs: list[str]
    model_input: str
    label: str
    _: KW_ONLY
    stacked: bool
    on_missing: OnMissing = OnMissing[
        "raise"
    ]  # a table's missing, NaN or infinite values: raise, drop the row, or the mean
    classes: list[str] | None = None  # labels that are class names, made their index here

    @classmethod
    def of(cls, source: SourceConfig) -> Layout:
        features, label = source.feature_column, source.label_column
        settings = {"on_missing": source.on_missing, "classes": source.classes}
        if isinstance(features, list):
            return cls(list(features), "features", label, stacked=True, **settings)
        return cls([features], features, label, stacked=False, **settings)
