"""``key=value`` overrides are converted by the field's annotation, with one message per bad value."""

import re
from typing import Optional

import pytest

from training.recipes.async_rl_loop import Config
from training.utils import DeployConfig, TrainerConfig
from training.utils.cli import OverrideError, apply_overrides, help_text, parse_value


def cfg() -> Config:
    return Config(base_model="m")


def test_values_take_the_type_of_their_field():
    c = apply_overrides(
        cfg(),
        [
            "log_path=2024",
            "max_steps=7",
            "trainer.learning_rate=3e-4",
            "shuffle_rows=false",
            "trainer.adam_betas=[0.9, 0.99]",
            "eval_rows=null",
            "temperature=1",
            "deployment.engine_config.max_model_len=512",
            "deployment.engine_config.cuda_graph_batch_sizes=[4, 1]",
            'deployment.engine_env={"A": "1"}',
            'sampling_kwargs={"top_p": 0.9}',
        ],
    )
    assert c.log_path == "2024" and isinstance(c.log_path, str)
    assert c.max_steps == 7 and c.trainer.learning_rate == 3e-4 and c.shuffle_rows is False
    assert c.trainer.adam_betas == (0.9, 0.99) and c.eval_rows is None
    assert c.temperature == 1.0 and isinstance(c.temperature, float)
    assert c.deployment.engine_config.max_model_len == 512
    assert c.deployment.engine_config.cuda_graph_batch_sizes == (1, 4)
    assert c.deployment.engine_env == {"A": "1"} and c.sampling_kwargs == {"top_p": 0.9}


def test_union_fields_pick_the_structured_option_first():
    one = apply_overrides(cfg(), ["deployment.base_url=http://h:1"]).deployment.base_url
    many = apply_overrides(cfg(), ['deployment.base_url=["http://h:1", "http://h:2"]']).deployment.base_url
    assert one == "http://h:1" and many == ["http://h:1", "http://h:2"]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("max_steps=5.5", "bad override 'max_steps=5.5': max_steps: expected an integer, got '5.5'"),
        ("shuffle_rows=maybe", "shuffle_rows: expected true or false, got 'maybe'"),
        ("trainer.adam_betas=[0.9]", "trainer.adam_betas: expected 2 values, got 1"),
        ("trainer.learning_rate=-1", "trainer.learning_rate: must be > 0, got -1.0"),
        ("max_steps=0", "max_steps: must be >= 1 or None"),
        ("trainer.nope=1", "unknown config field 'trainer.nope'"),
        ("trainer=1", "trainer: is a sub-config"),
        ("dynamic_filter_fn=x", "dynamic_filter_fn: "),
    ],
)
def test_a_bad_value_stops_with_one_message_naming_the_key(arg, message):
    with pytest.raises(SystemExit) as e:
        apply_overrides(cfg(), [arg])
    text = str(e.value)
    assert message in text, text
    key = arg.split("=")[0]
    assert text.count(f"{key}:") <= 1  # the key is named once, not prefixed twice


def test_parse_value_refuses_what_the_annotation_refuses():
    with pytest.raises(OverrideError, match="expected a number"):
        parse_value("fast", float, "x")
    assert parse_value("null", Optional[int], "x") is None and parse_value("3", Optional[int], "x") == 3


def test_help_shows_nested_fields_with_their_docs():
    text = help_text(Config(base_model="m", deployment=DeployConfig(), trainer=TrainerConfig()))
    assert "deployment.engine_config.max_batch_size=64" in text and "Most sequences decoded at once" in text
    assert "deployment.engine_config.kv_cache_memory_fraction=0.1" in text
    assert "trainer.learning_rate=1e-05" in text


@pytest.mark.parametrize(
    "arg, suggestion",
    [
        ("trainer.learnig_rate=1e-4", "did you mean trainer.learning_rate?"),
        ("learnig_rate=1e-4", "did you mean learning_rate?"),
        ("micro_batch_token=512", "did you mean trainer.micro_batch_tokens?"),  # a nested field, given bare
        ("deployment.engine_config.max_batchsize=8", "did you mean deployment.engine_config.max_batch_size?"),
    ],
)
def test_an_unknown_key_is_named_with_the_closest_keys_on_one_line(arg, suggestion):
    with pytest.raises(SystemExit) as e:
        apply_overrides(cfg(), [arg])
    text = str(e.value)
    assert f"unknown config field {arg.split('=')[0]!r}; {suggestion}" in text and "\n" not in text, text
    assert "completions_per_prompt" not in text  # not the list of every field


def test_a_key_like_no_field_says_so():
    with pytest.raises(SystemExit, match="unknown config field 'zzzz'; no field has a name like it"):
        apply_overrides(cfg(), ["zzzz=1"])


