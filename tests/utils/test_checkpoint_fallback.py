"""Resume from the newest good checkpoint (issue #45 item 3): a damaged or missing newest checkpoint, or a garbage
``latest``, falls back to the previous intact one with one warning; all bad is a one-line error; a full disk during
a save is a one-line ENOSPC error that leaves the previous checkpoint alone.

Real parts: the tiny model with an AdamW optimizer that has state, real DCP saves into ``tmp_path``. The only fakes
are the ENOSPC ones, each named in its test.
"""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch

from training.utils import checkpoint as ckpt
from training.utils.checkpoint import (
    CheckpointNoSpace,
    NoUsableCheckpoint,
    latest_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from training.utils.checkpoint_files import MANIFEST, verify_checkpoint
from training.utils.run_record import has_checkpoint, resolve_log_path


@pytest.fixture(scope="module")
def trained(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()  # optimizer state to save too
    return model, optimizer


def _probe(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def _two_checkpoints(tmp_path, trained) -> tuple:
    """``tmp_path/checkpoints`` with step 1 and step 2, whose weights differ; returns (root, step-1 weights)."""
    model, optimizer = trained
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, optimizer, {"step": 1})
    first = _probe(model).detach().clone()
    with torch.no_grad():
        _probe(model).add_(1.0)
    save_checkpoint(root, 2, model, optimizer, {"step": 2})
    with torch.no_grad():
        _probe(model).mul_(0.0)  # neither checkpoint: what a load must overwrite
    return root, first


def _distcp(folder):
    return next(folder.glob("*.distcp"))


def _truncate(root):
    path = _distcp(root / "step_000002")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero(root):
    path = _distcp(root / "step_000002")
    path.write_bytes(b"\0" * path.stat().st_size)


def _drop_metadata(root):
    (root / "step_000002" / ".metadata").unlink()


def _corrupt_recipe_state(root):
    (root / "step_000002" / "recipe_state.json").write_text('{"step": 2, "cur')


def _delete_newest(root):
    import shutil

    shutil.rmtree(root / "step_000002")


CORRUPTIONS = {
    "truncated distcp": (_truncate, "__0_0.distcp has"),
    "zeroed distcp": (_zero, "__0_0.distcp does not match its checksum"),
    "missing metadata": (_drop_metadata, ".metadata is missing"),
    "corrupt recipe_state": (_corrupt_recipe_state, "recipe_state.json"),
    "deleted newest folder": (_delete_newest, "latest names step_000002, which does not exist"),
}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ckpt.__name__ and r.levelno == logging.WARNING]


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_bad_newest_checkpoint_resumes_from_the_previous_good_one(name, trained, tmp_path, caplog):
    root, first = _two_checkpoints(tmp_path, trained)
    corrupt, why = CORRUPTIONS[name]
    corrupt(root)
    assert has_checkpoint(tmp_path)  # the run-folder policy agrees: resume, never start over
    assert resolve_log_path(tmp_path, {}, "resume_or_new") == tmp_path
    caplog.set_level(logging.WARNING)
    model, optimizer = trained
    folder, state = load_latest_checkpoint(root, model, optimizer)
    assert folder.name == "step_000001" and state == {"step": 1}
    assert torch.equal(_probe(model), first)  # step 1's weights, not step 2's or the scribbled ones
    (warning,) = _warnings(caplog)
    assert "step_000002" in warning and "step_000001" in warning and why in warning
    assert (root / "latest").read_text() == "step_000001"  # rewritten to the one chosen
    assert latest_checkpoint(root) == folder


def test_a_garbage_latest_pointer_resumes_from_the_newest_checkpoint(trained, tmp_path, caplog):
    root, _ = _two_checkpoints(tmp_path, trained)
    (root / "latest").write_bytes(b"\x00\x17garbage")
    assert has_checkpoint(tmp_path)
    caplog.set_level(logging.WARNING)
    folder, state = load_latest_checkpoint(root, *trained)
    assert folder.name == "step_000002" and state == {"step": 2}
    (warning,) = _warnings(caplog)
    assert "latest holds" in warning and "step_000002" in warning
    assert (root / "latest").read_text() == "step_000002"


def test_a_checkpoint_from_before_manifests_resumes_and_a_damaged_one_falls_back_on_its_load(trained, tmp_path, caplog):
    """No manifest (an old run): accepted on ``.metadata`` and ``recipe_state.json``; a zeroed ``.distcp`` there
    passes that check, fails the DCP load, and the load falls back to step 1."""
    root, first = _two_checkpoints(tmp_path, trained)
    for step in (1, 2):
        (root / f"step_00000{step}" / MANIFEST).unlink()
    assert verify_checkpoint(root / "step_000002") is None
    caplog.set_level(logging.WARNING)
    assert load_latest_checkpoint(root, *trained)[1] == {"step": 2}
    assert not _warnings(caplog)
    _zero(root)
    assert verify_checkpoint(root / "step_000002") is None  # sizes alone cannot see it ...
    folder, state = load_latest_checkpoint(root, *trained)  # ... the load does
    assert folder.name == "step_000001" and state == {"step": 1}
    assert torch.equal(_probe(trained[0]), first)
    (warning,) = _warnings(caplog)
    assert "step_000002 (does not load" in warning and "resuming from step_000001" in warning


def test_all_checkpoints_bad_is_one_line_naming_each_and_the_fix(trained, tmp_path):
    root, _ = _two_checkpoints(tmp_path, trained)
    _drop_metadata(root)
    (root / "step_000001" / "recipe_state.json").write_text("")
    assert not has_checkpoint(tmp_path)
    for error in (
        pytest.raises(NoUsableCheckpoint, load_latest_checkpoint, root, *trained),
        pytest.raises(NoUsableCheckpoint, resolve_log_path, tmp_path, {}, "resume_or_new"),
        pytest.raises(NoUsableCheckpoint, resolve_log_path, tmp_path, {}, "resume"),
    ):
        text = str(error.value)
        assert "\n" not in text and text.startswith(f"error: {root} holds checkpoints but none")
        assert "step_000002: .metadata is missing" in text and "step_000001: recipe_state.json" in text
        assert f"delete {root}" in text and "another log_path" in text
    assert latest_checkpoint(root) is None
    assert resolve_log_path(tmp_path, {}, "new") == tmp_path.with_name(tmp_path.name + "-2")  # =new starts elsewhere


def test_an_empty_root_is_a_fresh_start(trained, tmp_path):
    assert load_latest_checkpoint(tmp_path / "checkpoints", *trained) is None
    assert latest_checkpoint(tmp_path / "checkpoints") is None and not has_checkpoint(tmp_path)


def _fake_full_disk_in_the_file_writer(monkeypatch):
    """Fake: DCP's per-item file write raises ENOSPC (as a full disk does), wrapped by DCP in a CheckpointException."""
    import torch.distributed.checkpoint.filesystem as fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)


