"""Shared fixtures: the composed config, the tiny models, a small corpus, in-process bakes.

Most tests run bake in this process (``bake.cli.main``), so the ~10 s of imports are paid
once; a handful run real ``python -m bake`` subprocesses.
"""

from __future__ import annotations

import json
import os
import random
import signal as signal_module
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _CurrentStderr:
    """A stream that writes to whatever ``sys.stderr`` is at the time of the write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True, scope="session")
def _library_log_handlers_follow_stderr():
    """Point the libraries' own stderr handlers at the current ``sys.stderr``.

    transformers, lightning and mlflow each attach a handler that keeps the ``sys.stderr`` of the
    moment it was made. Made inside a ``capsys`` test, that stream is closed when the test ends
    and every later warning becomes a logging error, depending on test order.
    """
    import logging

    import lightning.pytorch  # noqa: F401
    import mlflow  # noqa: F401
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # makes the library's handler now
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler and handler.stream in (
                sys.stderr,
                sys.__stderr__,
            ):
                handler.setStream(_CurrentStderr())
                handler.__dict__.pop("flush", None)  # transformers binds the old stream's flush
    yield


def compose(overrides: list[str] | None = None, hydra: bool = False):
    """The composed config (Hydra's compose API), as the command line would build it; with
    ``hydra``, its ``hydra`` node too."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import bake.config  # noqa: F401  (schemas, resolvers)
    import hydra_plugins.bake_sweeps  # noqa: F401  (the plugins' schemas, as bake.cli loads them)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(
            "config",
            overrides=["paths.outputs=/nonexistent", *(overrides or [])],
            return_hydra_config=hydra,
        )


def schema_settings(*overrides: str, **changes):
    """The resolved settings of ``model=tiny`` with ``overrides`` (every other value the
    schema's default, the one source of defaults), with the phase sections' ``changes``:
    ``phase_a={...}``, ``phase_b={...}`` (tests that drive a phase's module directly). Phase A's
    ``method`` is composed; its other changes go to the shared fields and, for the keys of the
    method's own parameters (a learned mask's steps, lr, ...), to ``params``."""
    from dataclasses import fields, replace

    from bake.models.sources import read_meta
    from bake.phases.settings import resolve

    a = dict(changes.get("phase_a", {}))
    method = [f"phase_a.method={a.pop('method')}"] if "method" in a else []
    cfg = compose(["model=tiny", *overrides, *method])
    s = resolve(cfg, read_meta(cfg.model, cfg.paths.cache))
    sections = {k: replace(getattr(s, k), **v) for k, v in changes.items() if k != "phase_a"}
    if a:
        shared = {f.name for f in fields(s.phase_a)}
        params = s.phase_a.params
        own = {f.name for f in fields(params)} if params is not None else set()
        unknown = set(a) - shared - own
        assert not unknown, f"not a Phase A setting of this method: {sorted(unknown)}"
        if own & set(a):
            params = replace(params, **{k: v for k, v in a.items() if k in own})
        sections["phase_a"] = replace(
            s.phase_a, params=params, **{k: v for k, v in a.items() if k in shared}
        )
    return replace(s, **sections)


def save_phi3(folder: Path) -> Path:
    """A tiny random Phi-3 (its MLP fuses gate and up: not a gated MLP bake can prune)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    Phi3ForCausalLM(
        Phi3Config(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=300,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    ).save_pretrained(folder)
    return folder


WORDS = (
    "def return class import self value list dict print result index error data file path "
    "name model layer token chunk mask gate neuron train step loss batch open close read write"
).split()


def write_docs(folder: Path, n: int, seed: int = 0, min_lines: int = 20, max_lines: int = 60):
    """``n`` small Python-like text documents (deterministic)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        lines = []
        for _ in range(rng.randint(min_lines, max_lines)):
            indent = "    " * rng.randint(0, 2)
            lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))))
        (folder / f"doc_{i:03d}.py").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="session")
def docs_dir(tmp_path_factory) -> Path:
    return write_docs(tmp_path_factory.mktemp("docs"), 80)


