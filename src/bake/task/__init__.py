"""The skill a bake keeps, judged on the task's own tests (the ``task`` group): HumanEval's
problems or a user's, completed greedily by the backbone and by the exported artifact
(:mod:`bake.task.generate`), each program run in a sandbox (:mod:`bake.task.sandbox`), pass@1
in report.json (:mod:`bake.task.stage`). ``python -m bake.evaluate`` scores a finished run, a
model directory or a GGUF file (:mod:`bake.task.evaluate`).
"""