def _fake_full_disk_at_the_manifest(monkeypatch):
    """Fake: the disk fills after the tensors, when the manifest is written (a plain OSError ENOSPC)."""

    def full(folder):
        (folder / MANIFEST).write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_manifest", full)


@pytest.mark.parametrize("fake", [_fake_full_disk_in_the_file_writer, _fake_full_disk_at_the_manifest])
def test_a_full_disk_during_a_save_is_one_enospc_line_and_keeps_the_previous_checkpoint(
    fake, trained, tmp_path, monkeypatch
):
    model, optimizer = trained
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, optimizer, {"step": 1})
    fake(monkeypatch)
    with pytest.raises(CheckpointNoSpace) as e:
        save_checkpoint(root, 2, model, optimizer, {"step": 2})
    text = str(e.value)
    assert e.value.errno == errno.ENOSPC and "\n" not in text
    assert "ENOSPC" in text and "step_000002.tmp" in text and "bytes" in text and "free" in text
    needed = int(text.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert needed >= _distcp(root / "step_000001").stat().st_size
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no partial folder left
    assert (root / "latest").read_text() == "step_000001" and verify_checkpoint(root / "step_000001") is None


def test_a_bad_checkpoint_never_counts_toward_keep_last(trained, tmp_path):
    """Pruning runs after the new checkpoint verified and keeps the newest ``keep_last`` that verify."""
    model, optimizer = trained
    root, _ = _two_checkpoints(tmp_path, trained)
    _zero(root)
    save_checkpoint(root, 3, model, optimizer, {"step": 3}, keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    save_checkpoint(root, 4, model, optimizer, {"step": 4}, keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    assert json.loads((root / "step_000004" / MANIFEST).read_text())["files"].keys() == {
        ".metadata",
        "__0_0.distcp",
        "recipe_state.json",
    }
    assert not any(os.path.exists(root / f"step_00000{k}.tmp") for k in range(1, 5))


def test_the_stop_line_says_when_no_checkpoint_can_be_resumed_from(tmp_path):
    from training.recipes.run import stopped_line

    assert "holds no checkpoint" in stopped_line(tmp_path)
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)  # a folder with nothing in it
    line = stopped_line(tmp_path)
    assert "none of the checkpoints" in line and "starts over" not in line
