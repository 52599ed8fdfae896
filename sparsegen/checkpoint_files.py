"""The files of a checkpoint directory (config.json, *.safetensors and the shard index
model.safetensors.index.json), read without unpickling anything, every failure an
InputError naming the file.

With an index, exactly the shards it names are read, each must exist and hold exactly the
tensors the index puts in it: a stray *.safetensors beside them is never read. Without one,
every *.safetensors file is read and a tensor held by two files is refused (which would win
would depend on the order of a directory listing).
"""
from __future__ import annotations

import pathlib

import torch

from .errors import InputError, expect
from .jit import private_files

INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # a config or an index of a model with a million tensors is well under this


def read_json(path: pathlib.Path) -> dict:
    """A JSON object from `path`: a regular file (a FIFO or a device is refused unread) of at
    most MAX_JSON_BYTES, parsed within private_files.parse_json's bounds (InputError naming
    the file for anything else)."""
    expect(path.is_file(), f"a file {path.name} in the checkpoint directory", str(path))
    try:
        value = private_files.parse_json(private_files.read_regular(path, MAX_JSON_BYTES, follow_links=True))
    except (OSError, ValueError) as error:
        raise InputError(f"Expected {path} to hold JSON. Got {type(error).__name__}: {error}.") from None
    expect(isinstance(value, dict), f"{path} to hold a JSON object", type(value).__name__)
    return value


def read_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name, from the shards the index names (or every
    *.safetensors file where there is no index)."""
    if (folder / INDEX).exists():
        return _indexed_tensors(folder, read_json(folder / INDEX))
    files = [folder / name for name in private_files.list_names(folder) if name.endswith(".safetensors")]
    expect(files, "*.safetensors files in the checkpoint directory", str(folder))
    tensors: dict[str, torch.Tensor] = {}
    holder: dict[str, str] = {}
    for file in files:
        for name, tensor in _read_file(file).items():
            expect(name not in tensors, f"each tensor in one file of {folder} (or a {INDEX} saying which)",
                   f"{name!r} in both {holder.get(name)} and {file.name}")
            tensors[name], holder[name] = tensor, file.name
    return tensors


def _indexed_tensors(folder: pathlib.Path, index: dict) -> dict[str, torch.Tensor]:
    weight_map = index.get("weight_map")
    expect(isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values()),
           f"a 'weight_map' of tensor names to file names in {folder / INDEX}", type(weight_map).__name__)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        path = folder / shard
        expect(pathlib.Path(shard).name == shard and path.is_file(),
               f"the shard {shard!r} that {INDEX} names, in {folder}", "no such file")
        held = _read_file(path)
        named = {name for name, file in weight_map.items() if file == shard}
        expect(set(held) == named, f"{shard} to hold the tensors {INDEX} puts in it",
               _difference(named, set(held)))
        tensors.update(held)
    return tensors


def _difference(named: set, held: set) -> str:
    lacking, extra = sorted(named - held), sorted(held - named)
    return "; ".join(part for part in (f"lacking {lacking[:5]}" if lacking else "",
                                       f"also {extra[:5]}, which the index does not name" if extra else "") if part)


def _read_file(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (a format with no code in it): a regular file
    (a FIFO would block the reader forever, a device never end)."""
    expect(path.is_file(), f"{path.name} to be a regular file", "a FIFO, a device or a folder")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise InputError("Expected the safetensors package (pip install safetensors) to read checkpoints. "
                         "Got none.") from None
    try:
        return load_file(str(path))
    except Exception as error:  # (safetensors raises its own SafetensorError, or OSError)
        raise InputError(f"Expected {path} to be a whole safetensors file. Got {type(error).__name__}: {error}.") \
            from None
