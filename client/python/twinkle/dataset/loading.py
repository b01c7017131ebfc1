"""Reading rows (dicts) from local data: JSON Lines, JSON, Parquet, CSV, text, and directories
written by the `datasets` library's save_to_disk (Arrow files), or holding such files by split.

Hub ids (ms://..., hf://..., org/name that is not a local path) are refused with
HubNotAvailableError: this client never downloads data.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from twinkle.dataset.meta import DatasetMeta
from twinkle.hub import HubNotAvailableError, local_path, strip_hub_scheme

Row = dict[str, Any]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def load_rows(meta: DatasetMeta) -> list[Row]:
    """Every row meta names, data_slice applied."""
    path = local_path(meta.dataset_id)
    if path is None:
        name = strip_hub_scheme(meta.dataset_id)
        raise HubNotAvailableError(
            f"dataset '{meta.dataset_id}' is not a local file or directory. twinkle-server-client reads "
            "local data only and never downloads from ModelScope or the Hugging Face Hub (offline use): "
            f"download '{name}' yourself (e.g. `modelscope download --dataset {name} --local_dir ./data`, "
            "or datasets' load_dataset(...).save_to_disk('./data')) and pass the path of a "
            ".jsonl/.json/.parquet/.csv/.txt file or of that directory"
        )
    rows = read_file(path) if path.is_file() else read_directory(path, meta.subset_name, meta.split)
    return meta.select(rows)


def read_file(path: Path) -> list[Row]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_json_lines(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _pyarrow_rows(path, "parquet")
    if suffix == ".arrow":
        return _pyarrow_rows(path, "arrow")
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return [dict(r) for r in csv.DictReader(f)]
    if suffix == ".txt":
        with path.open(encoding="utf-8") as f:
            return [{"text": line.rstrip("\n")} for line in f]
    raise ValueError(f"{path}: unsupported data file type '{suffix}' (supported: {', '.join(DATA_SUFFIXES)})")


def read_directory(path: Path, subset: str, split: str) -> list[Row]:
    """A save_to_disk directory (Dataset or DatasetDict), or a directory of data files."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        if split not in splits:
            raise ValueError(f"{path}: no split '{split}' (splits: {splits})")
        return read_directory(path / split, subset, split)
    if (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        files = [path / f["filename"] for f in state.get("_data_files", [])]
        if not files:
            raise ValueError(f"{path}/state.json lists no data files")
        return [row for f in files for row in _pyarrow_rows(f, "arrow")]
    if subset not in ("", "default") and (path / subset).is_dir():
        path = path / subset
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                   and not p.name.startswith("."))
    if not files:
        raise ValueError(f"{path}: no data files ({', '.join(DATA_SUFFIXES)})")
    chosen = [p for p in files if _names_split(p.relative_to(path), split)]
    if not chosen:
        if split != "train":
            raise ValueError(f"{path}: no data files for split '{split}'")
        chosen = files
    return [row for f in chosen for row in read_file(f)]


def _names_split(relative: Path, split: str) -> bool:
    return any(part == split or part.split(".")[0] == split or part.startswith(split + "-")
               or part.startswith(split + "_") for part in relative.parts)


def _read_json_lines(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(_as_row(json.loads(line), path))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
    return rows


def _read_json(path: Path) -> list[Row]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_json_lines(path)  # JSON Lines saved as .json, which datasets also reads
    if isinstance(data, list):
        return [_as_row(r, path) for r in data]
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if lists and len(lists) == len(data) and len({len(v) for v in lists.values()}) == 1:
            count = len(next(iter(lists.values())))
            return [{k: v[i] for k, v in lists.items()} for i in range(count)]  # columns
        if len(lists) == 1 and all(isinstance(r, dict) for r in next(iter(lists.values()))):
            return [dict(r) for r in next(iter(lists.values()))]  # {"data": [rows]}
        return [data]
    raise ValueError(f"{path}: expected a JSON list of objects")


def _as_row(value: Any, path: Path) -> Row:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: each row must be a JSON object, got {type(value).__name__}")
    return value


def _pyarrow_rows(path: Path, kind: str) -> list[Row]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"reading {path.name} needs pyarrow: pip install 'twinkle-server-client[data]'"
        ) from exc
    if kind == "parquet":
        table = pq.read_table(path)
    else:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()  # save_to_disk writes streams
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()
