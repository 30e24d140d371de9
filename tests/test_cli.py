"""The qkv command."""
import pytest

from qkv import cli, dispatch


def test_info_lists_every_backend_and_why(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    for name in dispatch.REGISTRY:
        assert name in text
    assert "never automatic" in text and "numpy" in text


def test_check_passes(capsys):
    assert cli.main(["check"]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nonsense"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
