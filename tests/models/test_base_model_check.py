"""``check_base_model``: a model name that names nothing usable fails in seconds, in one line that says what was tried."""

import socket

import pytest

from training.models import SHORT_NAMES
from training.models.resolve import check_base_model
from training.utils.config import ConfigError


@pytest.fixture(autouse=True)
def no_offline_env(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def hub_cache_with(cache, repo_id):
    """A Hugging Face hub cache (its on-disk layout) holding ``repo_id``'s config.json at revision main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text("{}")
    return cache


def closed_port_endpoint():
    """A loopback URL nothing listens on: connecting is refused, as on a machine without network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("typo, meant", [("smolm2", "smollm2"), ("smollm", "smollm2"), ("tinny", "tiny")])
def test_a_short_name_typo_suggests_the_short_name(typo, meant):
    with pytest.raises(ConfigError, match=rf"^base_model: '{typo}' is no built-in model; did you mean '{meant}'\?"):
        check_base_model(typo)


def test_short_names_pass_without_building_anything():
    for name in SHORT_NAMES:
        assert "short name" in check_base_model(name)


def test_a_missing_local_folder_names_the_path_and_the_part_that_exists(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=rf"no folder {tmp_path}/models/x \({tmp_path} exists, models/x does not\)"):
        check_base_model(str(tmp_path / "models" / "x"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # "models/x" has the shape of a hub id, but models/ is a folder here
    with pytest.raises(ConfigError, match=rf"no folder {tmp_path}/models/x \({tmp_path}/models exists, x does not\)"):
        check_base_model("models/x")
    with pytest.raises(ConfigError, match="no folder .*; from './y', a local path"):
        check_base_model("./y")


def test_a_folder_needs_config_json(tmp_path):
    with pytest.raises(ConfigError, match=f"the folder {tmp_path} has no config.json"):
        check_base_model(str(tmp_path))
    assert check_base_model(str(model_folder(tmp_path / "m"))) == f"local folder {tmp_path / 'm'}"


def test_a_cached_hub_id_passes_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = hub_cache_with(tmp_path / "hub", "org/model")
    assert check_base_model("org/model", cache_dir=str(cache)).startswith("hub id org/model (cached: ")


def test_an_uncached_hub_id_offline_says_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", closed_port_endpoint())  # never asked: offline means no request
    with pytest.raises(ConfigError) as e:
        check_base_model("org/other", cache_dir=str(tmp_path / "hub"))
    assert str(e.value) == (
        f"base_model: 'org/other' is no local folder and not in the hub cache {tmp_path / 'hub'}, "
        "and HF_HUB_OFFLINE is set (offline): download it first, or give a folder"
    )


def test_an_unreachable_hub_is_named_with_what_was_tried(tmp_path, monkeypatch):
    endpoint = closed_port_endpoint()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(ConfigError) as e:
        check_base_model("org/other", cache_dir=str(tmp_path / "hub"), timeout_s=3)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"base_model: 'org/other' is no local folder and not in the hub cache {tmp_path / 'hub'}")
    assert f"{endpoint} cannot be reached (" in message and "offline?" in message


def test_a_name_that_is_no_hub_id_says_so():
    with pytest.raises(ConfigError, match="'my model!' is no short name .* and no valid hub id"):
        check_base_model("my model!")


def test_a_relative_local_folder_resolves_to_an_absolute_path(tmp_path, monkeypatch):
    """Servers run in the run's log folder: a relative model folder must reach them absolute."""
    from training.models import resolve_model

    (tmp_path / "runs" / "final").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("runs/final") == str(tmp_path / "runs" / "final")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
