"""`sharedprefix verify`, `plan` and the help text."""

from sharedprefix.cli.main import main


def test_verify_reports_exactness(capsys):
    assert main(["verify", "--no-speed"]) == 0
    captured = capsys.readouterr()
    assert "-> OK" in captured.out and "budget=  20 prefix=recompute" in captured.out
    assert captured.err == ""  # stderr is not a terminal here: no progress bar


def test_plan_shows_passes_and_plain_tokens(capsys):
    assert main(["plan", "--prompt", "4096", "--completion", "256", "--group-size", "32", "--max-tokens", "6144"]) == 0
    out = capsys.readouterr().out
    assert "prompt backward of group 0" in out
    assert "tokens computed 12288, plain run 139264" in out  # 4096 + 32 x 256 vs 32 x (4096 + 256)


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "train" in capsys.readouterr().out
