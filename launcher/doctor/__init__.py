"""`launcher doctor`: why a run failed, and the fix (docs/doctor.md).

Two steps, both without torch (this runs on the login node):

- ``gather(rd)`` (evidence.py) reads the evidence a run left: status.json (error, failed rank, exit code),
  each rank's recorded traceback, the tail of each rank's stderr/stdout log (the backend names the
  files), the hang watchdog's finding and stack dumps, the restart records, what earlier attempts
  left, the last step in the metrics, a few config values the fixes name, and (optionally) the
  scheduler's state of the job.
- ``diagnose(evidence)`` (diagnosis.py, with rank_failures.py's rules over the ranks' errors and logs)
  is a pure function of that evidence: one ``Diagnosis`` (kinds.py: kind, summary, the rank at fault,
  the evidence lines, the fix).

failure_text.py reads the text: the patterns of each class, tracebacks, an out-of-memory error's phase.

Kinds: oom_startup, oom_step, hang, collective_timeout, rendezvous, killed_rank, node_failure,
preempted, time_limit, exception, cancelled, completed, running, pending, unknown. A peer that
only saw a rank go away (gloo's "Connection closed/reset by peer", NCCL's remote error, the run's
own watchdog ending a rank) is never taken for the cause.
"""
from __future__ import annotations

from launcher.doctor.diagnosis import classify, diagnose, restarts_line
from launcher.doctor.evidence import Evidence, gather
from launcher.doctor.failure_text import PEER_GONE, exception_line, oom_phase, raising_frame
from launcher.doctor.kinds import FIXES, KINDS, NOT_FAILED, Diagnosis

__all__ = ["FIXES", "KINDS", "NOT_FAILED", "PEER_GONE", "Diagnosis", "Evidence", "classify", "diagnose",
           "exception_line", "gather", "oom_phase", "raising_frame", "restarts_line"]
