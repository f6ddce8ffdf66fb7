"""Reading safetensors weights as views on the files' pages (``MappedWeights``): values and resident memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.deployment.engine.weights import MappedWeights, load_safetensors
from training.deployment.server.process_stats import rss_bytes

MB = 2**20


def test_mapped_weights_equal_what_safetensors_reads(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(33, 17, generator=g),
        "b.weight": torch.randn(8, 3, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(5, generator=g).half(),
        "ids": torch.arange(7, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    save_file({"z.weight": torch.ones(2, 2)}, tmp_path / "model-2.safetensors")
    mapped = load_safetensors(tmp_path)  # a folder: both files
    reference = load_file(tmp_path / "model.safetensors") | load_file(tmp_path / "model-2.safetensors")
    assert sorted(mapped) == sorted(reference) and len(mapped) == len(reference)
    for name, want in reference.items():
        got = mapped[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    views = [mapped[name] for name in mapped]  # every view stays valid after later reads gave its pages back
    assert all(torch.equal(v, reference[n]) for v, n in zip(views, mapped))


def test_reading_tensors_one_after_another_keeps_about_one_resident(tmp_path):
    """A weight push reads a model's worth of file pages: the process keeps a few tensors of them, not the file."""
    if rss_bytes() is None:
        pytest.skip("no /proc here to read resident memory from")
    count, size = 12, 8 * MB
    save_file({f"w{i}": torch.full((size // 4,), float(i)) for i in range(count)}, tmp_path / "w.safetensors")
    mapped = load_safetensors(tmp_path / "w.safetensors")
    before, peak, total = rss_bytes(), 0, 0.0
    for name in mapped:
        total += float(mapped[name].sum())  # touches every page of the tensor
        peak = max(peak, rss_bytes() - before)
    assert total == sum(i * size // 4 for i in range(count))
    bound = MappedWeights.RELEASE_BYTES + 2 * size  # what is read between two releases, and the tensor read now
    assert bound < count * size / 1.5
    assert peak < bound, f"{peak / MB:.0f} MB resident after reading {count} tensors of {size // MB} MB"


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    save_file({"w": torch.ones(1024)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut\.safetensors.*'w' ends at byte"):
        load_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "text.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="text.safetensors: not a safetensors file"):
        load_safetensors(tmp_path / "text.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.safetensors: not a safetensors file"):
        load_safetensors(tmp_path / "empty.safetensors")


def test_a_file_written_in_place_after_mapping_is_named_changed_and_a_renamed_over_one_is_not(tmp_path):
    """``changed()`` (checked by the server after reading a push, before the swap) names a file rewritten
    or truncated in place; a file replaced by a rename keeps the mapped inode whole, so it is not changed."""
    import os

    save_file({"w": torch.ones(1024)}, tmp_path / "a.safetensors")
    save_file({"v": torch.ones(1024)}, tmp_path / "b.safetensors")
    mapped = load_safetensors(tmp_path)
    assert mapped.changed() == []
    os.truncate(tmp_path / "a.safetensors", 100)  # shrinks under the reader
    save_file({"v": torch.zeros(1024)}, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", tmp_path / "b.safetensors")  # the trainer's atomic replace
    assert mapped.changed() == [tmp_path / "a.safetensors"]
    assert torch.equal(mapped["v"], torch.ones(1024))  # the renamed-over file's mapping still holds its values
