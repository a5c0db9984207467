"""Impossible requests refused before anything is written (issue 27): a world larger than the
cluster (sinfo's node sizes), a job name longer than slurmctld takes, a runs root the file system
cannot hold runs under, a sweep larger than MaxJobCount leaves room for. The case no one listed:
``cluster.mem_gb`` beyond every node's memory (sbatch would queue it pending forever or refuse it).
Pure: sinfo and squeue are faked."""
import io
import time
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR
from launcher.backends import base, slurm
from launcher.sweeps import MAX_JOB_COUNT, ArrayLimits, TooManyJobs, plan_arrays

# `sinfo -h -N -o "%N|%P|%c|%m|%G"` of the local cluster (4 nodes, 4 CPUs, gres gpu:2)
SINFO = "node1|debug*|4|7900|gpu:2\nnode2|debug*|4|7900|gpu:2\nnode3|debug*|4|7900|gpu:2\nnode4|debug*|4|7900|gpu:2\n"
NODES = slurm.nodes_from_sinfo(SINFO)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["cluster=local_slurm", *overrides])


def test_sinfo_and_gres_are_read():
    assert [(n.partition, n.cpus, n.mem_mb, n.gpus, n.default) for n in NODES[:1]] == [("debug", 4, 7900, 2, True)]
    assert slurm.gres_gpus("gpu:a100:8(S:0-1)") == 8 and slurm.gres_gpus("gpu:a:4,gpu:b:2") == 6
    assert slurm.gres_gpus("(null)") == 0 and slurm.gres_gpus("craynetwork:4") == 0


def test_a_world_larger_than_the_cluster_names_the_key():
    """The probe's attack: cluster.nodes=10000 cluster.gpus_per_node=10000 on the 4-node cluster."""
    assert slurm.capacity_problems(NODES, "debug", 2, 1, 1, 0, None) == []
    got = slurm.capacity_problems(NODES, None, 10000, 1, 1, 0, None)
    assert got == ["cluster.nodes: asks 10000 nodes; partition debug has 4 that fit one node's share "
                   "(4 nodes in all, sinfo)"]
    got = slurm.capacity_problems(NODES, "debug", 10000, 10000, 1, 0, None)
    assert got == ["cluster.gpus_per_node: 10000 tasks per node x cluster.cpus_per_task=1 ask 10000 CPUs per node; "
                   "the nodes of partition debug have at most 4 (sinfo)",
                   "cluster.nodes: asks 10000 nodes; partition debug has 4 (sinfo)"]
    got = slurm.capacity_problems(NODES, "debug", 1, 10000, 1, 10000, None)
    assert any(g.startswith("cluster.gpus_per_node: asks 10000 GPUs per node; the nodes of partition debug have "
                            "at most 2") for g in got), got


def test_memory_beyond_every_node_names_mem_gb():
    """The case no one listed: sbatch would refuse it at submission ("Requested node configuration is
    not available") after the sweep was archived."""
    got = slurm.capacity_problems(NODES, "debug", 1, 1, 1, 0, 64 * 1024)
    assert got == ["cluster.mem_gb: asks 64 GB per node; the nodes of partition debug have at most 7.7 GB (sinfo)"]
    assert slurm.capacity_problems(NODES, "debug", 1, 1, 1, 0, 4 * 1024) == []


def test_an_unknown_partition_or_no_sinfo_is_left_to_sbatch():
    assert slurm.capacity_problems(NODES, "nonexistent", 10000, 1, 1, 0, None) == []
    assert slurm.capacity_problems([], None, 10000, 1, 1, 0, None) == []


