"""Stand-ins for the GPU parts of an llm-d run, for tests and the dev cluster only.

Stdlib only, Python 3.9+. A batch script carries these files only when its spec opts in
(``[standins] enabled = true``, see :mod:`llmd_supervisor.core.spec.runspec`); the batch script
then writes them flat into the job's node directory, beside ``agent.py``, so that a spec's
commands run them as ``python3 {node_dir}/engine.py ...``:

* ``faults.py`` -- every ``LLMD_FAKE_*`` fault knob: the stand-ins' helper (``fault``,
  ``say``) and the node agent's fault hooks (``agent_faults``, loaded by the agent only
  when its config says ``"standins": true``);
* ``engine.py`` -- stand-in for a vLLM prefill/decode engine;
* ``bench.py`` -- stand-in benchmark client (``vllm bench serve``);
* ``router.py`` -- stand-in for the llm-d router (Envoy + EPP with file discovery) on the
  coordinator;
* ``sidecar.py`` -- stand-in for llm-d's P/D sidecar in front of each decode engine.

A production batch script holds none of this: its engine command and the agent only.
"""
