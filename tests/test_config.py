"""Composition of every shipped YAML, the schemas' compose-time refusals, the validation pass."""

from __future__ import annotations

import subprocess
import time

import pytest
from conftest import CONF, PYTHON, REPO, compose, run_bake, schema_settings, subprocess_env
from hydra.errors import ConfigCompositionException

from bake.errors import ConfigError
from bake.run.validate import validate

RECIPES = sorted((CONF / "model_recipe").glob("*.yaml"))  # applied with their model, not chosen
GROUP_FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF and p not in RECIPES)


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_yaml_composes(path):
    group = path.parent.relative_to(CONF).as_posix()
    cfg = compose([f"{group}={path.stem}"], hydra=group.startswith("hydra/"))
    node = cfg.hydra[group.split("/")[1]] if group.startswith("hydra/") else cfg[group]
    assert node is not None
    if group.startswith("hydra/"):  # bake's plugins (hydra_plugins.bake_sweeps)
        assert node._target_.startswith("hydra_plugins.bake_sweeps.")


def test_every_yaml_key_is_commented():
    for path in sorted(CONF.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        assert lines[0].startswith("#"), f"{path}: starts with a comment naming its command"
        assert any("python -m bake" in line for line in lines if line.startswith("#")), path
        for line in lines:
            body = line.split("#", 1)[0]
            is_key = ":" in body and not line.lstrip().startswith(("-", "#"))
            if is_key and body.rstrip().endswith(":") is False and not line.startswith(" "):
                assert "#" in line, f"{path}: {line!r} has no comment saying what it is"


# -- one source per default: the schema holds them, a preset states only what it changes -----
SCHEMAS = {
    "model": "ModelConf",
    "corpus": "CorpusConf",
    "phase_a": "PhaseAConf",
    "phase_b": "PhaseBConf",
    "export": "ExportConf",
    "task": "TaskConf",
    "tracking": "TrackingConf",
    "trainer": "TrainerConf",
}


# bake's Hydra plugins: each preset's own schema
PLUGIN_SCHEMAS = {
    "hydra/sweeper/bake_search": "bake.sweeps.search.SearchConf",
    "hydra/launcher/bake_local": "hydra_plugins.bake_sweeps.BakeLocalConf",
    "hydra/launcher/bake_slurm": "hydra_plugins.bake_sweeps.BakeSlurmConf",
}


def _schema_class(group: str):
    import importlib

    import bake.config.schema as schema

    if group in SCHEMAS:
        return getattr(schema, SCHEMAS[group])
    module, _, name = PLUGIN_SCHEMAS[group].rpartition(".")
    return getattr(importlib.import_module(module), name)


def _schema(group: str, stated: dict | None = None) -> dict:
    """The group's schema with its defaults (and ``stated`` merged over them), unresolved
    (MISSING as ``???``). ``group``: a config group, or a plugin preset's path."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(_schema_class(group))
    if stated:
        node = OmegaConf.merge(node, stated)
    return OmegaConf.to_container(node, resolve=False, enum_to_str=True)


def _stated(path) -> dict:
    """What a preset's YAML states, its parent preset's first (a ``defaults`` entry naming
    another option of the same group)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    out: dict = {}
    for entry in raw.pop("defaults", []):
        if isinstance(entry, str) and (path.parent / f"{entry}.yaml").is_file():
            out |= _stated(path.parent / f"{entry}.yaml")
    return out | raw


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict) and node:
        return {k: v for key, val in node.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_preset_is_the_schema_plus_the_changes_it_states(path):
    from omegaconf import OmegaConf

    group = path.parent.relative_to(CONF).as_posix()
    plugin = group.startswith("hydra/")
    schema_of = f"{group}/{path.stem}" if plugin else group
    schema, stated = _schema(schema_of), _stated(path)
    defaults = _flat(schema)
    for key, value in _flat(stated).items():  # a default is never restated (two sources)
        assert defaults.get(key, "<not in the schema>") != value, (
            f"{path.relative_to(CONF)}: {group}.{key}: {value!r} is the schema's default; a "
            f"preset states only what it changes"
        )
    expected = _schema(schema_of, stated)
    cfg = compose([f"{group}={path.stem}"], hydra=plugin)
    composed = cfg.hydra[group.split("/")[1]] if plugin else cfg[group]
    assert OmegaConf.to_container(composed, resolve=False, enum_to_str=True) == expected


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_model_recipe_changes_only_what_no_preset_states(path):
    """conf/model_recipe/<model>.yaml comes with model=<model>, after the presets: it sets only
    keys that no preset states (it never replaces what a chosen preset says), each away from
    the default; a value on the command line wins over it; other models never see it."""
    from omegaconf import OmegaConf

    assert (CONF / "model" / path.name).is_file(), f"{path.name}: no model preset of that name"
    stated = _flat(OmegaConf.to_container(OmegaConf.load(path)))
    presets = {
        f"{p.parent.name}.{key}"
        for p in GROUP_FILES
        if "hydra" not in p.parts
        for key in _flat(_stated(p))
    }
    base, cfg = compose(), compose([f"model={path.stem}"])
    assert stated
    for key, value in stated.items():
        assert key not in presets, f"{path.name}: {key} is stated by a preset too"
        assert OmegaConf.select(cfg, key) == value != OmegaConf.select(base, key), key
    key = next(iter(stated))
    assert OmegaConf.select(compose([f"model={path.stem}", f"{key}=7"]), key) == 7
    assert OmegaConf.select(compose(["model=tiny"]), key) == OmegaConf.select(base, key)


def test_the_default_bake_is_the_schema():
    """``python -m bake`` with no override runs the schema's defaults, with the default model
    and corpus: no default lives in a YAML file or anywhere else."""
    from omegaconf import OmegaConf

    cfg = compose()
    for group in ("phase_a", "phase_b", "export", "tracking", "trainer"):
        composed = OmegaConf.to_container(cfg[group], resolve=False, enum_to_str=True)
        assert composed == _schema(group), f"{group}: the default preset changes the schema"
    assert (cfg.model.name, cfg.corpus.name) == ("smollm2", "python_stdlib")


def test_the_memory_plan_reads_the_composed_config_only():
    """The plan's knobs come from the resolved settings: change a setting, the knob follows
    (no fallback of the plan's own)."""
    from bake.memory.plan import Knobs
    from bake.models.sources import read_meta, read_shape
    from bake.phases.settings import resolve

    def knobs(*overrides):
        cfg = compose(["model=tiny", *overrides])
        meta = read_meta(cfg.model)
        return Knobs.of(resolve(cfg, meta), read_shape(cfg.model, meta), "cpu")

    base = knobs()
    assert (base.learned, base.ls, base.optimizer, base.ckpt) == (False, True, "adafactor", True)
    assert base.ls_stream and base.b_layers == 4 and base.keep == pytest.approx(0.8)
    assert not knobs("phase_b.ls_drift=0").ls_stream
    assert knobs("phase_b.optimizer=adam").optimizer == "adam"
    assert knobs("phase_a=reference").learned and knobs("phase_a=reference").ls
    assert not knobs("phase_a=reference", "phase_b=reference").ls


def test_reference_presets_are_the_reference_recipe():
    cfg = compose(["phase_a=reference", "phase_b=reference", "export=reference"])
    a, b, c, e = cfg.phase_a, cfg.phase_b, cfg.corpus, cfg.export
    assert cfg.model.name == "smollm2" and cfg.seed == 0
    assert (a.steps, a.l1_init, a.l1_step, a.l1_mult, a.lr) == (240, 0.01, 0.005, 1.0, 0.1)
    assert (a.eval_every, a.tau, a.target_sparsity) == (30, 0.5, 0.0)
    assert (a.method, a.controller, a.gate, a.init, a.init_logit) == (
        "learned",
        "none",
        "sigmoid",
        "constant",
        2.0,
    )
    assert (b.steps, b.lr, b.layers, b.eval_every) == (120, 1e-5, 4, 30)
    assert (b.all_layers, b.distill, b.least_squares, list(b.lr_probe)) == (False, 0.0, False, [])
    assert (e.align, e.uniform_inter, e.align_before_repair) == (32, False, False)
    assert (c.chunk_len, c.held_chunks, c.calib_chunks, c.chunks_per_doc) == (256, 12, 240, 1)


def test_the_default_shrinks_to_a_stock_loadable_model():
    cfg = compose()
    assert cfg.phase_a.target_sparsity >= 0.2  # make bake: at least 20% of the FFN removed
    assert cfg.export.uniform_inter and cfg.export.align_before_repair  # met after alignment


@pytest.mark.parametrize(
    "override, key",
    [
        ("phase_a.l1_mult=two", "phase_a.l1_mult"),
        ("phase_a.stepz=3", "phase_a.stepz"),
        ("phase_a.gate=sigmoidal", "phase_a.gate"),
        ("corpus.chunk_len=1.5", "corpus.chunk_len"),
    ],
)
def test_wrong_type_or_unknown_key_fails_at_compose(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose([override])
    assert key.rsplit(".", 1)[-1] in str(err.value.__cause__ or err.value)


def test_validation_reports_every_problem_with_its_path():
    cfg = compose(
        [
            "phase_a=learned",  # its own parameters check themselves
            "phase_a.tau=1.5",
            "phase_b.layers=0",
            "export.align=-1",
            "corpus.chunk_len=1",
            "phase_a.target_sparsity=1.0",
            "phase_a.steps=0",
            "phase_a.eval_every=0",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    for path in (
        "phase_a.tau=1.5",
        "phase_b.layers=0",
        "export.align=-1",
        "corpus.chunk_len=1",
        "phase_a.target_sparsity=1.0",
        "phase_a.steps=0",
        "phase_a.eval_every=0",
    ):
        assert path in text
    assert len(err.value.problems) == 7


def test_a_target_no_aligned_structure_meets_is_refused_naming_it():
    cfg = compose(["model=tiny", "phase_a.target_sparsity=0.85", "export.align=32"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)  # 160 neurons per layer: one multiple of 32 keeps 20%, 80% pruned at most
    assert "phase_a.target_sparsity=0.85: cannot be met with export.align=32" in str(err.value)
    validate(compose(["model=tiny", "phase_a.target_sparsity=0.8", "export.align=32"]))


def test_shape_checks_read_metadata_only():
    cfg = compose(
        ["phase_b.layers=31", "phase_b.all_layers=false", "corpus.chunk_len=9000"]
    )  # smollm2: 30 layers, 8192
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert time.perf_counter() - t0 < 5  # the GGUF header, not the weights
    assert "phase_b.layers=31: must be in [1, 30]" in str(err.value)
    assert "corpus.chunk_len=9000: above the model's context of 8192" in str(err.value)


@pytest.mark.cli
def test_in_process_exit_code_2_and_no_traceback(capsys):
    args = ["phase_a=learned", "phase_a.tau=1.5", "phase_b.layers=0", "paths.outputs=/nonexistent"]
    assert run_bake(args) == 2
    err = capsys.readouterr().err
    assert "phase_a.tau=1.5" in err and "phase_b.layers=0" in err
    assert "Traceback" not in err


@pytest.mark.subprocess
def test_cli_subprocess_config_errors_and_cfg_job(tmp_path):
    env = subprocess_env()
    bad = subprocess.run(
        [PYTHON, "-m", "bake", "phase_a=learned", "phase_a.tau=1.5", "phase_b.layers=0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stderr
    assert "phase_a.tau=1.5" in bad.stderr and "phase_b.layers=0" in bad.stderr
    assert "Traceback" not in bad.stderr
    typo = subprocess.run(
        [PYTHON, "-m", "bake", "phase_a.l1_mult=two"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typo.returncode != 0 and "phase_a.l1_mult" in typo.stderr
    job = subprocess.run(
        [PYTHON, "-m", "bake", "model=nanbeige", "phase_a.l1_mult=2", "--cfg", "job"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    assert "Nanbeige/Nanbeige4.2-3B" in job.stdout and "phase_a:" in job.stdout
    assert "  l1_mult: 2.0" in job.stdout  # the users' headline command composes
    assert not list((tmp_path / "outputs").glob("runs/*/*"))  # no run directory left behind


def test_reconstruction_is_refused_where_least_squares_cannot_choose_naming_why():
    cfg = compose(
        [
            "model=tiny",
            "phase_a=reconstruction",
            "phase_b.least_squares=false",
            "export.align_before_repair=false",
        ]
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    assert "phase_b.least_squares=false: phase_a.method=reconstruction chooses" in text
    assert "export.align_before_repair=false: phase_a.method=reconstruction chooses" in text
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=tiny_looped", "phase_a=reconstruction"]))
    assert "model.loops=2: phase_a.method=reconstruction chooses" in str(err.value)
    validate(compose(["model=tiny", "phase_a=reconstruction"]))


def test_the_learning_rate_probe_is_refused_where_it_cannot_choose_naming_why():
    for override, words in (
        ("phase_b.lr_probe=[0.5]", "one rate is no choice"),
        ("phase_b.lr_probe=[1,-0.3]", "must be finite fractions > 0"),
        ("phase_b.lr_probe_steps=0", "must be >= 1"),
    ):
        with pytest.raises(ConfigError) as err:
            validate(compose(["model=tiny", "phase_b.lr_probe=[1,0.1]", override]))
        assert override.split("=")[0] in str(err.value) and words in str(err.value), override
    validate(compose(["model=tiny", "phase_b.lr_probe=[1,0.3,0.1]", "phase_b.steps=5"]))


def test_what_a_model_recipe_set_is_named_less_what_the_command_line_set():
    from bake.config.layout import recipe_values

    assert recipe_values("qwen2_5_coder", ["phase_b.steps=30"]) == {
        "corpus.calib_chunks": 96,
        "phase_b.ls_chunks": 48,
        "phase_b.distill": 1,
    }
    assert recipe_values(None, []) == {}


@pytest.mark.cli
@pytest.mark.parametrize("value", ["qwen2_5_codr", "null"])
def test_a_model_recipe_that_does_not_exist_is_refused(tmp_path, capsys, value):
    from conftest import run_bake

    assert run_bake(["model=tiny", f"model_recipe={value}", f"paths.outputs={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert f"model_recipe={value}: no such recipe (there are: qwen2_5_coder)" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.cli
@pytest.mark.parametrize(
    "override, says",
    [
        ("phase_b.lr_probe_steps=1.5", "could not be converted to Integer"),
        ("phase_b.lr_probe=[a,b]", "Value 'a' of type 'str' could not be converted to Float"),
        ("phase_b.lr_probe=nan", "not a ListConfig, list or tuple"),
        ("task.limit=some", "could not be converted to Integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_and_exit_2(tmp_path, capsys, override, says):
    from conftest import run_bake

    assert run_bake(["model=tiny", override, f"paths.outputs={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bake: {override}: {err[0].split(': ', 2)[2]}"] and says in err[0]


@pytest.mark.cli
def test_cfg_job_says_which_values_the_model_recipe_set(capsys):
    from conftest import run_bake

    assert run_bake(["model=qwen2_5_coder", "phase_b.steps=30", "--cfg", "job"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        "# set by the model recipe conf/model_recipe/qwen2_5_coder.yaml: "
        "corpus.calib_chunks=96, phase_b.ls_chunks=48, phase_b.distill=1"
    )


def test_the_settings_carry_no_default_of_their_own():
    """The schema is the one source of a default: the resolved settings take every value from
    the composed config (Phase B's ``baseline`` is the figure its stage starts from, not a
    setting)."""
    from dataclasses import MISSING, fields

    from bake.phases import settings

    classes = [
        settings.PhaseASettings,
        settings.PhaseBSettings,
        settings.LeastSquaresSettings,
        settings.ExportSettings,
        settings.Settings,
    ]
    defaults = {
        f"{c.__name__}.{f.name}"
        for c in classes
        for f in fields(c)
        if f.default is not MISSING or f.default_factory is not MISSING
    }
    assert defaults == {"PhaseBSettings.baseline"}


def test_phase_a_settings_hold_only_what_every_method_shares():
    """A method's own parameters are its own (bake.phases.phase_a: a learned mask's fifteen);
    Phase A's settings keep the shared fields and the composed method's parameters."""
    from dataclasses import fields

    from bake.phases.phase_a.mask import LearnedParams
    from bake.phases.settings import PhaseASettings

    assert len(fields(PhaseASettings)) <= 6
    learned = schema_settings("phase_a=learned").phase_a
    assert isinstance(learned.params, LearnedParams) and learned.trains
    flap = schema_settings().phase_a
    assert flap.params is None and not flap.trains and flap.tau == 0.5