def test_an_alias_and_its_field_given_different_values_is_an_error_naming_both():
    with pytest.raises(SystemExit) as e:
        apply_overrides(cfg(), ["learning_rate=1e-3", "trainer.learning_rate=1e-4"])
    assert "learning_rate=0.001 and trainer.learning_rate=0.0001 are one setting" in str(e.value)
    with pytest.raises(SystemExit, match="loss.kl_beta=0.5 and kl_beta=0.0 are one setting"):
        apply_overrides(cfg(), ["loss.kl_beta=0.5", "kl_beta=0"])
    same = apply_overrides(cfg(), ["learning_rate=1e-3", "trainer.learning_rate=0.001"])  # one value: fine
    again = apply_overrides(cfg(), ["learning_rate=1e-3", "learning_rate=2e-3"])  # one spelling: the last wins
    assert same.trainer.learning_rate == 1e-3 and again.trainer.learning_rate == 2e-3


def test_a_yaml_or_json_file_is_applied_and_key_value_goes_on_top(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "max_steps: 7\nlearning_rate: 3.0e-4\ntrainer:\n  adam_betas: [0.8, 0.9]\n"
        "deployment:\n  engine_config:\n    max_model_len: 512\nsampling_kwargs: {top_p: 0.9}\n"
    )
    json_file = tmp_path / "run.json"
    json_file.write_text('{"max_steps": 7, "trainer": {"learning_rate": 3e-4, "adam_betas": [0.8, 0.9]}}')
    for path in (yaml_file, json_file):
        c = apply_overrides(cfg(), ["--config", str(path), "max_steps=9"])
        assert c.max_steps == 9 and c.trainer.learning_rate == 3e-4 and c.trainer.adam_betas == (0.8, 0.9)
    c = apply_overrides(cfg(), [f"--config={yaml_file}"])
    assert c.max_steps == 7 and c.deployment.engine_config.max_model_len == 512 and c.sampling_kwargs == {"top_p": 0.9}


@pytest.mark.parametrize(
    "text, message",
    [
        ("trainer:\n  learnig_rate: 1.0e-4\n", "unknown config field 'trainer.learnig_rate'; did you mean"),
        ("max_steps: 5.5\n", "max_steps: expected an integer"),
        ("- 1\n", "expected a mapping of settings at the top"),
        ("learning_rate: 1.0e-3\ntrainer:\n  learning_rate: 1.0e-4\n", "are one setting"),
    ],
)
def test_a_bad_config_file_stops_with_one_message(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit, match=message):
        apply_overrides(cfg(), ["--config", str(path)])


def test_a_runs_own_config_json_loads_back_to_the_same_config(tmp_path):
    """``<log_path>/config.json`` (what a run writes) is a config file: the run's settings come back."""
    from training.utils.run_record import write_config_record

    def keep_mixed(pg):
        return len(set(pg.rewards)) > 1

    run = apply_overrides(
        Config(base_model="m", dynamic_filter_fn=keep_mixed),
        ["max_steps=5", "trainer.lr_schedule=cosine", "trainer.warmup_steps=2", "policy_loss=gspo", "kl_beta=0"],
    )
    record = write_config_record(tmp_path, run.to_dict())
    back = apply_overrides(Config(base_model="other", dynamic_filter_fn=keep_mixed), ["--config", str(record)])
    assert back == run and back.to_dict() == run.to_dict()
    with pytest.raises(SystemExit, match="dynamic_filter_fn: a Callable cannot be set"):  # a name is not a function
        apply_overrides(Config(base_model="m"), ["--config", str(record)])


def test_a_bare_list_field_takes_json_not_a_path():
    c = apply_overrides(cfg(), ['eval_rows=[{"prompt": "1+1", "answer": "2"}]'])
    assert c.eval_rows == [{"prompt": "1+1", "answer": "2"}]
    assert apply_overrides(cfg(), ["eval_rows=held_out.jsonl"]).eval_rows == "held_out.jsonl"


def _documented(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of the fields of ``cls`` and of every config dataclass below it that have no docstring."""
    import dataclasses

    from training.utils.cli import field_docs

    docs, missing = field_docs(cls), []
    for f in dataclasses.fields(cls):
        if not docs.get(f.name):
            missing.append(prefix + f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            missing += _documented(type(default), f"{prefix}{f.name}.")
    return missing


def test_every_config_field_has_help_and_help_shows_it():
    assert _documented(Config) == []
    entries = re.split(r"\n  (?=\S)", help_text(cfg()))  # "  key=value\n      help"
    assert len(entries) > 100  # every leaf of every sub-config is listed
    for entry in entries:
        key, _, doc = entry.strip().partition("\n")
        assert doc.strip(), f"{key} has no help text"
