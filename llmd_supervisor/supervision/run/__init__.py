"""One run, from its submission to its archived outcome (DESIGN.md section 3), top-down.

- `supervisor`: the `Supervisor`, the control API's entry points over the parts below.
- `driver`: each run's `RunHandle`, which only the driver changes, and the `RunDriver`
  (every run's loop: it plans with `core.run.lifecycle`, runs the phases (`steps`: one
  `PhaseResult` each) and applies what they return).
- `registry`: `RunRegistry`, every run the daemon knows, loaded from the journal (at
  start, a takeover, a standby's look) with its archive moved here if need be.
- `entries`: `RunEntries`, how a run comes to be (submit, a script, adopt): admitted, its
  kind chosen once (`core.run.kinds`), journaled, its driver started.
- `outbound`: a change of a run's outbound events, what they read before the run's lock.
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
