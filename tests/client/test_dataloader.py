"""DataLoader batching, seeded shuffling and resuming from consumed samples."""

from __future__ import annotations

import pytest

from twinkle.dataloader import DataLoader


def ids(batches):
    return [row["id"] for batch in batches for row in batch]


def rows(n):
    return [{"id": i} for i in range(n)]


def test_batches_len_and_drop_last():
    loader = DataLoader(rows(10), batch_size=4)
    batches = list(loader)
    assert [len(b) for b in batches] == [4, 4, 2] and len(loader) == 3
    assert ids(batches) == list(range(10))
    dropped = DataLoader(rows(10), batch_size=4, drop_last=True)
    assert [len(b) for b in dropped] == [4, 4] and len(dropped) == 2


def test_callable_dataset_and_collate():
    loader = DataLoader(lambda: rows(3), batch_size=2, collate_fn=lambda b: [r["id"] for r in b])
    assert list(loader) == [[0, 1], [2]]


def test_shuffle_is_seeded_and_differs_per_epoch():
    a = DataLoader(rows(50), batch_size=8, shuffle=True, seed=7)
    b = DataLoader(rows(50), batch_size=8, shuffle=True, seed=7)
    c = DataLoader(rows(50), batch_size=8, shuffle=True, seed=8)
    first_a, first_b, first_c = ids(a), ids(b), ids(c)
    assert first_a == first_b != first_c
    assert sorted(first_a) == list(range(50)) and first_a != list(range(50))
    second_a = ids(a)
    assert sorted(second_a) == list(range(50)) and second_a != first_a
    assert a.get_state() == {"consumed_train_samples": 100}


def take_batches(loader, count):
    """count batches, continuing into the next epoch when one ends."""
    taken = []
    while len(taken) < count:
        for batch in loader:
            taken.append(batch)
            if len(taken) == count:
                break
    return taken


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6, 7, 9])
def test_resume_continues_exactly_where_the_state_says(stop_after):
    def make():
        return DataLoader(rows(23), batch_size=4, shuffle=True, seed=3)

    reference = make()
    full = ids(reference) + ids(reference)  # two epochs of 6 batches each
    interrupted = make()
    seen = ids(take_batches(interrupted, stop_after))
    state = interrupted.get_state()
    assert state["consumed_train_samples"] == len(seen)
    resumed = make()
    resumed.resume_from_checkpoint(state["consumed_train_samples"])
    rest = []
    while len(seen) + len(rest) < len(full):
        rest.extend(ids(resumed))
    assert seen + rest == full


def test_resume_accepts_the_progress_dict_and_rejects_negatives():
    loader = DataLoader(rows(5), batch_size=2)
    loader.resume_from_checkpoint({"consumed_train_samples": 3, "cur_step": 1})
    assert ids(loader) == [3, 4]
    with pytest.raises(ValueError):
        loader.resume_from_checkpoint(-1)
    with pytest.raises(TypeError, match="unexpected"):
        DataLoader(rows(5), batch_size=2, bogus=1)
