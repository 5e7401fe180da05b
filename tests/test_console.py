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


def _progress_lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_a_long_stage_logs_its_progress_at_even_steps_without_a_terminal(monkeypatch, caplog):
    monkeypatch.setattr(console, "interactive", lambda: False)
    log = logging.getLogger("bake.test_progress")
    with caplog.at_level(logging.INFO, logger="bake.test_progress"):
        with console.Progress("[LS] least squares", 30, "layers", log) as progress:
            for _ in range(30):
                progress.advance()
    lines = _progress_lines(caplog, "bake.test_progress")
    assert [line.split(" (")[0] for line in lines] == [
        f"[LS] least squares: {k} of 30 layers" for k in (5, 10, 15, 20, 25, 30)
    ]


def test_on_a_terminal_the_progress_is_a_bar_not_log_lines(monkeypatch, caplog):
    monkeypatch.setattr(console, "interactive", lambda: True)
    log = logging.getLogger("bake.test_progress")
    with caplog.at_level(logging.INFO, logger="bake.test_progress"):
        with console.Progress("stats", 4, "batches", log) as progress:
            assert progress.bar is not None
            for _ in range(4):
                progress.advance()
            assert progress.bar.n == 4
    assert _progress_lines(caplog, "bake.test_progress") == []


def test_least_squares_and_the_activation_statistics_show_their_progress(monkeypatch, caplog):
    import torch
    from test_phase_a import tiny

    from bake.phases.phase_a.scores import activation_stats
    from bake.phases.phase_b.least_squares import least_squares

    monkeypatch.setattr(console, "interactive", lambda: False)
    stack = tiny()
    calib = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    keep = torch.rand(stack.num_virtual, stack.inter, generator=torch.Generator().manual_seed(1))
    keep = keep > 0.3
    with caplog.at_level(logging.INFO, logger="bake"):
        activation_stats(stack, calib)
        least_squares(stack, calib, keep.clone(), keep.clone())
    lines = [line.split(" (")[0] for line in _progress_lines(caplog, "bake")]
    assert lines[-1] == f"[LS] least squares: {stack.num_virtual} of {stack.num_virtual} layers"
    assert "[A] activation statistics: 2 of 2 batches" in lines
