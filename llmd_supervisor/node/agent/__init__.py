"""llm-d node agent: one per node (one Slurm task per node), stdlib only, Python 3.9+.

It implements the completion-marker protocol of DESIGN.md section 4 inside the allocation.
Stdlib only, relative imports only: the batch script writes this package into
``<log_dir>/<job_id>/node/llmd_node/agent/`` (beside ``common.py`` and ``marker_format.py``
in ``llmd_node/``), its ``__main__`` as ``node/agent.py``, and a JSON config, and runs
``python3 agent.py --config config.json`` under ``srun --ntasks-per-node=1``.

Roles (from ``SLURM_PROCID``, with P prefill and D decode nodes):
  * ranks ``0 .. P-1``: prefill nodes;
  * rank ``P``: the coordinator (decode leader) -- it waits for every engine, runs the
    benchmark sweep and publishes the marker;
  * ranks ``P+1 .. P+D-1``: decode workers.
Engines form groups of ``P/prefill_workers`` (``D/decode_workers``) consecutive nodes; the
first node of a group is its leader, and only leaders are handed to the benchmark.

Every rank starts its engine in its own process group (killed with the agent's parent
death signal as a last resort), logs it to ``rank<r>.<role>.engine.log``, writes a status
file ``rank<r>.status.json`` every ``heartbeat_s`` (atomically) and waits for its engine's
health endpoint until ``health_timeout_s``. The agent never relies on Slurm to reap its
engine: every exit path terminates the engine's process group (TERM, then KILL).

Files, all under the run's log directory ``L`` and job id ``J``:
  * ``L/.bench_done.J`` -- the marker, JSON ``{rc, job_id, rank, reason, finished_at}``,
    published by the coordinator only (temp file in ``L``, fsync, rename, fsync ``L``);
  * ``L/J/rank<r>.status.json`` -- heartbeat: role, rank, host, pid, engine_pid, state, rc,
    reason, updated_at;
  * ``L/J/rank<r>.agent.log``, ``L/J/rank<r>.<role>.engine.log``;
  * ``L/J/rank<r>.diag.txt`` -- written on SIGTERM: state, processes, last log lines;
  * ``L/J/bench/c<N>.json`` / ``L/J/bench/c<N>.log`` -- one benchmark point each.

Workers finish when the marker appears (exit with its rc) or when their engine dies
(re-read the marker -- listing the directory -- for up to ``marker_grace_s`` before
deciding). They also stop waiting when the coordinator's status file has not changed for
``coordinator_silence_s`` (measured on the worker's own monotonic clock, so clock skew
between nodes does not matter).

Exit codes:
  * ``0``    -- the marker says the run succeeded;
  * ``1..63`` and anything else not listed -- the marker's rc (e.g. 7: a benchmark point
    failed), passed through unchanged by every rank;
  * ``64``   -- bad invocation, config or Slurm environment;
  * ``70``   -- internal agent error (a bug; see the agent log);
  * ``71``   -- the engine could not be started;
  * ``72``   -- the local engine did not become healthy before the deadline;
  * ``73``   -- the local engine died before the marker, and no marker appeared within
    the grace;
  * ``74``   -- (coordinator) a remote engine did not become healthy before the deadline;
  * ``75``   -- (worker) the coordinator went silent and no marker appeared;
  * ``78``   -- (worker) the marker is invalid by the project's one reader
    (``marker_format``): its rc is no exit status (not an integer from 0 to 255, or a
    boolean), or another field is wrong; ``marker.invalid`` in the agent log names it;
  * ``143``  -- SIGTERM (the coordinator also publishes a marker with rc 143, reason
    ``sigterm``). After stopping its engine and writing its diagnostic a rank waits
    (within the grace) until the other ranks have finished theirs, so that srun's
    kill-on-bad-exit, triggered by the first exit, finds nothing left to SIGKILL.
When a worker fails locally (71/72/73) the coordinator notices it through the worker's
status file and publishes a marker carrying that rc and naming the rank, so all ranks end
with the same rc. Once a rank has decided its final rc, a late SIGTERM (for example from
``srun --kill-on-bad-exit``) does not change it; and a worker whose SIGTERM arrives while
the marker is already published (it had not polled it yet) exits with the marker's rc,
not 143 -- measured on Slurm 22.05: the first task exiting nonzero makes srun TERM the
others at once, and srun's rc is the highest task rc, so one 143 would turn a run's rc 7
into 143.

Tests and the dev cluster inject faults into the agent through `hooks` (nothing in
production; the knobs are the stand-ins', ``standins/faults.py``).

Modules:
  * ``main`` -- the command line; ``config`` -- loading ``config.json`` (the defaults are
    ``common.AGENT_DEFAULTS``, which the renderer writes from too);
  * ``run`` -- the `Agent`: its state, status and log, and the coordinator's and the
    workers' ways through the protocol;
  * ``bringup`` -- the stages before the benchmark (engines, sidecars, router) and their
    deadlines; ``sweep`` -- the benchmark points;
  * ``processes`` -- the one spawn helper, process groups, the stop sequence;
  * ``health`` -- HTTP and TCP health probes, this node's address;
  * ``marker`` -- publishing and waiting for the marker (read by ``marker_format``);
  * ``status`` -- this rank's status file and heartbeat, the peers' status files;
  * ``stop`` -- SIGTERM: noticing it, the diagnostic, leaving together;
  * ``errors``, ``templates``, ``topology``, ``files``, ``hooks`` (fault hooks: nothing in
    production).
"""
