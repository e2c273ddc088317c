"""One run, from its submission to its archived outcome (DESIGN.md section 3), top-down.

- `driver`: the `Supervisor` (every run's driver loop, the control API's entry points)
  and each run's `RunHandle`, which only the driver changes; it plans with
  `core.run.lifecycle`, calls the phases and applies what they return.
- `admission`: a spec validated, its log directory checked, before a run is journaled.
- `context`: `RunContext`, what a phase may read (the run's record and events, its
  cluster, the configuration, the clock) and emit (journal events).
- the phases, one module each, in a run's order: `submit` (sbatch once; reconcile by
  name), `follow` (the poller's views of the job), `finish` (stop the watchers, complete
  the log copies), `verify` (the verdict, its diagnosis and receipt), `retries` (before
  a submission: exclusions, holds; after a verdict: quarantine, retry), `archive` (the
  evidence on disk before the outcome), `cancel` (the cancel sequence), `foreign` (what
  a job the daemon did not write says of itself), `failures` (when the driver gives up).
- `evidence`: the finished job's marker and allocation, as the phases after its end
  read them; `records`: the events' kinds and typed payloads, and the receipts.

Phases never import the driver and never change the run; no module of the package is in
an import cycle (tests/unit/test_import_cycles.py).
"""
