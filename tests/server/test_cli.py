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


def test_the_overlap_flag_and_its_refusal_beside_speculation():
    """--overlap MODE and --no-overlap; asked "on" beside --speculative, the settings refuse it
    (speculation drafts from each step's tokens on the host), "auto" lets speculation run."""
    import pytest
    from pydantic import ValidationError

    parse = build_parser().parse_args
    assert settings_from_args(parse(["serve"])).overlap == "auto"
    assert settings_from_args(parse(["serve", "--overlap", "on"])).overlap == "on"
    assert settings_from_args(parse(["serve", "--no-overlap"])).overlap == "off"
    assert settings_from_args(parse(["serve", "--speculative", "ngram"])).overlap == "auto"
    with pytest.raises(ValidationError, match="--overlap on and --speculative"):
        settings_from_args(parse(["serve", "--overlap", "on", "--speculative", "ngram"]))


def test_help_and_bad_flags_import_neither_torch_nor_the_server():
    """`kvserve serve --help`, and a flag the settings refuse, answer without importing torch,
    transformers or uvicorn (seconds on a cold start); only serving imports them."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from server.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'uvicorn', 'fastapi') if m in sys.modules))\n"
    )
    for argv, status in ((["serve", "--help"], 0), (["serve", "--max-running", "0"], 0), (["--version"], 0)):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == status, done.stderr
        assert done.stdout.strip().splitlines()[-1] == "[]", (argv, done.stdout[-300:])
        if argv == ["--version"]:
            import server
            assert done.stdout.splitlines()[0] == f"kvserve {server.__version__}"
