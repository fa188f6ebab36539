"""Which member of a sample is its image and which its label (raywds.loader.labels.Labels), for
raywds's own shards (.jpg and .cls) and for shards others wrote as `raywds index` records them;
and the Ray Data plane's rows, which carry the same labels (raywds.loader.plane)."""

from __future__ import annotations

import json

import pytest

from raywds.data.members import Members
from raywds.loader.labels import Labels
from raywds.loader.plane import _row


def sample(**members: bytes) -> dict:
    return {"__key__": "k1", "__url__": "u", "__id__": 3, **members}


def test_own_shards_read_jpg_and_cls_as_before() -> None:
    labels = Labels()
    s = sample(jpg=b"J", cls=b"7")
    assert labels.image(s) == "jpg" and labels.members.label_member(s) == "cls"
    assert labels.label(s, "cls") == 7
    with pytest.raises(ValueError, match=r"class b'n01440764' is not a number"):
        labels.label(sample(cls=b"n01440764"), "cls")


def test_a_json_field_by_class_name_maps_to_the_manifests_class_order() -> None:
    members = Members(image=("png",), label="json", label_field="label", label_names=True, drop_incomplete=True)
    labels = Labels(members, ["cat", "dog", "eel"])
    s = sample(png=b"P", json=json.dumps({"label": "eel"}).encode())
    assert labels.image(s) == "png" and labels.label(s, "json") == 2
    with pytest.raises(ValueError, match=r"class 'fox' is not one of the manifest's 3 classes"):
        labels.label(sample(json=b'{"label": "fox"}'), "json")
    with pytest.raises(ValueError, match=r"nor JSON with 'label'"):
        labels.label(sample(json=b'{"other": 1}'), "json")


def test_an_integer_label_outside_the_classes_is_refused_not_trained_on() -> None:
    members = Members(label="", label_keys=("cls", "label", "target"), drop_incomplete=True)
    labels = Labels(members, ["0", "1", "2"])
    assert labels.members.label_member(sample(jpg=b"", target=b"2")) == "target"
    assert labels.label(sample(target=b" 2\n"), "target") == 2
    with pytest.raises(ValueError, match=r"class 3 is outside the manifest's 3 classes"):
        labels.label(sample(target=b"3"), "target")


def test_incomplete_samples_are_what_the_index_left_out() -> None:
    members = Members(image=("jpg", "png"), label="cls", drop_incomplete=True)
    assert members.usable(sample(png=b"", cls=b"1"))
    assert not members.usable(sample(png=b""))  # no label
    assert not members.usable(sample(cls=b"1", json=b"{}"))  # no image


def test_the_planes_rows_carry_the_index_of_a_label_by_name() -> None:
    members = Members(image=("webp",), label="json", label_field="y", label_names=True, drop_incomplete=True)
    labels = Labels(members, ["a", "b"])
    row = _row(sample(webp=b"W", json=b'{"y": "b"}'), labels=labels)
    assert (row["member"], row["image"], row["cls"]) == ("webp", b"W", b"1")
    assert _row(sample(webp=b"W", json=b'{"y": "z"}'), labels=labels)["cls"] == b'{"y": "z"}', "refused when decoded"
    assert _row(sample(jpg=b"J", cls=b"4"))["cls"] == b"4", "own shards: the .cls bytes as they are"
