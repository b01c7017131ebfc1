"""Dataset: rows in memory, transformed in place by map / filter / encode, as Twinkle's Dataset.

Twinkle's Dataset wraps a `datasets.Dataset`; this one keeps plain dict rows, which is all a
client-side pipeline needs, and accepts (and ignores) the `datasets.map` options the
cookbooks pass (batched, load_from_cache_file, num_proc, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import twinkle.preprocessor as preprocessor_module
import twinkle.template as template_module
from twinkle.dataset.loading import Row, load_rows
from twinkle.dataset.meta import DatasetMeta
from twinkle.preprocessor import DataFilter, Preprocessor
from twinkle.template import Template
from twinkle.utils import construct_class

# `datasets.map` options the cookbooks pass; they change nothing here.
_IGNORED_MAP_OPTIONS = frozenset({
    "load_from_cache_file", "num_proc", "batch_size", "desc", "keep_in_memory", "cache_file_name",
    "writer_batch_size", "new_fingerprint", "with_indices", "timeout",
})


class Dataset:
    """Rows loaded from dataset_meta (see DatasetMeta and twinkle.dataset.loading)."""

    def __init__(self, dataset_meta: DatasetMeta, **kwargs: Any) -> None:
        rows = load_rows(dataset_meta)
        self.datasets: dict[str, list[Row]] = {dataset_meta.get_id(): rows}
        self.dataset: list[Row] = rows
        self.template: Template | None = None

    # ---- composition -------------------------------------------------------------------

    def add_dataset(self, dataset_meta: DatasetMeta, **kwargs: Any) -> None:
        """Load another dataset; mix_dataset combines them."""
        self.datasets[dataset_meta.get_id()] = load_rows(dataset_meta)

    def mix_dataset(self, interleave: bool = True) -> None:
        """Combine the added datasets: alternate rows until one runs out, or concatenate."""
        parts = list(self.datasets.values())
        if len(parts) < 2:
            return
        if interleave:
            shortest = min(len(p) for p in parts)
            self.dataset = [part[i] for i in range(shortest) for part in parts]
        else:
            self.dataset = [row for part in parts for row in part]

    # ---- transformations ---------------------------------------------------------------

    def set_template(self, template_func: Template | type[Template] | str, **kwargs: Any) -> None:
        """The template encode uses: a Template, its class, or a class name in twinkle.template
        (e.g. 'Qwen3_5Template'), built with kwargs (model_id, max_length, ...)."""
        self.template = construct_class(template_func, Template, template_module, **kwargs)

    def map(self, preprocess_func: Preprocessor | Callable[..., Any] | str | type[Preprocessor],
            dataset_meta: DatasetMeta | None = None, init_args: Mapping[str, Any] | None = None,
            batched: bool = False, remove_columns: Sequence[str] | str | None = None,
            **kwargs: Any) -> None:
        """Apply a preprocessor (a Preprocessor, its class, a class name in twinkle.preprocessor)
        or a function to every row, in place.

        A row's result updates the row (its other columns stay, as with datasets.map); a list
        of results makes several rows; None leaves the row as it is. With batched=True a plain
        function gets and returns columns ({'col': [...]}) instead.
        """
        _check_options(kwargs)
        func = construct_class(preprocess_func, Preprocessor, preprocessor_module, **dict(init_args or {}))
        removed = {remove_columns} if isinstance(remove_columns, str) else set(remove_columns or ())
        key = self._key(dataset_meta)
        rows = self.datasets[key]
        if batched and not isinstance(func, Preprocessor):
            produced = _map_batched(func, rows)
            out = [{k: v for k, v in row.items() if k not in removed} for row in produced]
        else:
            out = []
            for row in rows:
                base = {k: v for k, v in row.items() if k not in removed}
                result = func(row)
                if result is None:
                    out.append(base)
                elif isinstance(result, list):
                    out.extend({**base, **dict(r)} for r in result)
                else:
                    out.append({**base, **dict(result)})
        self._store(key, out)

    def filter(self, filter_func: DataFilter | Callable[..., Any] | str | type[DataFilter],
               dataset_meta: DatasetMeta | None = None, init_args: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        """Keep the rows for which the filter returns True."""
        _check_options(kwargs, {"batched"})
        func = construct_class(filter_func, DataFilter, preprocessor_module, **dict(init_args or {}))
        key = self._key(dataset_meta)
        self._store(key, [row for row in self.datasets[key] if func(row)])

    def encode(self, add_generation_prompt: bool = False, **kwargs: Any) -> None:
        """Encode every row with the template, in place: each row gains input_ids, labels,
        attention_mask, position_ids and length (its other columns stay). Rows that encode to
        nothing (truncation 'delete') are dropped; 'split' makes several rows."""
        _check_options(kwargs, {"batched"})
        template = self._require_template()
        out = []
        for row in self.dataset:
            for feature in template.batch_encode([row], add_generation_prompt=add_generation_prompt):
                if len(feature["input_ids"]) > 0:
                    out.append({**row, **feature})
        self._store_current(out)

    def check(self, **kwargs: Any) -> None:
        """Drop the rows the template cannot encode (e.g. longer than max_length)."""
        _check_options(kwargs, {"batched"})
        template = self._require_template()
        self._store_current([row for row in self.dataset if template.check(row) is not None])

    # ---- access ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int | slice) -> Any:
        return self.dataset[index]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.dataset)

    def to_list(self) -> list[Row]:
        return list(self.dataset)

    # ---- internals ---------------------------------------------------------------------

    def _key(self, dataset_meta: DatasetMeta | None) -> str:
        if dataset_meta is not None:
            key = dataset_meta.get_id()
            if key not in self.datasets:
                raise KeyError(f"no dataset {dataset_meta.dataset_id} (split {dataset_meta.split}) was added")
            return key
        if len(self.datasets) != 1:
            raise ValueError("several datasets were added: pass dataset_meta= to say which one")
        return next(iter(self.datasets))

    def _store(self, key: str, rows: list[Row]) -> None:
        self.datasets[key] = rows
        if len(self.datasets) == 1:
            self.dataset = rows

    def _store_current(self, rows: list[Row]) -> None:
        if len(self.datasets) == 1:
            self._store(next(iter(self.datasets)), rows)
        else:
            self.dataset = rows

    def _require_template(self) -> Template:
        if self.template is None:
            raise ValueError("call set_template(...) before encode() / check()")
        return self.template


def _check_options(kwargs: Mapping[str, Any], also: set[str] | frozenset[str] = frozenset()) -> None:
    unknown = set(kwargs) - _IGNORED_MAP_OPTIONS - set(also)
    if unknown:
        raise TypeError(f"unexpected argument(s): {sorted(unknown)}")


def _map_batched(func: Callable[..., Any], rows: list[Row], size: int = 1000) -> list[Row]:
    out: list[Row] = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        columns = {k: [r.get(k) for r in chunk] for k in chunk[0]} if chunk else {}
        result = func(columns)
        if result is None:
            out.extend(chunk)
            continue
        merged = {**columns, **dict(result)}
        lengths = {len(v) for v in merged.values()}
        if len(lengths) > 1:
            raise ValueError(f"batched map returned columns of different lengths {sorted(lengths)}")
        count = lengths.pop() if lengths else 0
        out.extend({k: v[i] for k, v in merged.items()} for i in range(count))
    return out
