"""Publishing an output assembled on this machine to a ``pyarrow.fs`` URI (``s3://…``, ``gs://…``).

An object store has no rename, so the commit point is the manifest, written last:

- a file output is one object, written whole (a reader sees the old one or the new one), then its manifest;
- a directory output's shards are written under names of their own (``part-<publish id>-NNNNN.parquet``) beside the
  old ones, then the manifest, which lists them (``files``), then the shards no manifest lists any more are
  deleted. A reader that reads the files its manifest lists sees the old output or the new, never a mix; one
  that lists the prefix may see both between the new shards' upload and the old ones' removal.

A failed copy leaves the previous output and manifest in place, and the same command publishes again.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.problems import RunError


def output_filesystem(uri: str):
    """(pyarrow filesystem, path in it) for an output URI; ``RunError`` naming it when pyarrow cannot open it."""
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise RunError(f"output {uri}: not a URI pyarrow.fs can write ({e})") from None


def manifest_key(path: str) -> str:
    return path.rstrip("/") + ".manifest.json"


def remote_exists(uri: str) -> bool:
    """Whether the output at ``uri`` is there: its manifest (the commit point) and its data (a file, or shards)."""
    fs, path = output_filesystem(uri)
    return all(fs.get_file_info(p).type != pafs.FileType.NotFound for p in (manifest_key(path), path.rstrip("/")))


def publish_output(local: Path, uri: str, manifest: Path) -> None:
    """Copy an assembled output (a file, or a directory of ``part-*.parquet`` shards) and then its manifest to
    ``uri`` (the module's doc: what a reader sees meanwhile)."""
    fs, path = output_filesystem(uri)
    path = path.rstrip("/")
    local_fs = pafs.LocalFileSystem()
    try:
        data = json.loads(manifest.read_text())
        if local.is_dir():
            fs.create_dir(path, recursive=True)
            tag = uuid.uuid4().hex[:8]
            files = []
            for shard in sorted(local.glob("part-*.parquet")):
                name = f"part-{tag}-{shard.name[len('part-'):]}"
                pafs.copy_files(str(shard), f"{path}/{name}", source_filesystem=local_fs, destination_filesystem=fs)
                files.append(name)
            data["files"] = files
        else:
            fs.create_dir(path.rpartition("/")[0] or path, recursive=True)
            pafs.copy_files(str(local), path, source_filesystem=local_fs, destination_filesystem=fs)
        write_manifest(fs, manifest_key(path), json.dumps(data, indent=2).encode())
        if local.is_dir():
            _remove_unlisted(fs, path, set(data["files"]))
    except (pa.ArrowException, OSError) as e:
        raise RunError(f"cannot copy the output to {uri} ({e}); it is complete in {local}, and the same command "
                       "again copies it") from None


def write_manifest(fs, key: str, data: bytes) -> None:
    """The commit: one object, written whole."""
    with fs.open_output_stream(key) as out:
        out.write(data)


def _remove_unlisted(fs, path: str, files: set[str]) -> None:
    """The shards of earlier outputs (any object under the prefix that the new manifest does not list)."""
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        if info.type == pafs.FileType.File and info.base_name not in files:
            fs.delete_file(info.path)


__all__ = ["output_filesystem", "remote_exists", "publish_output", "write_manifest"]
