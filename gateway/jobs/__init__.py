"""Batch jobs: OpenAI-compatible files and batches, run as batch-class work items through
the same micro-batchers as interactive traffic, with their state in SQLite under
`--data-dir` so that a restart resumes where it stopped.

- `service`: `BatchJobs`, what the batch routes call, and the jobs' start, pause and close.
- `host`: `JobsHost`, the little of the gateway that jobs use (`GatewayState` is one).
- `store`: the SQLite store (files, jobs, per-line status and results).
- `validate`: whole-file validation at batch creation, and turning a line into work.
- `runner`: runs each active job's lines, stops, expires and finalises jobs (`job`: a job
  and its lines in flight).
- `lines`: runs one line through its model's served batcher, within the model's batch
  `share`.
- `commit`: group commit of finished lines.
- `lease`: which of several front ends runs batch jobs (`worker_lease`).
- `metrics`: `ferry_jobs{status}` and `ferry_job_lines_total{status}`.

Nothing is imported here, so that the store alone (the `--api-workers` supervisor takes
the data directory's lock with it) imports neither the runner nor starlette.
"""
