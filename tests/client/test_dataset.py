"""Datasets from real files: JSON Lines, JSON, CSV, Parquet (pyarrow) and directories written by
the datasets library's save_to_disk; map / filter / encode / packing on the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import datasets as hf_datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twinkle.data_format import Message, Trajectory
from twinkle.dataset import Dataset, DatasetMeta, HubNotAvailableError, PackingDataset
from twinkle.preprocessor import DataFilter, Preprocessor, SelfCognitionProcessor

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}, made by {{AUTHOR}}.", "tag": "a"},
    {"query": "What is {{NAME}}?", "response": "{{NAME}} is a model by {{AUTHOR}}.", "tag": "b"},
    {"query": "Hello", "response": "Hi, I am {{NAME}}.", "tag": "c"},
]


def write_jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json_list", "json_columns", "json_lines_as_json", "csv", "parquet",
                                  "arrow_dir", "dataset_dict_dir", "split_files_dir"])
def test_every_local_format_reads_the_same_rows(tmp_path, kind):
    if kind == "jsonl":
        source = write_jsonl(tmp_path / "d.jsonl")
    elif kind == "json_list":
        source = tmp_path / "d.json"
        source.write_text(json.dumps(ROWS))
    elif kind == "json_columns":
        source = tmp_path / "d.json"
        source.write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))
    elif kind == "json_lines_as_json":
        source = write_jsonl(tmp_path / "d.json")
    elif kind == "csv":
        source = tmp_path / "d.csv"
        hf_datasets.Dataset.from_list(ROWS).to_csv(str(source), index=False)
    elif kind == "parquet":
        source = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), source)
    elif kind == "arrow_dir":
        source = tmp_path / "saved"
        hf_datasets.Dataset.from_list(ROWS).save_to_disk(str(source))
    elif kind == "dataset_dict_dir":
        source = tmp_path / "saved-dict"
        hf_datasets.DatasetDict({"train": hf_datasets.Dataset.from_list(ROWS),
                                 "test": hf_datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(source))
    else:
        source = tmp_path / "repo"
        (source / "data").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(ROWS), source / "data" / "train-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS[:1]), source / "data" / "test-00000-of-00001.parquet")
    dataset = Dataset(DatasetMeta(str(source)))
    assert dataset.to_list() == ROWS
    if kind in ("dataset_dict_dir", "split_files_dir"):
        assert Dataset(DatasetMeta(str(source), split="test")).to_list() == ROWS[:1]
        with pytest.raises(ValueError, match="split"):
            Dataset(DatasetMeta(str(source), split="validation"))


def test_hf_dataset_features_survive(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "x"}], "nums": [1, 2, 3], "target": 6}]
    hf_datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "nested"))
    assert Dataset(DatasetMeta(str(tmp_path / "nested"))).to_list() == rows


def test_data_slice_picks_rows_in_order_and_wraps(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    dataset = Dataset(DatasetMeta(str(source), data_slice=range(5)))
    assert [r["tag"] for r in dataset] == ["a", "b", "c", "a", "b"]
    assert [r["tag"] for r in Dataset(DatasetMeta(str(source), data_slice=[2, 0]))] == ["c", "a"]


@pytest.mark.parametrize("dataset_id", ["ms://swift/self-cognition", "hf://openai/gsm8k", "swift/self-cognition"])
def test_hub_ids_are_refused_with_directions(dataset_id):
    with pytest.raises(HubNotAvailableError, match="never downloads") as info:
        Dataset(DatasetMeta(dataset_id, data_slice=range(10)))
    assert "swift/self-cognition" in str(info.value) or "openai/gsm8k" in str(info.value)


def test_map_with_instance_name_and_function(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    a = Dataset(DatasetMeta(str(source)))
    a.map(SelfCognitionProcessor("Twinkle", "ModelScope"), load_from_cache_file=False)
    b = Dataset(DatasetMeta(str(source)))
    b.map("SelfCognitionProcessor", init_args={"model_name": "Twinkle", "model_author": "ModelScope"})
    assert a.to_list() == b.to_list()
    first = a[0]
    assert first["messages"][2] == {"role": "assistant", "content": "I am Twinkle, made by ModelScope."}
    assert first["tag"] == "a"  # other columns stay, as with datasets.map
    c = Dataset(DatasetMeta(str(source)))
    c.map(lambda row: {"upper": row["query"].upper()}, remove_columns=["response"])
    assert c[0] == {"query": "Who are you?", "tag": "a", "upper": "WHO ARE YOU?"}


def test_map_batched_function_and_explode(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    d = Dataset(DatasetMeta(str(source)))
    d.map(lambda cols: {"n": [len(q) for q in cols["query"]]}, batched=True)
    assert [r["n"] for r in d] == [len(r["query"]) for r in ROWS]

    class Twice(Preprocessor):
        def __call__(self, row):
            return [Trajectory(messages=[Message(role="user", content=row["query"])])] * 2

    d.map(Twice())
    assert len(d) == 6


def test_filter_and_unknown_options(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl")
    d = Dataset(DatasetMeta(str(source)))

    class NotHello(DataFilter):
        def __call__(self, row):
            return row["query"] != "Hello"

    d.filter(NotHello())
    assert [r["tag"] for r in d] == ["a", "b"]
    with pytest.raises(TypeError, match="unexpected"):
        d.map(lambda r: r, not_an_option=True)
    with pytest.raises(ValueError, match="unknown Preprocessor"):
        d.map("NoSuchProcessor")


def test_encode_adds_features_and_keeps_columns(tmp_path, tokenizer_dir):
    source = write_jsonl(tmp_path / "d.jsonl")
    d = Dataset(DatasetMeta(str(source), data_slice=range(3)))
    d.set_template("Qwen3_5Template", model_id=str(tokenizer_dir), max_length=256)
    d.map(SelfCognitionProcessor("twinkle model", "twinkle team"), load_from_cache_file=False)
    d.encode(batched=True, load_from_cache_file=False)
    for row in d:
        assert {"input_ids", "labels", "attention_mask", "position_ids", "length", "messages", "tag"} <= set(row)
        assert row["length"] == len(row["input_ids"])
        assert (row["labels"] != -100).any()
    prompts = Dataset(DatasetMeta(str(source)))
    prompts.set_template("Qwen3_5Template", model_id=str(tokenizer_dir))
    prompts.map(lambda r: {"messages": [{"role": "user", "content": r["query"]}]})
    prompts.encode(add_generation_prompt=True)
    assert all((r["labels"] == -100).all() for r in prompts)
    with pytest.raises(ValueError, match="set_template"):
        Dataset(DatasetMeta(str(source))).encode()


def test_packing_keeps_every_sequence_and_respects_max_length(tmp_path, tokenizer_dir):
    rows = [{"query": f"Question number {i}?" + " more" * (i % 7), "response": "Answer " * (1 + i % 5)}
            for i in range(40)]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    plain = Dataset(DatasetMeta(str(source)))
    packed = PackingDataset(DatasetMeta(str(source)))
    for d in (plain, packed):
        d.map(SelfCognitionProcessor("n", "a"))
        d.set_template("Qwen3_5Template", model_id=str(tokenizer_dir), max_length=128)
        d.encode()
    packed.pack_dataset()
    assert len(packed) < len(plain)
    pieces = []
    for row in packed:
        assert row["length"] == len(row["input_ids"]) <= 128
        starts = np.flatnonzero(row["position_ids"] == 0).tolist() + [row["length"]]
        for s, e in zip(starts, starts[1:]):
            assert row["position_ids"][s:e].tolist() == list(range(e - s))
            pieces.append((tuple(row["input_ids"][s:e].tolist()), tuple(row["labels"][s:e].tolist())))
    original = [(tuple(r["input_ids"].tolist()), tuple(r["labels"].tolist())) for r in plain]
    assert sorted(pieces) == sorted(original)


def test_add_and_mix_datasets(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"v": i} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"v": 10 + i} for i in range(2)])
    d = Dataset(DatasetMeta(str(a)))
    d.add_dataset(DatasetMeta(str(b)))
    d.mix_dataset(interleave=True)
    assert [r["v"] for r in d] == [0, 10, 1, 11]
    d.mix_dataset(interleave=False)
    assert [r["v"] for r in d] == [0, 1, 2, 10, 11]
    d.map(lambda r: {"w": r["v"] * 2}, dataset_meta=DatasetMeta(str(b)))
    with pytest.raises(ValueError, match="several datasets"):
        d.map(lambda r: r)
