"""``afm bench``: a load generator, the raw mlx-lm limit, peers, and reports."""

from __future__ import annotations

from ._loadgen import SSEParser as SSEParser
from ._loadgen import StreamObserver as StreamObserver
from ._loadgen import Target as Target
from ._loadgen import run_closed as run_closed
from ._loadgen import run_open as run_open
from ._raw import RawRunner as RawRunner
from ._report import build_report as build_report
from ._report import format_table as format_table
from ._report import write_report as write_report
from ._results import RequestResult as RequestResult
from ._results import RunResult as RunResult
from ._run import BenchConfig as BenchConfig
from ._run import run_bench as run_bench
from ._stats import Summary as Summary
from ._stats import percentile as percentile
from ._stats import summarize as summarize
from ._workload import Job as Job
from ._workload import Workload as Workload
from ._workload import make_workload as make_workload
from ._workload import poisson_schedule as poisson_schedule

__all__ = [
    "BenchConfig",
    "Job",
    "RawRunner",
    "RequestResult",
    "RunResult",
    "SSEParser",
    "StreamObserver",
    "Summary",
    "Target",
    "Workload",
    "build_report",
    "format_table",
    "make_workload",
    "percentile",
    "poisson_schedule",
    "run_bench",
    "run_closed",
    "run_open",
    "summarize",
    "write_report",
]
