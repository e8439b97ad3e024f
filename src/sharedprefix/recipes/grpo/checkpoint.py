"""Folders replaced atomically, and the checkpoints and model folders of ``sharedprefix train``.

Once a folder was written, a whole copy of it exists at every moment, whatever instant a kill
(``kill -9``, or a power loss once the data reached the disk) interrupts the next write of it.

A folder is whole when it holds ``MARKER``, created after every other file in it is flushed to
disk, and removed first when the folder is deleted. Replacing FOLDER, and what a kill at each
point leaves:

  1. write FOLDER.tmp, then mark it whole   FOLDER (the previous one) is whole
  2. rename FOLDER -> FOLDER.old            FOLDER.tmp (the new one) and FOLDER.old are whole
  3. rename FOLDER.tmp -> FOLDER            FOLDER (the new one) and FOLDER.old are whole
  4. delete FOLDER.old

A rename within one directory is atomic (POSIX ``rename``). A whole FOLDER.tmp is newer than
FOLDER, and FOLDER newer than FOLDER.old, so ``latest(FOLDER)`` returns the first whole one of
FOLDER.tmp, FOLDER, FOLDER.old; it changes nothing on disk, so every rank of a distributed run
may call it. ``replace`` first finishes a replacement a kill interrupted (``finish``; it discards a
FOLDER.tmp that is not whole), then runs the four steps.

A checkpoint folder holds:
  model/             ``save_pretrained`` of the model (of its LoRA adapter, in PEFT's format, for a
                     LoRA run) and of the tokenizer
  trainer_state.pt   the optimizer's ``state_dict``, step, warm-up flag and options: tensors and
                     plain Python values only, read with ``torch.load(weights_only=True)``
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
from collections.abc import Callable

import torch

MARKER = ".complete"
STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"


# -- atomic replacement ----------------------------------------------------------------------------------------
def whole(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def latest(folder: str) -> str | None:
    """The newest whole copy of ``folder`` (FOLDER.tmp, FOLDER or FOLDER.old), or None."""
    for path in (folder + ".tmp", folder, folder + ".old"):
        if whole(path):
            return path
    return None


def replace(folder: str, write: Callable[[str], None]) -> None:
    """Replace ``folder`` by what ``write(path)`` writes into the empty folder ``path``, atomically."""
    tmp = folder + ".tmp"
    finish(folder)
    _write(tmp, write)
    _mark_whole(tmp)
    _swap_in(folder)


def finish(folder: str) -> None:
    """Complete a replacement a kill interrupted: afterwards only FOLDER exists (if any copy does)."""
    tmp, old = folder + ".tmp", folder + ".old"
    if whole(tmp):
        _swap_in(folder)
        return
    _discard(tmp)
    if not whole(folder) and whole(old):  # not left by `replace`; kept so that a whole copy is never lost
        _discard(folder)
        _rename(old, folder)
    _discard(old)


def _swap_in(folder: str) -> None:
    """Steps 2-4: FOLDER.tmp is whole."""
    tmp, old = folder + ".tmp", folder + ".old"
    if os.path.lexists(folder):
        _discard(old)
        _rename(folder, old)
    _rename(tmp, folder)
    _discard(old)


def _discard(path: str) -> None:
    if os.path.lexists(path):
        _unmark(path)
        _rmtree(path)


# The primitive steps (module functions, so that a test can interrupt the replacement between any two).
def _write(path: str, write: Callable[[str], None]) -> None:
    os.makedirs(path)
    write(path)
    for root, _dirs, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _mark_whole(path: str) -> None:
    with open(os.path.join(path, MARKER), "w") as f:
        f.flush()
        os.fsync(f.fileno())
    _fsync(path)


def _unmark(path: str) -> None:
    if os.path.isfile(os.path.join(path, MARKER)):
        os.remove(os.path.join(path, MARKER))
        _fsync(path)


def _rmtree(path: str) -> None:
    shutil.rmtree(path)


def _rename(src: str, dst: str) -> None:
    os.replace(src, dst)
    _fsync(os.path.dirname(os.path.abspath(dst)))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- what ``sharedprefix train`` writes ------------------------------------------------------------------------
def save_model(model, tokenizer, path: str, base_model: str | None = None) -> None:
    """``save_pretrained`` of the model and the tokenizer into ``path``. A PEFT model saves its adapter
    (PEFT's format) and records ``base_model`` (an absolute folder) as the model it adapts."""
    if hasattr(model, "peft_config"):
        if base_model is None:
            raise ValueError("a LoRA adapter is saved with the folder of its base model; got base_model=None.")
        for adapter in model.peft_config.values():
            adapter.base_model_name_or_path = os.path.abspath(base_model)
    with transformers_progress_on_terminal_only():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)


@contextlib.contextmanager
def transformers_progress_on_terminal_only():
    """Inside: transformers' own progress bars ("Writing model shards", "Loading weights") are off unless stderr
    is a terminal."""
    from transformers.utils import logging

    off = logging.is_progress_bar_enabled() and not sys.stderr.isatty()
    if off:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if off:
            logging.enable_progress_bar()


def save_checkpoint(folder: str, model, tokenizer, state: dict, base_model: str | None = None) -> None:
    """Replace the checkpoint ``folder`` (see the module docstring); ``state``: tensors and plain values."""

    def write(path):
        save_model(model, tokenizer, os.path.join(path, MODEL_DIR), base_model)
        torch.save(state, os.path.join(path, STATE_FILE))

    replace(folder, write)


def load_trainer_state(path: str) -> dict:
    """``trainer_state.pt`` of the whole checkpoint at ``path`` (from ``latest``)."""
    file = os.path.join(path, STATE_FILE)
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{file!r} cannot be read with torch.load(weights_only=True): it holds more than tensors and "
            f"plain values ({str(e).splitlines()[0][:200]}), so sharedprefix train did not write it as "
            "it is. It is not loaded; remove the checkpoint, or pass --no-resume to start over."
        ) from None
