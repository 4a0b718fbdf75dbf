"""Scale-out: a job of many ranks analysed rank by rank on an engine (Ray, or this process).

The driver never holds a rank's trace. Each rank is ingested and analysed by a task that
returns a small summary; the driver matches the collectives across ranks, compares the ranks
and assembles the report from the summaries (docs/scale.md).

* :mod:`aiprof.scale.tasks` — the per-rank work and the summaries it returns.
* :mod:`aiprof.scale.engines` — where the tasks run: this process, an embedded Ray or a cluster.
* :mod:`aiprof.scale.job_report` — the driver: tasks in, report out.
"""
