"""``JobCheckpoints``: the crash checkpoints of a durable job store (``omniloop serve
--job-store jobs.db --requeue-on-restart``), one file per running job beside the store,
``<store>-checkpoints/<job id>.ckpt``.

The engine hands it a loop's ``LoopCheckpoint`` at the cadence it was given
(``--checkpoint-every-s`` / ``--checkpoint-every-steps``; engine/checkpoints.py); the file
is replaced atomically (temporary name, fsync, rename), so a crash leaves the previous
checkpoint or the new one whole. It is deleted when the job ends, however it ends; files no
unfinished job refers to are deleted at start. Their total stays under ``max_bytes``: a
checkpoint that would go beyond is not written (the job keeps its previous one).

File layout: ``MAGIC``, a 4-byte big-endian header length, the JSON header (node, step,
payload size), the payload's SHA-256, then the payload: ``torch.save`` of the checkpoint's
tensors and scalars, read back with ``torch.load(weights_only=True)`` (no pickled code).
A file that fails any check is reported and the job runs from its first step instead.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omniloop.engine.checkpoints import CheckpointCadence
from omniloop.models.manifest import atomic_write
from omniloop.pipeline.checkpoint import CheckpointMismatch, LoopCheckpoint

logger = logging.getLogger(__name__)
MAGIC = b"OMNILOOP-CKPT-1\n"
SUFFIX = ".ckpt"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
# (job id, node, step it continues from or None, why not) -> the job's record (the event loop's)
ResumedSink = Callable[[str, str, "int | None", "str | None"], None]


class CheckpointCorrupt(ValueError):
    """A checkpoint file that cannot be used (the message says what is wrong with it)."""


def encode_checkpoint(ck: LoopCheckpoint) -> bytes:
    buf = io.BytesIO()
    torch.save(ck.to_dict(), buf)
    payload = buf.getvalue()
    header = json.dumps({"node": ck.node, "steps_done": ck.steps_done, "steps_target": ck.steps_target,
                         "payload_bytes": len(payload)}).encode()
    return MAGIC + struct.pack(">I", len(header)) + header + hashlib.sha256(payload).digest() + payload


def read_header(data: bytes) -> tuple[dict[str, Any], int]:
    """(the header, where the digest starts); raises CheckpointCorrupt."""
    if not data.startswith(MAGIC):
        raise CheckpointCorrupt("not an omniloop checkpoint (bad magic)")
    at = len(MAGIC)
    if len(data) < at + 4:
        raise CheckpointCorrupt("truncated header")
    (size,) = struct.unpack(">I", data[at:at + 4])
    try:
        header = json.loads(data[at + 4:at + 4 + size])
    except ValueError:
        raise CheckpointCorrupt("unreadable header") from None
    if not isinstance(header, dict) or not isinstance(header.get("payload_bytes"), int):
        raise CheckpointCorrupt("unreadable header")
    return header, at + 4 + size


def decode_checkpoint(data: bytes) -> LoopCheckpoint:
    header, at = read_header(data)
    digest, payload = data[at:at + 32], data[at + 32:]
    if len(payload) != header["payload_bytes"]:
        raise CheckpointCorrupt(f"truncated: {len(payload)} of {header['payload_bytes']} payload bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointCorrupt("its checksum does not match (the file was damaged)")
    try:
        return LoopCheckpoint.from_dict(torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu"))
    except CheckpointMismatch as e:
        raise CheckpointCorrupt(str(e)) from None
    except Exception as e:  # what torch.load raises on a payload it cannot read
        raise CheckpointCorrupt(f"unreadable payload ({type(e).__name__}: {e})") from None


class JobCheckpoints:
    """The engine's ``LoopCheckpoints`` for a durable job store (called on the engine thread,
    and by the server at start before any job runs)."""

    def __init__(self, directory: Path, cadence: CheckpointCadence, max_bytes: int) -> None:
        self.directory, self._cadence, self.max_bytes = Path(directory), cadence, max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.on_resumed: ResumedSink | None = None
        # which requests are jobs of the store (a session's, a chat's or the warmup's are not:
        # nothing would resume them); None: every request with a file-safe id
        self.is_job: Callable[[str], bool] | None = None
        self._sizes: dict[str, int] = {}  # job id -> bytes of its file
        self._resumable: set[str] = set()  # jobs of a dead process whose checkpoint a loop may resume
        self._lock = threading.Lock()

    @property
    def cadence(self) -> CheckpointCadence:
        return self._cadence

    def path(self, job_id: str) -> Path:
        assert _SAFE_ID.match(job_id), f"job id {job_id!r} is not a file name"
        return self.directory / f"{job_id}{SUFFIX}"

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    # -- the engine's side --------------------------------------------------------------------
    def wants(self, request_id: str) -> bool:
        return bool(_SAFE_ID.match(request_id)) and (self.is_job is None or self.is_job(request_id))

    def save(self, request_id: str, checkpoint: LoopCheckpoint) -> None:
        if not self.wants(request_id):
            return
        with self._lock:
            if request_id in self._resumable:  # the dead process got further (a later loop): keep its
                return
        data = encode_checkpoint(checkpoint)
        with self._lock:
            others = sum(n for rid, n in self._sizes.items() if rid != request_id)
            if others + len(data) > self.max_bytes:
                logger.warning("job %s: checkpoint at step %d not written (%d bytes beyond the %d-byte budget, "
                               "--checkpoint-max-bytes)", request_id, checkpoint.steps_done,
                               others + len(data) - self.max_bytes, self.max_bytes)
                return
        path = self.path(request_id)
        try:
            atomic_write(path, data)  # the engine thread is the only writer: the budget read above holds
        except OSError:
            path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)  # a full disk: the previous file stands
            raise
        with self._lock:
            self._sizes[request_id] = len(data)

    def resume_point(self, request_id: str, node: str) -> LoopCheckpoint | None:
        with self._lock:
            if request_id not in self._resumable:
                return None
        path = self.path(request_id)
        try:
            data = path.read_bytes()
            header, _ = read_header(data)
            if header.get("node") != node:
                return None  # a later loop's: kept for it
            checkpoint = decode_checkpoint(data)
        except (OSError, CheckpointCorrupt) as e:
            with self._lock:
                self._resumable.discard(request_id)
            why = e.strerror if isinstance(e, OSError) else str(e)
            self.resumed(request_id, node, None, f"its checkpoint {path} cannot be used: {why}")
            return None
        with self._lock:
            self._resumable.discard(request_id)
        return checkpoint

    def resumed(self, request_id: str, node: str, step: int | None, why: str | None) -> None:
        if step is None:
            logger.warning("job %s: node %s runs from its first step: %s", request_id, node, why)
        else:
            logger.info("job %s: node %s resumed from step %d", request_id, node, step)
        if self.on_resumed is not None:
            self.on_resumed(request_id, node, step, why)

    def discard(self, request_id: str) -> None:
        with self._lock:
            written = self._sizes.pop(request_id, None) is not None
            self._resumable.discard(request_id)
        if written:
            self.path(request_id).unlink(missing_ok=True)

    # -- a restart --------------------------------------------------------------------------
    def adopt(self, job_ids: set[str]) -> set[str]:
        """At start: the checkpoints of ``job_ids`` (unfinished jobs about to run again) become
        resumable; every other file here (finished jobs', a write cut short) is deleted.
        Returns the ids that have one."""
        found = set()
        for path in self.directory.iterdir():
            job_id = path.name[:-len(SUFFIX)] if path.name.endswith(SUFFIX) else None
            if path.is_file() and job_id in job_ids:
                found.add(job_id)
                with self._lock:
                    self._sizes[job_id] = path.stat().st_size
                    self._resumable.add(job_id)
            elif path.is_file():
                logger.info("deleting %s: no unfinished job refers to it", path)
                path.unlink(missing_ok=True)
        return found