def test_job_names_and_runs_roots_are_bounded():
    got = slurm.SlurmBackend().request_problems(_cfg("submit.job_name=" + "x" * 5000))
    assert any(g.startswith("submit.job_name: is 5000 bytes; the scheduler accepts at most 1024") for g in got), got
    assert not base.request_limits(_cfg("submit.job_name=" + "x" * 1024), job_name_max=1024)
    got = base.request_limits(_cfg("submit.runs_root=/tmp/" + "d" * 300), job_name_max=None)
    assert got and got[0].startswith("submit.runs_root: a path component is 300 bytes"), got
    got = base.request_limits(_cfg("submit.runs_root=/tmp/" + "/".join(["d" * 200] * 20)), job_name_max=None)
    assert got and "4096 is the most a path may be" in got[0], got


def test_the_launch_refuses_them_before_writing_anything(tmp_path, monkeypatch):
    from launcher.submit import pipeline

    monkeypatch.setattr(slurm.limits, "cluster_nodes", lambda: NODES)
    monkeypatch.setattr(slurm.SlurmBackend, "array_limits", lambda self, cfg=None: ArrayLimits())
    monkeypatch.setattr(slurm.SlurmBackend, "runs_root_problem", lambda self, root, cfg=None: None)
    runs = tmp_path / "runs"
    attacks = {"cluster.nodes": ["cluster.nodes=10000", "cluster.gpus_per_node=10000",
                                 "train.global_batch_size=400000000", "train.micro_batch_size=4"],
               "submit.job_name": ["submit.job_name=" + "n" * 5000],
               "cluster.mem_gb": ["cluster.mem_gb=4096"]}
    for key, overrides in attacks.items():
        cfg = _cfg("model=gpt_tiny", "train.steps=2", "optim.warmup_steps=0",
                   f"submit.runs_root={runs}", *overrides)
        t0 = time.time()
        with pytest.raises(pipeline.InvalidSweep, match=key.replace(".", r"\.")) as got:
            pipeline.launch([pipeline.Point(cfg, overrides)], argv=["launch"], out=io.StringIO())
        assert time.time() - t0 < 20, key  # not O(world): seeds of 1e8 ranks are never planned
        assert "nothing was submitted" in str(got.value), got.value
        assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def test_a_sweep_larger_than_max_job_count_is_refused():
    """The probe's 10,000-point sweep on MaxJobCount=10000: accepted before (10000 <= 10000, the
    user's own queue empty), it queued arrays until slurmctld said EAGAIN after minutes of sbatch retries."""
    lim = ArrayLimits(1001, 10000, 0, bound=MAX_JOB_COUNT)
    kept = r"9999 can be submitted now \(slurmctld refuses a submission that would bring it up to MaxJobCount, so one"
    with pytest.raises(TooManyJobs, match=r"MaxJobCount.*" + kept + " slot stays free"):  # the slot kept, said
        plan_arrays([10000], lim, [1])
    assert len(plan_arrays([9999], lim, [1])) == 10
    with pytest.raises(TooManyJobs, match="holds 5000 now"):  # every user's jobs count, ended ones too
        plan_arrays([5000], ArrayLimits(1001, 10000, 5000, bound=MAX_JOB_COUNT), [1])


def test_max_job_count_counts_every_users_jobs(monkeypatch):
    calls = []

    def fake(cmd):
        calls.append(cmd)
        if cmd[:2] == ["scontrol", "show"]:
            return "MaxArraySize = 1001\nMaxJobCount = 10000\nMaxSubmitJobs = 20000\nAccountingStorageEnforce = none\n"
        if "-t" in cmd:  # every user's, any state
            return "\n".join(str(i) for i in range(9000))
        return "1\n2\n"  # this user's queue

    monkeypatch.setattr(slurm.limits, "run", fake)
    lim = slurm.SlurmBackend().array_limits(None)
    assert (lim.max_array_size, lim.max_submit_jobs, lim.queued, lim.bound) == (1001, 10000, 9000, MAX_JOB_COUNT)
    assert lim.room == 999
    assert ["squeue", "-h", "-r", "-t", "all", "-o", "%i"] in calls


# ---- the user's submit limits from the accounting database (sacctmgr), fed canned outputs ---------

