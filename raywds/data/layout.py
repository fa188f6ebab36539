"""Find the images of an ImageNet tree or any ImageFolder, and their classes.

Layouts read:
- `ROOT/train/<wnid>/*.JPEG`, `ROOT/val/<wnid>/*.JPEG` (torchvision's ImageNet / ImageFolder);
- a flat `ROOT/val/ILSVRC2012_val_00000001.JPEG ...` labelled by Kaggle's `LOC_val_solution.csv`
  (`ImageId,PredictionString`, first token the wnid) or by the devkit's
  `ILSVRC2012_validation_ground_truth.txt` (ILSVRC2012_ID per image) with the wnid of each ID from
  `meta.mat` or from a text file of wnids in ID order;
- any folder of `<class>/**/*.{jpg,jpeg,png,webp}` (any case) without train/ or val/: the `train` split.

Class indices follow sorted class names, as torchvision's ImageFolder does; a class with no
images in a split stays (so the indices still match) and is logged as a warning.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from raywds.data.listed import Tree
from raywds.errors import DataError

SPLITS = ("train", "val")
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
KAGGLE_CSV = "LOC_val_solution.csv"
DEVKIT_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageFile:
    """One image to put in a shard."""

    path: Tree
    relpath: str
    class_name: str
    class_index: int
    num_bytes: int
    key: str


@dataclass
class Found:
    """What a scan found: classes in index order, images per split, and what it ignored."""

    classes: list[str]
    splits: dict[str, list[ImageFile]]
    layouts: dict[str, str]
    ignored: list[str] = field(default_factory=list)
    empty: dict[str, list[str]] = field(default_factory=dict)
    """Split -> the classes it holds no images of."""
    added: list[str] = field(default_factory=list)
    """Classes new to a dataset the scan adds to (scan's `known`), in index order after its own."""


def is_image(path: Tree) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def _files(folder: Tree, ignored: list[str], root: Tree) -> list[Tree]:
    images = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        if is_image(path):
            images.append(path)
        else:
            ignored.append(str(path.relative_to(root)))
    return images


def safe_key(text: str) -> str:
    """`text` as a tar key: webdataset cuts a member name at its first dot into key and
    extension, and a slash would make a folder, so only letters, digits, _ and - are kept."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def read_kaggle_csv(path: Tree) -> dict[str, str]:
    """ImageId -> wnid from Kaggle's LOC_val_solution.csv."""
    labels = {}
    with io.StringIO(path.read_text(), newline="") as f:  # (a Path, or a file in a bucket: raywds.data.listed)
        for row in csv.DictReader(f):
            try:
                labels[row["ImageId"]] = row["PredictionString"].split()[0]
            except (KeyError, IndexError):
                raise DataError(f"{path} is not in Kaggle's form `ImageId,PredictionString` (row {row})") from None
    return labels


def read_wnids_by_id(path: Tree) -> dict[int, str]:
    """ILSVRC2012_ID -> wnid, from the devkit's meta.mat or a text file of wnids in ID order."""
    if path.suffix == ".mat":
        import scipy.io

        synsets = scipy.io.loadmat(io.BytesIO(path.read_bytes()), squeeze_me=True)["synsets"]
        return {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
    wnids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return {i + 1: wnid for i, wnid in enumerate(wnids)}


def read_devkit_labels(truth: Tree, wnids: Tree, images: list[Tree]) -> dict[str, str]:
    """Image stem -> wnid: line N of the ground truth labels ILSVRC2012_val_N."""
    by_id = read_wnids_by_id(wnids)
    ids = [int(line) for line in truth.read_text().split()]
    labels = {}
    for image in images:
        number = re.search(r"(\d+)$", image.stem)
        if number is None or not 1 <= int(number.group(1)) <= len(ids):
            raise DataError(f"{image} has no image number that {truth} ({len(ids)} lines) covers")
        ilsvrc_id = ids[int(number.group(1)) - 1]
        if ilsvrc_id not in by_id:
            raise DataError(f"{truth} gives ILSVRC2012_ID {ilsvrc_id} for {image.name}, which {wnids} lacks")
        labels[image.stem] = by_id[ilsvrc_id]
    return labels


def _find(candidates: list[Tree]) -> Tree | None:
    return next((p for p in candidates if p.is_file()), None)


def flat_val_labels(
    src: Tree, images: list[Tree], val_labels: Path | None, val_wnids: Path | None
) -> tuple[dict[str, str], str]:
    """Labels for a flat val/ folder, from the given files or the usual places; (stem -> wnid, layout)."""
    devkit = src / "ILSVRC2012_devkit_t12" / "data"
    labels_file = val_labels or _find(
        [src / KAGGLE_CSV, src.parent / KAGGLE_CSV, src / DEVKIT_TRUTH, devkit / DEVKIT_TRUTH]
    )
    if labels_file is None:
        raise DataError(
            f"{src / 'val'} holds images without class folders and no labels were found; pass --val-labels "
            f"{KAGGLE_CSV} or --val-labels {DEVKIT_TRUTH} with --val-wnids meta.mat (or a wnids.txt in ID order)"
        )
    if not labels_file.is_file():
        raise DataError(f"validation labels {labels_file} do not exist")
    if labels_file.suffix == ".csv":
        return read_kaggle_csv(labels_file), f"flat val, labels from {labels_file.name}"
    wnids = val_wnids or _find([labels_file.parent / "meta.mat", devkit / "meta.mat"])
    if wnids is None or not wnids.is_file():
        raise DataError(
            f"{labels_file} gives ILSVRC2012_IDs; pass --val-wnids meta.mat (or a text file of wnids in ID order)"
        )
    return read_devkit_labels(labels_file, wnids, images), f"flat val, labels from {labels_file.name} + {wnids.name}"


def scan(
    src: Tree, *, val_labels: Path | None = None, val_wnids: Path | None = None, known: list[str] | None = None
) -> Found:
    """Classes and images of every split under `src`. With `known` (the classes of a dataset that
    `src` adds to), those keep their indices, matched by name ignoring case, and `src`'s other
    classes follow them in sorted order (`Found.added`)."""
    if not src.is_dir():
        raise DataError(f"input directory {src} does not exist; give the folder that holds train/ and val/")
    split_dirs = {s: src / s for s in SPLITS if (src / s).is_dir()} or {"train": src}
    first = split_dirs.get("train", next(iter(split_dirs.values())))
    here = sorted(p.name for p in first.iterdir() if p.is_dir())
    if not here:
        raise DataError(f"{first} has no class folders; expected {first}/<class>/<image>.JPEG")
    classes = here if known is None else _after(known, here)
    index = {name: i for i, name in enumerate(classes)}
    folded = {name.lower(): name for name in classes}
    found = Found(classes=classes, splits={}, layouts={}, added=classes[len(known) :] if known is not None else [])
    for split, folder in split_dirs.items():
        pairs: list[tuple[Tree, str]] = []
        class_dirs = sorted(p for p in folder.iterdir() if p.is_dir())
        if class_dirs:
            for class_dir in class_dirs:
                name = class_dir.name if class_dir.name in index else folded.get(class_dir.name.lower())
                if name is None:
                    raise DataError(f"{class_dir} is a class that {first} lacks; the splits must share classes")
                pairs += [(p, name) for p in _files(class_dir, found.ignored, src)]
            # Files beside the class folders belong to no class.
            found.ignored += [str(p.relative_to(src)) for p in sorted(folder.iterdir()) if p.is_file()]
            found.layouts[split] = "class folders"
        else:
            images = _files(folder, found.ignored, src)
            labels, found.layouts[split] = flat_val_labels(src, images, val_labels, val_wnids)
            for image in images:
                wnid = labels.get(image.stem)
                if wnid is None:
                    raise DataError(f"no label for {image} in the validation labels")
                if wnid not in index:
                    raise DataError(f"{image.name} is labelled {wnid}, which is not a class of {first}")
                pairs.append((image, wnid))
        if not pairs:
            raise DataError(f"no images (.jpg .jpeg .png .webp) under {folder}")
        found.splits[split] = _sources(pairs, src, index)
        if known is None:  # (a dataset's own classes that `src` adds no images to are not empty)
            _warn_empty(found, split, first)
    return found


def _after(known: list[str], here: list[str]) -> list[str]:
    """`known`, then the names in `here` that match none of them ignoring case, sorted; a name that
    matches two known classes ignoring case is refused (which would it add to?)."""
    folded: dict[str, list[str]] = {}
    for name in known:
        folded.setdefault(name.lower(), []).append(name)
    for name in here:
        if name not in known and len(folded.get(name.lower(), [])) > 1:
            raise DataError(
                f"class folder {name!r} matches {' and '.join(folded[name.lower()])} of the dataset ignoring case; "
                "rename it to the one it adds to"
            )
    return [*known, *sorted(name for name in here if name.lower() not in folded)]


def _warn_empty(found: Found, split: str, first: Tree) -> None:
    """Log the classes without images in `split`: an empty class folder is most often a mistake."""
    have = {s.class_name for s in found.splits[split]}
    empty = [(i, name) for i, name in enumerate(found.classes) if name not in have]
    if not empty:
        return
    found.empty[split] = [name for _, name in empty]
    named = ", ".join(f"{name} (index {i})" for i, name in empty[:10]) + (
        f" and {len(empty) - 10} more" if len(empty) > 10 else ""
    )
    log.warning(
        f"{len(empty)} {'classes have' if len(empty) > 1 else 'class has'} no {split} images: {named}; "
        "kept in the class list so the other indices match ImageFolder's sorted order; "
        f"add their images, or remove empty class folders from {first}"
    )


def _sources(pairs: list[tuple[Tree, str]], src: Tree, index: dict[str, int]) -> list[ImageFile]:
    """Sources with keys unique in the split: the file stem, else class_stem, else numbered;
    each made safe as a whole, since a class name may hold a dot too."""
    used: set[str] = set()
    sources = []
    for path, name in pairs:
        key = safe_key(path.stem)
        if key in used:
            key = safe_key(f"{name}_{path.stem}")
        base, n = key, 1
        while key in used:
            key, n = f"{base}_{n}", n + 1
        used.add(key)
        sources.append(ImageFile(path, str(path.relative_to(src)), name, index[name], path.stat().st_size, key))
    return sources
