"""The weight endpoints of a real server refuse what would let a local process or a bad push do harm."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.utils.http import control_request

KEY = "control-key"


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, api_key=KEY, max_batch_size=4, max_model_len=128)  # its tests load weights


def post(server, path, body):
    status, text = control_request("POST", server.base_url + path, body, api_key=KEY, timeout=60)
    return status, text


def test_disk_loads_are_confined_and_symlinks_resolved(server, tmp_path):
    outside = post(server, "/update_weights_from_disk", {"path": "/etc/passwd", "weight_version": 1})
    missing = post(server, "/update_weights_from_disk", {"path": "/etc/no-such-file", "weight_version": 1})
    assert outside[0] == missing[0] == 400 and "not under the server's weight folders" in outside[1]
    assert outside[1] == missing[1]  # the answer does not reveal whether the file exists
    link = tmp_path / "model.safetensors"
    os.symlink("/etc/passwd", link)
    status, text = post(server, "/update_weights_from_disk", {"path": str(link), "weight_version": 1})
    assert status == 400 and "not under" in text
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"not a safetensors file at all")
    status, text = post(server, "/update_weights_from_disk", {"path": str(junk), "weight_version": 1})
    assert status == 400 and "could not read safetensors" in text


def test_nan_weights_and_rollbacks_are_refused(server, tiny_model_path, tmp_path):
    weights = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    good = tmp_path / "good"
    good.mkdir()
    save_file(weights, str(good / "model.safetensors"))
    assert post(server, "/update_weights_from_disk", {"path": str(good), "weight_version": 5})[0] == 200
    name = next(k for k, v in weights.items() if v.is_floating_point())
    bad = tmp_path / "bad"
    bad.mkdir()
    poisoned = dict(weights)
    poisoned[name] = weights[name].clone()
    poisoned[name].view(-1)[0] = math.nan
    save_file(poisoned, str(bad / "model.safetensors"))
    status, text = post(server, "/update_weights_from_disk", {"path": str(bad), "weight_version": 6})
    assert status == 400 and name in text and "NaN or inf" in text
    status, text = post(server, "/update_weights_from_disk", {"path": str(good), "weight_version": 3})
    assert status == 409 and "older than the served 5" in text
    assert post(server, "/update_weights_from_disk", {"path": str(good), "weight_version": 3, "force": True})[0] == 200
    assert '"weight_version": 3' in control_request("GET", server.base_url + "/weight_version", api_key=KEY)[1]
    assert not torch.isnan(weights[name]).any()


def test_weight_group_peers_are_loopback_only_by_default(server):
    body = {
        "master_addr": "10.11.12.13",
        "master_port": 29999,
        "rank": 1,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 1,
    }
    status, text = post(server, "/init_weight_update_group", body)
    assert status == 403 and "not an allowed weight peer" in text


def test_oversized_requests_are_refused_before_any_tokenizing(server):
    status, text = post(server, "/v1/completions", {"prompt": "a" * 10_000_000, "max_tokens": 1})
    assert status == 400 and "cannot fit max_model_len=128" in text
    status, text = post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 1_000_000}], "max_tokens": 1}
    )
    assert status == 400 and "'messages' have" in text
    status, text = post(server, "/v1/completions", {"prompt": [[1, 2]] * 300, "max_tokens": 1})
    assert status == 400 and "at most 256 per request" in text
    status, _ = post(server, "/v1/completions", {"prompt": "c" * (40 * 1024 * 1024), "max_tokens": 1})
    assert status == 413
    assert control_request("GET", server.base_url + "/health")[0] == 200


def canary(server) -> str:
    """The server's greedy answer to a fixed prompt (text, logprobs to 3 places, weight version): it changes
    when the served weights do."""
    import json

    body = {"prompt": [5, 17, 42, 99, 7], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 0}
    status, text = post(server, "/v1/completions", body)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    logprobs = [round(x, 3) for x in choice["logprobs"]["token_logprobs"]]  # not bitwise stable from call to call
    return json.dumps([choice["text"], logprobs, choice["weight_version"]])


def test_a_pushed_folder_with_a_symlink_out_of_the_weight_folders_is_refused(server, tiny_model_path, tmp_path):
    """A folder under the allowed roots whose x.safetensors links to a file outside them: 400 naming the file
    and the rule, and the served weights (the canary answer) unchanged."""
    import shutil
    import tempfile
    from pathlib import Path

    outside = Path(tempfile.mkdtemp(prefix="outside-weights-", dir=Path.home()))
    try:
        allowed = [Path(tempfile.gettempdir()).resolve(), Path("/dev/shm").resolve(), Path(tiny_model_path).resolve()]
        if any(outside.resolve().is_relative_to(r) for r in allowed):
            pytest.skip("the home folder lies under the server's weight folders")
        weights = load_file(os.path.join(tiny_model_path, "model.safetensors"))
        g = torch.Generator().manual_seed(3)
        save_file(
            {k: v + torch.randn(v.shape, generator=g) for k, v in weights.items()}, str(outside / "w.safetensors")
        )
        folder = tmp_path / "push"
        folder.mkdir()
        os.symlink(outside / "w.safetensors", folder / "x.safetensors")
        before = canary(server)
        status, text = post(server, "/update_weights_from_disk", {"path": str(folder), "weight_version": 50})
        assert status == 400, text
        assert "x.safetensors resolves outside the server's weight folders" in text and str(folder) in text
        assert str(outside) not in text  # the link's target is not revealed
        assert canary(server) == before
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_a_bad_files_refusal_never_echoes_its_bytes_or_size(server, tmp_path):
    """Refusals name the path and what is wrong, never a number or byte read from the file (no oracle)."""
    secret = b"SECRET!!" + b"x" * 92  # its first 8 bytes, read as a header length, would be a readable number
    no_utf8 = (16).to_bytes(8, "little") + b"\xfeSECRET-TOKEN-XY" + b"\0" * 20  # a header that is not UTF-8
    for name, data in (("secret", secret), ("no_utf8", no_utf8)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(data)
        status, text = post(server, "/update_weights_from_disk", {"path": str(folder), "weight_version": 60})
        assert status == 400 and "could not read safetensors" in text and "not a safetensors file" in text, text
        leaks = [str(int.from_bytes(data[:8], "little")), str(len(data)), "SECRET", "0xfe", "\\ufffd"]
        assert not [leak for leak in leaks if leak in text], text


def test_a_malformed_dtypes_entry_is_a_400_naming_the_field(server):
    """``"dtypes": [[1]]`` (an unhashable entry) on /update_weights_from_distributed is refused as the
    client's mistake, naming ``dtypes[0]``, before any group or tensor is involved."""
    import json

    _, text = control_request("GET", server.base_url + "/weight_version", api_key=KEY)
    body = {
        "weight_version": json.loads(text)["weight_version"] + 1,
        "update_id": "malformed-dtypes",
        "names": ["model.embed_tokens.weight"],
        "dtypes": [[1]],
        "shapes": [[1]],
    }
    status, text = post(server, "/update_weights_from_distributed", body)
    assert status == 400 and "dtypes[0]" in text, text