# `sacctmgr -n -P show user U withassoc format=slurm.ASSOC_FORMAT`: the local cluster's (nothing
# set), and a site's (proj: MaxSubmitJobs=10; other: GrpSubmitJobs=50 on partition gpu; QOS lists)
ASSOC_LOCAL = "root|root|root|||||normal\n"
ASSOC_SITE = ("alice|proj|proj||10|||normal,long\n"
              "alice|proj|other|||||normal\n"
              "alice|proj|other|gpu||50|long|normal,long\n")
QOS_SITE = "normal|\nlong|3\nshort|\n"  # `sacctmgr -n -P show qos format=Name,MaxSubmitPU`
# `squeue -h -r -u U -o "%i|%a|%q|%P"`: 4 of proj (a pending array's tasks one line each), 3 of other
QUEUE_SITE = ("77_1|proj|normal|cpu\n77_2|proj|normal|cpu\n77_3|proj|normal|cpu\n80|proj|long|cpu\n"
              "81|other|normal|cpu\n82|other|long|gpu\n83|other|long|gpu\n")
SCONTROL_ENFORCED = "MaxArraySize = 1001\nMaxJobCount = 10000\nAccountingStorageEnforce = associations,limits\n"


def test_sacctmgr_and_squeue_outputs_are_read():
    assert slurm.associations_from_sacctmgr(ASSOC_LOCAL) == [slurm.Association("root", "", None, None, "", ("normal",),
                                                                         "root")]
    site = slurm.associations_from_sacctmgr(ASSOC_SITE + "sacctmgr: error: garbage\n")
    assert [(a.account, a.partition, a.max_submit, a.grp_submit, a.default_qos) for a in site] == [
        ("proj", "", 10, None, ""), ("other", "", None, None, ""), ("other", "gpu", None, 50, "long")]
    assert slurm.qos_limits_from_sacctmgr(QOS_SITE) == {"normal": None, "long": 3, "short": None}
    queued = slurm.queued_from_squeue(QUEUE_SITE)
    assert len(queued) == 7 and queued[0] == slurm.QueuedJob("proj", "normal", "cpu")
    assert slurm.queued_from_squeue("1\n2\n") == [slurm.QueuedJob(), slurm.QueuedJob()]  # bare ids: fields unknown
    assert slurm.associations_from_sacctmgr("") == [] and slurm.qos_limits_from_sacctmgr("") == {}
    part = "PartitionName=cpu Default=YES QoS=N/A Nodes=n1\nPartitionName=gpu Default=NO QoS=gpuq Nodes=g1\n"
    assert slurm.partition_qos_from_scontrol(part, None) is None
    assert slurm.partition_qos_from_scontrol(part, "gpu") == "gpuq"


def test_the_association_and_qos_a_job_runs_under_pick_the_limits():
    assocs = slurm.associations_from_sacctmgr(ASSOC_SITE)
    queued = slurm.queued_from_squeue(QUEUE_SITE)
    qos = slurm.qos_limits_from_sacctmgr(QOS_SITE)
    # the default account (proj): its MaxSubmitJobs, against the user's 4 jobs in proj only
    got = slurm.submit_bounds(assocs, qos, queued)
    assert [(b.max_submit_jobs, b.queued, b.bound) for b in got] == [
        (10, 4, "MaxSubmitJobs of association proj, sacctmgr")]
    # --qos=long: its MaxSubmitJobsPerUser too, against the user's 3 jobs in QOS long (any account)
    got = slurm.submit_bounds(assocs, qos, queued, qos="long")
    assert [(b.max_submit_jobs, b.queued) for b in got] == [(10, 4), (3, 3)]
    assert min(got, key=lambda b: b.room).room == 0
    # account other on partition gpu: that partition's association (GrpSubmitJobs), its default QOS long
    got = slurm.submit_bounds(assocs, qos, queued, account="other", partition="gpu")
    assert [(b.max_submit_jobs, b.queued, b.bound.split(",")[0]) for b in got] == [
        (50, 2, "GrpSubmitJobs of association other/gpu"), (3, 3, "MaxSubmitJobsPerUser of QOS long")]
    # account other elsewhere: nothing set
    assert slurm.submit_bounds(assocs, qos, queued, account="other", partition="cpu") == []
    # a partition's QOS holds every job in that partition
    got = slurm.submit_bounds(assocs, {"gpuq": 2}, queued, account="other", partition="gpu", partition_qos="gpuq")
    assert [(b.max_submit_jobs, b.queued) for b in got] == [(50, 2), (2, 2)]
    # a limit of 0 is one (nothing may be queued), not "unset"
    assert [b.room for b in slurm.submit_bounds([], {"normal": 0}, [])] == [0]
    # the local cluster's association: nothing set, nothing refused; no association at all: the same
    assert slurm.submit_bounds(slurm.associations_from_sacctmgr(ASSOC_LOCAL), {"normal": None}, queued) == []
    assert slurm.submit_bounds([], qos, queued, qos="long") == [slurm.ArrayLimits(None, 3, 3, bound=(
        "MaxSubmitJobsPerUser of QOS long, sacctmgr"))]


