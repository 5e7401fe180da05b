"""The terminal: log lines written around the progress bars, the bar's fields, library quiet."""

from __future__ import annotations

import io
import logging

from bake.phases.common import bar_postfix
from bake.tracking import console


class Terminal(io.StringIO):
    """What a terminal receives, in order."""

    def isatty(self) -> bool:
        return True


def test_a_log_line_clears_the_bar_first_and_the_bar_is_drawn_again_below_it():
    from tqdm import tqdm

    screen = Terminal()
    bar = tqdm(total=10, file=screen, desc="phase a", ncols=60, mininterval=0)
    bar.update(3)
    drawn = screen.getvalue()
    console.BarSafeStream(screen).write("[A] step 3: held-PPL 262.740\n")
    after = screen.getvalue()[len(drawn) :]
    bar.close()
    line = after.index("[A] step 3")
    # Before the line: the bar's row blanked and the cursor back at its start.
    assert after[:line].startswith("\r") and after[:line].endswith("\r")
    assert after[:line].strip(" \r") == ""
    # After it: the bar again, on the next row.
    assert "phase a:  30%" in after[line:].split("\n", 1)[1]


def test_without_a_bar_the_line_is_written_as_it_is():
    screen = Terminal()
    console.BarSafeStream(screen).write("a line\n")
    assert screen.getvalue() == "a line\n"


def test_setup_wraps_only_handlers_that_write_to_a_terminal(monkeypatch, tmp_path):
    monkeypatch.setattr(console, "interactive", lambda: True)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logger = logging.getLogger("bake.test_console")
    tty, pipe = logging.StreamHandler(Terminal()), logging.StreamHandler(io.StringIO())
    file = logging.FileHandler(tmp_path / "bake.log")
    for h in (tty, pipe, file):
        logger.addHandler(h)
    try:
        console.setup()
        console.setup()  # a second job of a sweep: not wrapped twice
        assert isinstance(tty.stream, console.BarSafeStream)
        assert not isinstance(tty.stream.stream, console.BarSafeStream)
        assert not isinstance(pipe.stream, console.BarSafeStream)
        assert not isinstance(file.stream, console.BarSafeStream)
        chatter = logging.getLogger("alembic")  # the store's migrations
        assert chatter.getEffectiveLevel() == logging.WARNING
        # "Creating initial MLflow ...", and a locked store's traceback (bake reports it)
        assert logging.getLogger("mlflow.store.db.utils").getEffectiveLevel() > logging.ERROR
    finally:
        logging.captureWarnings(False)
        for h in (tty, pipe, file):
            logger.removeHandler(h)
        file.close()


def test_the_bar_shows_the_fields_as_the_log_lines_write_them():
    shown = bar_postfix({"ce": 5.4, "l1": 0.0251, "pruned%": 4.6875, "held_ppl": 262.7401})
    assert shown == {"L1": "0.025", "pruned": "4.69%", "held-PPL": "262.740", "ce": "5.400"}
    assert list(shown) == ["L1", "pruned", "held-PPL", "ce"]
    assert bar_postfix({"ce": 5.4, "held_ppl": 262.7401, "v_num": 3}) == {
        "held-PPL": "262.740",
        "ce": "5.400",
        "v_num": "3",
    }


def test_a_failing_phase_finishes_its_bar_so_the_next_line_starts_below_it():
    from lightning.pytorch.callbacks import TQDMProgressBar
    from tqdm import tqdm

    from bake.phases.common import _phase_bar

    screen = Terminal()
    callback = _phase_bar(TQDMProgressBar, "phase a")
    callback._train_progress_bar = tqdm(total=10, file=screen, ncols=60, mininterval=0)
    callback._train_progress_bar.update(4)
    callback.on_exception(None, None, RuntimeError("the loss became nan"))
    assert callback._train_progress_bar not in tqdm._instances
    assert screen.getvalue().endswith("\n")  # the bar's row is finished