def tiny_args(outputs: Path, docs: Path, *extra: str) -> list[str]:
    """Overrides of a fast tiny bake on the small corpus. Phase A TRAINS (the controller,
    ``phase_a=scheduled``) unless ``extra`` picks another preset: the default's Wanda-sp
    selection has no steps to kill, resume or checkpoint."""
    preset = [] if any(e.startswith("phase_a=") for e in extra) else ["phase_a=scheduled"]
    return [
        "model=tiny",
        "corpus=text_files",
        f"corpus.glob={docs}/*.py",
        "corpus.chunk_len=32",
        "corpus.held_chunks=6",
        "corpus.calib_chunks=24",
        "phase_a.steps=24",
        "phase_a.eval_every=8",
        "phase_a.lr=0.4",
        "phase_a.l1_mult=20",
        "phase_b.steps=8",
        "phase_b.eval_every=4",
        "phase_b.layers=2",
        "phase_b.lr_probe=[]",  # Phase B at phase_b.lr: its steps are the ones a test counts
        "trainer.progress_bar=false",
        "trainer.eval_batch_size=4",
        f"paths.outputs={outputs}",
        *extra,
        *preset,
    ]


def run_bake(args: list[str]) -> int:
    """``python -m bake ARGS`` in this process; returns the exit code."""
    from bake.cli import main

    return main(args)


def last_run(outputs: Path) -> Path:
    runs = sorted((outputs / "runs").glob("*/*"))
    assert runs, f"no run directory under {outputs}"
    return runs[-1]


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


PYTHON = sys.executable


class InterruptAt:
    """A Lightning callback that presses Ctrl-C once a phase reaches a global step (for tests,
    given as ``+trainer.callbacks=[{_target_: conftest.InterruptAt, ...}]``)."""

    def __new__(cls, phase: str, step: int):
        from lightning.pytorch.callbacks import Callback

        class _Interrupt(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if type(pl_module).__name__ == f"Phase{phase.upper()}" and (
                    trainer.global_step == step
                ):
                    raise KeyboardInterrupt

        return _Interrupt()


def interrupt(phase: str, step: int) -> str:
    return f"trainer.callbacks=[{{_target_:conftest.InterruptAt,phase:{phase},step:{step}}}]"


class SignalAt:
    """A Lightning callback that sends its own process a signal once a phase reaches a global
    step, the first time only (``marker`` records it): SIGUSR2 is what a cluster sends before
    preempting a submitit job or at its time limit (submitit then requeues it), SIGTERM what
    ``kill`` sends."""

    def __new__(
        cls, phase: str, step: int, marker: str, signal: str = "SIGUSR2", job: int | None = None
    ):
        from lightning.pytorch.callbacks import Callback

        signum = getattr(signal_module, signal)
        where = None if job is None else f"{os.sep}{job}{os.sep}checkpoints{os.sep}"

        class _Signal(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if type(pl_module).__name__ != f"Phase{phase.upper()}":
                    return
                if where is not None and where not in str(trainer.default_root_dir) + os.sep:
                    return  # another job of the sweep
                if trainer.global_step == step and not Path(marker).exists():
                    Path(marker).write_text(str(os.getpid()))
                    os.kill(os.getpid(), signum)

        return _Signal()


def signal_at(
    phase: str, step: int, marker: Path, signal: str = "SIGUSR2", job: int | None = None
) -> str:
    """The override that adds :class:`SignalAt` (``job``: only in that job of a sweep)."""
    spec = f"_target_:conftest.SignalAt,phase:{phase},step:{step},marker:'{marker}',signal:{signal}"
    if job is not None:
        spec += f",job:{job}"
    return f"trainer.callbacks=[{{{spec}}}]"


class PoisonAt:
    """A Lightning callback that makes Phase A's loss NaN after a global step (for tests)."""

    def __new__(cls, step: int):
        from lightning.pytorch.callbacks import Callback

        class _Poison(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if type(pl_module).__name__ == "PhaseA" and trainer.global_step == step:
                    with __import__("torch").no_grad():
                        pl_module.logits[0, 0] = float("nan")

        return _Poison()