def test_a_sweep_past_the_users_max_submit_jobs_is_refused_naming_the_limit():
    (lim,) = slurm.submit_bounds(slurm.associations_from_sacctmgr(ASSOC_SITE), {}, slurm.queued_from_squeue(QUEUE_SITE))
    assert len(plan_arrays([6], lim, [1])) == 1  # 4 queued + 6 = 10: fits
    with pytest.raises(TooManyJobs) as got:
        plan_arrays([4, 3], lim, [1, 1])
    text = str(got.value)
    for part in ("7 points", "queue 10 jobs", "MaxSubmitJobs of association proj", "4 already queued or running",
                 "6 can be submitted now", "Nothing was submitted", "fewer points", "launcher cancel"):
        assert part in text, (part, text)
    assert "cluster.max_submit_jobs" not in text  # a throttle of the launcher's, not the fix


def _fake_slurm(monkeypatch, outputs):
    """slurm.limits.run answering each command from ``outputs`` (first word(s) -> text); the calls made."""
    calls = []

    def fake(cmd):
        calls.append(cmd)
        for prefix, text in outputs.items():
            if " ".join(cmd).startswith(prefix):
                return text
        return ""

    monkeypatch.setattr(slurm.limits, "run", fake)
    return calls


SITE = {"scontrol show config": SCONTROL_ENFORCED, "sacctmgr -n -P show user": ASSOC_SITE,
        "sacctmgr -n -P show qos": QOS_SITE, "squeue -h -r -u": QUEUE_SITE, "squeue -h -r -t all": "1\n" * 20,
        "scontrol show partition": "PartitionName=cpu Default=YES QoS=N/A\n"}


