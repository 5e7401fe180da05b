"""bake's Hydra plugins: ``hydra/sweeper=bake_search`` (an Optuna search), and the launchers
``hydra/launcher=bake_local`` and ``hydra/launcher=bake_slurm`` (submitit's, told what a bake
needs). Hydra imports this module when it looks for plugins, so it stays light: the work is in
:mod:`bake.sweeps`, imported when a plugin runs. Their settings are the dataclasses registered
here; conf/hydra/ holds the presets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper

from bake.errors import BakeError
from bake.run.guard import refuse
from bake.sweeps.search import Search, SearchConf


class BakeSearch(Sweeper):
    """``hydra/sweeper=bake_search``: :class:`bake.sweeps.search.Search`."""

    def __init__(self, **conf: Any) -> None:
        conf.pop("_target_", None)
        self.search = Search(SearchConf(**conf))

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        try:
            return self.search.sweep(arguments)
        except BakeError as exc:
            refuse(str(exc), code=2)


ConfigStore.instance().store(
    group="hydra/sweeper", name="bake_search_schema", node=SearchConf, provider="bake"
)
PLUGINS: list[type] = [BakeSearch]


def register() -> None:
    """Register the plugins with Hydra. Its scan of ``hydra_plugins`` finds them in an
    installed wheel, but not under an editable install (whose namespace packages it cannot
    list), so bake's command line registers them itself (:mod:`bake.cli`)."""

    plugins = Plugins.instance()
    for clazz in PLUGINS:
        if f"{clazz.__module__}.{clazz.__name__}" not in plugins.class_name_to_class:
            plugins.register(clazz)


try:  # the launchers need hydra-submitit-launcher (bake's `cluster` extra)
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        LocalLauncher,
        SlurmLauncher,
    )
except ImportError:  # pragma: no cover - without the extra, only the search is offered
    pass
else:

    @dataclass
    class BakeSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.bake_sweeps.BakeSlurmLauncher"

    @dataclass
    class BakeLocalConf(LocalQueueConf):
        _target_: str = "hydra_plugins.bake_sweeps.BakeLocalLauncher"
        parallel: int | None = None  # jobs at once; null: as many as memory and cores allow
        timeout_min: int = 10080  # a week: on one machine a bake runs to its end
        max_num_timeout: int = 3  # times a job out of time is requeued (it resumes)

    class BakeSlurmLauncher(SlurmLauncher):
        """``hydra/launcher=bake_slurm``: submitit's SLURM launcher, asking for the memory of
        bake's plan and refusing a GPU the jobs would not use."""

        def launch(self, job_overrides, initial_job_idx):
            import bake.sweeps.launchers as launchers  # lazy: torch

            gpus = launchers.uses_gpu(self.params)
            launchers.check_accelerator(self, job_overrides, gpus)
            if self.params.get("mem_gb") is None:
                plans = launchers.job_plans(self, job_overrides, "cuda" if gpus else "cpu")
                self.params["mem_gb"] = launchers.slurm_memory(plans)
                launchers.log_memory(self.params["mem_gb"], plans)
            return super().launch(job_overrides, initial_job_idx)

    class BakeLocalLauncher(LocalLauncher):
        """``hydra/launcher=bake_local``: the jobs as processes of this machine, as many at
        once as the plan and the cores allow."""

        def launch(self, job_overrides, initial_job_idx):
            import bake.sweeps.launchers as launchers  # lazy: torch

            return launchers.launch_local(self, job_overrides, initial_job_idx)

    PLUGINS += [BakeSlurmLauncher, BakeLocalLauncher]
    store = ConfigStore.instance()
    store.store(
        group="hydra/launcher", name="bake_slurm_schema", node=BakeSlurmConf, provider="bake"
    )
    store.store(
        group="hydra/launcher", name="bake_local_schema", node=BakeLocalConf, provider="bake"
    )
