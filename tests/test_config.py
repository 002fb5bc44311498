import pytest

from pddnet.config import ClusterMode, ConfigError, config_from_dict, load_config, parse_address


def test_defaults_round_trip_through_toml(tmp_path):
    cfg = load_config()
    assert cfg.mode is ClusterMode.PDD
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()


def test_overrides_and_dial_address(tmp_path):
    cfg = load_config(
        overrides={"mode": "cross-dc", "wan.rtt_ms": 50, "main_decode.dial": "10.77.0.2:7300"}
    )
    assert cfg.mode is ClusterMode.CROSS_DC
    assert cfg.wan.rtt_ms == 50.0
    assert cfg.main_decode.dial_address() == ("10.77.0.2", 7300)
    assert cfg.prefill.dial_address() == ("127.0.0.1", 7100)


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"mode": "far-dc"}, "mode must be"),
        ({"prefill": {"port": 70000}}, "prefill.port"),
        ({"relay": {"num_blocks": 0}}, "relay.num_blocks"),
        ({"relay": {"num_blocks": "many"}}, "relay.num_blocks must be an integer"),
        ({"wan": {"shell": "satellite"}}, "wan.shell"),
        ({"wan": {"bogus": 1}}, "unknown key"),
        ({"policy": {"handoff": "sideways"}}, "unknown handoff mode"),
        ({"main_decode": {"dial": "nohost"}}, "HOST:PORT"),
    ],
)
def test_bad_values_are_named(data, needle):
    with pytest.raises((ConfigError, ValueError), match=needle):
        config_from_dict(data)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("mode = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    assert parse_address("[::1]:80") == ("::1", 80)


def test_partial_tables_keep_their_section_defaults():
    cfg = config_from_dict({"relay": {"port": 9200}, "prefill": {"num_blocks": 64}})
    assert cfg.relay.port == 9200 and cfg.relay.num_blocks == 512
    assert cfg.prefill.port == 7100 and cfg.prefill.num_blocks == 64
