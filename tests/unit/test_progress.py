"""The CLI's progress bars: drawn for a terminal only, never for a pipe, a file or --json."""

from __future__ import annotations

import io
import os

from node.cli import progress


def test_bars_are_wanted_on_a_terminal_only():
    """A pseudo-terminal gets bars; a pipe, a file-like buffer and --json output do not."""
    leader, follower = os.openpty()
    read_end, write_end = os.pipe()
    try:
        with open(follower, "w", closefd=False) as tty, open(write_end, "w", closefd=False) as pipe:
            assert progress.wanted(tty)
            assert not progress.wanted(tty, as_json=True)
            assert not progress.wanted(pipe)
        assert not progress.wanted(io.StringIO())
    finally:
        for fd in (leader, follower, read_end, write_end):
            os.close(fd)


def test_no_bars_means_no_callback():
    """Disabled bars hand out no callback at all, so the work they would follow is not slowed by one."""
    with progress.bars(False) as shown:
        assert shown is None
        assert progress.stage(shown, "loading") is None


def test_a_bar_per_phase_closes_when_its_phase_is_done(capsys):
    """Each phase gets its own bar on stderr, removed once done (what is printed next starts on a clean line)."""
    with progress.bars(True) as shown:
        assert shown is not None
        for done in range(1, 4):
            shown("self-testing the kernel", done, 3)
        assert shown._bar is None
        shown("loading experts", 1, 2)
        assert shown._bar is not None and shown._bar.desc == "loading experts"
    assert shown._bar is None
    err = capsys.readouterr().err
    assert "self-testing the kernel" in err and "loading experts" in err
