"""Every subcommand's --help prints (argparse formats help texts with %, so a literal one in a
config field's help once crashed 'xlserve kvstore --help')."""

import argparse

import pytest

from xlserve.cli import build_parser


def _commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


@pytest.mark.parametrize("command", _commands())
def test_every_subcommand_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    assert "usage: xlserve" in capsys.readouterr().out