def test_array_limits_read_the_accounting_limits_once_per_ttl(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("getpass.getuser", lambda: "alice")
    calls = _fake_slurm(monkeypatch, SITE)
    lim = slurm.SlurmBackend().array_limits(None)
    assert (lim.max_array_size, lim.max_submit_jobs, lim.queued) == (1001, 10, 4), lim
    assert lim.bound.startswith("MaxSubmitJobs of association proj")
    lim = slurm.SlurmBackend().array_limits(SimpleNamespace(cluster={"qos": "long"}))
    assert (lim.max_submit_jobs, lim.queued, lim.room) == (3, 3, 0)
    assert sum(c[0] == "sacctmgr" for c in calls) == 2  # the second launch read the cache
    # limits not enforced (AccountingStorageEnforce=none): slurmdbd is not asked, nothing refused for it
    calls = _fake_slurm(monkeypatch, {**SITE, "scontrol show config": "MaxJobCount = 10000\n"})
    lim = slurm.SlurmBackend().array_limits(None)
    assert lim.bound == MAX_JOB_COUNT and not any(c[0] == "sacctmgr" for c in calls)


def test_unreadable_accounting_limits_leave_it_to_sbatch(monkeypatch, tmp_path):
    """No slurmdbd (sacctmgr prints an error, nothing on stdout), or no sacctmgr at all: no bound, no traceback."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _fake_slurm(monkeypatch, {"sacctmgr": "", **SITE})  # the first prefix that matches answers
    lim = slurm.SlurmBackend().array_limits(None)
    assert lim.bound == MAX_JOB_COUNT and lim.max_submit_jobs == 10000
    assert not (tmp_path / "launcher").exists() or not list((tmp_path / "launcher").glob("slurm-accounting-*"))
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no Slurm command at all: the real _run
    assert slurm.SlurmBackend().array_limits(None) == ArrayLimits()


def test_the_launch_is_refused_before_writing_anything(monkeypatch, tmp_path):
    from launcher.submit import pipeline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _fake_slurm(monkeypatch, SITE)
    monkeypatch.setattr(slurm.limits, "cluster_nodes", lambda: NODES)
    monkeypatch.setattr(slurm.SlurmBackend, "runs_root_problem", lambda self, root, cfg=None: None)
    runs = tmp_path / "runs"
    points = [pipeline.Point(_cfg("model=gpt_tiny", "train.steps=2", "optim.warmup_steps=0",
                                  f"submit.runs_root={runs}", "cluster.qos=long", f"seed={s}"), [f"seed={s}"])
              for s in range(2)]
    with pytest.raises(pipeline.InvalidSweep, match=r"MaxSubmitJobsPerUser of QOS long.*0 can be submitted now"):
        pipeline.launch(points, argv=["launch"], out=io.StringIO())
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())


def test_a_dry_run_plans_from_the_limits_not_from_the_room_the_queue_leaves_now(monkeypatch, tmp_path, capsys):
    """The QOS's MaxSubmitJobsPerUser is used up by jobs queued now: the launch is refused (above), the dry
    run previews the arrays the limits allow and says how many points could be submitted this minute."""
    from launcher.submit import pipeline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _fake_slurm(monkeypatch, SITE)
    monkeypatch.setattr(slurm.limits, "cluster_nodes", lambda: NODES)
    monkeypatch.setattr(slurm.SlurmBackend, "runs_root_problem", lambda self, root, cfg=None: None)
    runs = tmp_path / "runs"
    points = [pipeline.Point(_cfg("model=gpt_tiny", "train.steps=2", "optim.warmup_steps=0", "submit.dry_run=true",
                                  f"submit.runs_root={runs}", "cluster.qos=long", f"seed={s}"), [f"seed={s}"])
              for s in range(2)]
    out = io.StringIO()
    pipeline.launch(points, argv=["launch"], out=out)
    assert out.getvalue().count("# ---- sbatch script for points") == 1, out.getvalue()[-2000:]
    err = capsys.readouterr().err
    assert "0 of these 2 points can be submitted at this moment (MaxSubmitJobsPerUser of QOS long" in err, err
    assert not runs.exists() or not any(runs.iterdir())  # a dry run writes nothing
    # beyond the limit itself, with nothing queued: the first wave previewed, the rest said to wait
    big = [pipeline.Point(_cfg("model=gpt_tiny", "submit.dry_run=true", f"submit.runs_root={runs}",
                               "cluster.qos=long", f"seed={s}"), [f"seed={s}"]) for s in range(4)]
    pipeline.launch(big, argv=["launch"], out=io.StringIO())
    assert "2 of the 4 points would wait for room" in capsys.readouterr().err
    # without waves, a dry run is refused as the launch is
    for p in big:
        p.cfg.submit.waves = False  # the setting under test
    with pytest.raises(pipeline.InvalidSweep, match=r"MaxSubmitJobsPerUser of QOS long"):
        pipeline.launch(big, argv=["launch"], out=io.StringIO())
