"""`kvserve serve` flags: every setting, its default and its env var in --help; unset flags
leave the env var in force."""

from server.cli import build_parser, settings_from_args


def test_help_shows_each_default_and_env_var(capsys):
    parser = build_parser()
    try:
        parser.parse_args(["serve", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "[default: 16; env KVSERVE_MAX_RUNNING]" in text
    assert "[default: 512; env KVSERVE_MAX_BATCH_TOKENS]" in text
    assert "[default: unset; env KVSERVE_API_KEY]" in text


def test_an_unset_flag_keeps_the_env_var(monkeypatch):
    monkeypatch.setenv("KVSERVE_MAX_RUNNING", "3")
    assert settings_from_args(build_parser().parse_args(["serve"])).max_running == 3
    assert settings_from_args(build_parser().parse_args(["serve", "--max-running", "5"])).max_running == 5
