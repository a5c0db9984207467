"""The Slurm backend's login side: submitit parameters, the executors (arrays and packs), the preview,
the checks before anything is queued, the array limits, the submitted script."""
from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import launcher.backends.slurm.limits as limits
from launcher.backends.base import (
    limit_overrides,
    request_limits,
    submitit_parameters,
)
from launcher.backends.slurm.limits import (
    JOB_NAME_MAX,
    QUEUE_FORMAT,
    capacity_problems,
    partition_qos_from_scontrol,
    queued_from_squeue,
    submit_bounds,
)
from launcher.backends.slurm.text import (
    code_lines,
    cpu_lines,
    enforces_limits,
    env_lines,
    fs_type,
    limits_from_config,
    own_addresses,
    requeue_lines,
    setup_lines,
    unshared_runs_root,
)
from launcher.features.elastic import resize as elastic
from launcher.features.nodes import exclude as node_exclude
from launcher.run.job_record import JobRecord
from launcher.runtime import job_start
from launcher.sweeps import MAX_JOB_COUNT, ArrayLimits

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


class SlurmSubmission:
    """Submitting to Slurm (a mixin of SlurmBackend)."""

    def parameters(self, cfg: RunConfig, code_dir: Optional[Path] = None) -> Dict[str, Any]:
        cl = cfg.cluster
        params: Dict[str, Any] = {
            "job_name": str(cfg.submit.job_name),
            "time": int(cl.time_min),
            "nodes": int(cl.nodes),
            "ntasks_per_node": int(cl.gpus_per_node),
            "cpus_per_task": int(cl.cpus_per_task),
            "array_parallelism": int(cl.array_parallelism),
            "setup": setup_lines(cl.setup) + env_lines(dict(cl.env)) + code_lines(code_dir) +
            cpu_lines(int(cl.cpus_per_task)),
            # Slurm signals USR2 this long before the time limit: the run checkpoints and requeues
            "signal_delay_s": int(cl.signal_delay_s),
            # one rank failing ends the step at once instead of leaving the others in a collective;
            # since Slurm 22.05 srun no longer inherits --cpus-per-task: without it every rank is
            # bound to one CPU (data loading, CPU Adam and OMP threads all on one core)
            "srun_args": ["--kill-on-bad-exit=1", f"--cpus-per-task={int(cl.cpus_per_task)}"],
        }
        # cluster.elastic: its restarts are new jobs the run's deciding job submits; Slurm requeues nothing
        if elastic.settings(cfg)["enabled"]:
            params["setup"] = params["setup"] + [f"export {elastic.ENV}=1"]
        if cl.get("exclusive"):
            params["exclusive"] = True  # sbatch --exclusive: no other job shares the nodes
        if cl.use_gpus:
            params["gpus_per_node"] = int(cl.gpus_per_node)
        for key in ("partition", "account", "qos", "constraint"):
            value = cl.get(key)
            if value:
                params[key] = str(value)
        if cl.mem_gb is not None:  # 0: --mem=0, all of each node's memory
            params["mem"] = f"{int(cl.mem_gb)}GB" if int(cl.mem_gb) else "0"
        # a value true (its YAML typed as a string here) is a bare flag: --no-requeue, not --no-requeue=True
        extra = {str(k): True if str(v).lower() == "true" else v for k, v in cl.sbatch_extra.items()}
        # submitit's own parameters as given (the Hydra launcher's hydra-submitit-launcher options:
        # comment, exclude, gres, ...; additional_parameters with their types, true a bare flag)
        raw = submitit_parameters(cl)
        extra.update(raw.pop("additional_parameters", None) or {})
        params.update(raw)
        if elastic.settings(cfg)["enabled"]:
            extra["no-requeue"] = True
        # cluster.health: the nodes the ledger excludes (launcher.features.nodes), beside the user's own
        left_out = node_exclude.for_job(cfg, int(cl.nodes), lambda: self.partition_nodes(cl.get("partition")))
        if left_out.nodes:  # one --exclude: the user's own list and the ledger's
            mine = ",".join(str(v) for v in (params.get("exclude"), extra.pop("exclude", None)) if v)
            params["exclude"] = node_exclude.merged(mine, left_out.nodes)
        node_exclude.say(left_out)
        if code_dir is not None:
            extra.setdefault("chdir", str(code_dir))  # `python -m` puts the working dir first on sys.path
        if extra:
            params["additional_parameters"] = extra
        return params

    @staticmethod
    def partition_nodes(partition: Optional[str]) -> Optional[List[str]]:
        """The names of the nodes of ``partition`` (None: the default one); None where unknown."""
        try:
            nodes = limits.cluster_nodes()
        except Exception:  # (sinfo failing): every excluded node is left out, as if there were room
            return None
        names = [n.name for n in limits.in_partition(nodes, partition)]
        return names if names and all(names) else None

    def submission(self, cfg: RunConfig, code_dir: Optional[Path], job_name: Optional[str],
                   parallelism: Optional[int], folder: Path) -> Dict[str, Any]:
        """The executor parameters of one submission: the point's, with the submission's name and throttle,
        and the batch script's teardown."""
        params = self.parameters(cfg, code_dir)
        lines = requeue_lines(folder)
        params["setup"] = params["setup"] + lines["setup"]
        params["teardown"] = lines["teardown"]
        if job_name is not None:
            params["job_name"] = str(job_name)
        if parallelism is not None:
            params["array_parallelism"] = max(1, int(parallelism))  # sbatch --array=0-<n-1>%<k>
        return params

    def executor(self, cfg: RunConfig, folder: Path, code_dir: Optional[Path] = None, job_name: Optional[str] = None,
                 parallelism: Optional[int] = None) -> Any:
        from submitit import SlurmExecutor  # submitit: only to submit or read a job, not on the plan/--help path

        ex = SlurmExecutor(folder=folder, python=job_start.python_command())  # stop signals held from the start
        ex.update_parameters(**self.submission(cfg, code_dir, job_name, parallelism, folder))
        return ex

    def pack_parameters(self, cfg: RunConfig, code_dir: Optional[Path], job_name: Optional[str], nodes: int,
                        folder: Path) -> Dict[str, Any]:
        """The pack's job: ``nodes`` whole nodes (--exclusive: the runner shares them among its points'
        steps), every GPU of them where the points use GPUs; one process (no srun: the runner starts the
        steps), the points' setup lines and environment; no teardown (the runner decides each point's
        end itself)."""
        params = self.parameters(cfg, code_dir)
        cl = cfg.cluster
        params.update(nodes=int(nodes), ntasks_per_node=1, use_srun=False, exclusive=True, teardown=[])
        params.pop("srun_args", None)
        params.pop("mem", None)  # whole nodes: all their memory
        if cl.use_gpus:
            part = cl.get("partition")
            sizes = [n.gpus for n in limits.in_partition(limits.cluster_nodes(), str(part) if part else None)]
            params["gpus_per_node"] = max(sizes + [int(cl.gpus_per_node)])
        if job_name is not None:
            params["job_name"] = str(job_name)
        params.pop("array_parallelism", None)
        return params

    def pack_preview(self, cfg: RunConfig, folder: Path, points: List[int], nodes: int, code_dir: Optional[Path] = None,
                     job_name: Optional[str] = None) -> str:
        params = self.pack_parameters(cfg, code_dir, job_name, nodes, folder)
        lines = [f"#   {k}: {v}" for k, v in sorted(params.items()) if k != "setup"]
        return "\n".join([f"# ---- pack of points {points}: ONE job of {nodes} node(s) (cluster.pack=true); "
                          "each point a job step (srun --exact)", *lines])

    def after(self, job_id: str) -> List[str]:
        # --kill-on-invalid-dep: a rung whose predecessor failed leaves the queue instead of waiting for ever
        return [f"++cluster.sbatch_extra.dependency=afterok:{job_id}", "++cluster.sbatch_extra.kill-on-invalid-dep=yes"]

    def pack_node_limit(self, cfg: RunConfig) -> Optional[int]:
        """The nodes of the pack's partition (sinfo, cached): a pack asks whole nodes."""
        part = cfg.cluster.get("partition")
        names = limits.in_partition(limits.cluster_nodes(), str(part) if part else None)
        return len(names) or None

    def pack_executor(self, cfg: RunConfig, folder: Path, code_dir: Optional[Path], job_name: Optional[str],
                      nodes: int) -> Any:
        from submitit import SlurmExecutor  # submitit: only to submit or read a job, not on the plan/--help path

        ex = SlurmExecutor(folder=folder, python=job_start.python_command())  # stop signals held from the start
        ex.update_parameters(**self.pack_parameters(cfg, code_dir, job_name, nodes, folder))
        return ex

    def runs_root_problem(self, runs_root: Path, cfg: Optional[RunConfig] = None) -> Optional[str]:
        """A runs root on a filesystem only this host has, for nodes that are other hosts: the job
        would wait 120 s for its run dir and fail. Unknown (no sinfo, no /proc/mounts): None."""
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
        part = cfg.cluster.get("partition") if cfg is not None else None
        nodes = [ln.split() for ln in limits.run(["sinfo", "-h", "-N", "-o", "%N %o"]
                                           + (["-p", str(part)] if part else [])).splitlines()]
        return unshared_runs_root(runs_root, fs_type(runs_root, mounts), {n[1] for n in nodes if len(n) == 2},
                                  own_addresses())

    def request_problems(self, cfg: RunConfig) -> List[str]:
        """The shared bounds, the job name's (slurmctld's 1024 bytes), and a request no node set of its
        partition could ever hold (cluster.nodes, per-node GPUs, CPUs, memory; sinfo, cached)."""
        out = request_limits(cfg, job_name_max=JOB_NAME_MAX)
        cl = getattr(cfg, "cluster", None)
        try:
            want = int(cl.nodes), int(cl.gpus_per_node), int(cl.get("cpus_per_task") or 1)
        except (AttributeError, TypeError, ValueError):  # not a launcher run config (a bare shim)
            return out
        mem = cl.get("mem_gb")
        gpus = want[1] if cl.get("use_gpus") else 0
        part = cl.get("partition")
        return out + capacity_problems(limits.cluster_nodes(), str(part) if part else None, want[0], want[1], want[2],
                                       gpus, int(mem) * 1024 if mem else None)

    def jobs_in_folder(self, folder: Path) -> List[str]:
        """squeue's array job ids (%F) of this user's jobs whose batch script (%o) is in ``folder``."""
        import getpass  # getpass (termios): only when a launch is repaired

        inside = str(Path(folder).absolute()).rstrip("/") + "/"
        ids = []
        for line in limits.run(["squeue", "-h", "-u", getpass.getuser(), "-o", "%F|%o"]).splitlines():
            jid, _, command = line.partition("|")
            if command.strip().startswith(inside) and jid.strip() not in ids:
                ids.append(jid.strip())
        return ids

    def array_limits(self, cfg: Optional[RunConfig] = None) -> Any:
        """MaxArraySize and MaxJobCount from ``scontrol show config``; when AccountingStorageEnforce
        enforces limits, the user's submit limits from the accounting database (association
        MaxSubmitJobs / GrpSubmitJobs, the QOS's MaxSubmitJobsPerUser: ``sacctmgr``, cached; unreadable:
        none, sbatch judges); and the tightest room: each limit less the jobs (array tasks counted one by
        one) the user has queued now against it (``squeue -r -u USER``), MaxJobCount less every job the
        controller holds (``squeue -r -t all``, every user's). ``cfg``'s cluster.account / partition /
        qos pick the association and QOS. cluster.max_array_size / cluster.max_submit_jobs replace the
        scheduler's values and spare the queries they make moot."""
        import getpass  # getpass (termios): only when the scheduler's limits are read

        user = getpass.getuser()
        size, jobs = limit_overrides(cfg)
        cl = getattr(cfg, "cluster", None) if cfg is not None else None
        account, part, qos = (str(cl.get(k)) if cl is not None and cl.get(k) else None
                              for k in ("account", "partition", "qos"))
        conf: Dict[str, Optional[int]] = {}
        accounting: Optional[Any] = None
        if size is None or jobs is None:
            text = limits.run(["scontrol", "show", "config"])
            conf = limits_from_config(text)
            if jobs is None and enforces_limits(text):  # association and QOS limits apply only when enforced
                accounting = limits.accounting_limits(user, account)
        counted = jobs is not None or conf.get("max_submit_jobs") or accounting
        rows = queued_from_squeue(limits.run(["squeue", "-h", "-r", "-u", user, "-o", QUEUE_FORMAT])) if counted else []
        if jobs is not None:
            return ArrayLimits(size or conf.get("max_array_size"), jobs, len(rows))
        bounds = []
        if conf.get("max_submit_jobs"):
            bounds.append(ArrayLimits(None, conf["max_submit_jobs"], len(rows)))
        if accounting:
            assocs, qos_limits = accounting
            part_qos = None
            if any(v is not None for v in qos_limits.values()):  # (0 is a limit: nothing may be queued)
                part_qos = partition_qos_from_scontrol(limits.run(["scontrol", "show", "partition", "-o"]), part)
            bounds += submit_bounds(assocs, qos_limits, rows, account, part, qos, part_qos)
        if conf.get("max_job_count"):  # the controller's, over every user's jobs it holds (ended ones too,
            # for MinJobAge): sbatch past it retries for minutes, then fails "Resource temporarily unavailable"
            held = len(limits.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i"]).split())
            bounds.append(ArrayLimits(None, conf["max_job_count"], held, bound=MAX_JOB_COUNT))
        tightest = min(bounds, key=lambda b: b.room) if bounds else ArrayLimits()
        return replace(tightest, max_array_size=size or conf.get("max_array_size"))

    def preview(self, cfg: RunConfig, folder: Path, points: List[int], code_dir: Optional[Path] = None,
                job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        """The sbatch script submitit would write for these points (dry run: nothing is submitted;
        after a real submission the archive holds the file submitit wrote)."""
        return (f"# ---- sbatch script for points {points} ({len(points)} array task(s))\n"
                + self.script_text(cfg, folder, len(points), code_dir, job_name, parallelism))

    def script_text(self, cfg: RunConfig, folder: Path, n_points: int, code_dir: Optional[Path] = None,
                    job_name: Optional[str] = None, parallelism: Optional[int] = None) -> str:
        # submitit: only to submit or read a job, not on the plan/--help path
        from submitit.slurm.slurm import _make_sbatch_string

        params = self.submission(cfg, code_dir, job_name, parallelism, folder)
        if n_points > 1:
            params["map_count"] = n_points
        command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
        return _make_sbatch_string(command=command, folder=folder, **params)

    def job_record(self, job: Any, num_tasks: Optional[int] = None) -> JobRecord:
        """A task of an array job is ``<array>_<task>``; a lone job, its own id."""
        record = super().job_record(job, num_tasks)
        array, _, task = record.job_id.partition("_")
        return replace(record, array_job_id=array, array_task_id=int(task)) if task else record

    def submitted_script(self, job: Any) -> Optional[str]:
        path = Path(job.paths.submission_file)
        return path.read_text() if path.exists() else None
