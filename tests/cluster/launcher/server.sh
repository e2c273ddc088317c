#!/bin/bash
# One rank of the launcher (see job.slurm). Rank 0 is the coordinator: it "benchmarks"
# (writes a result file per concurrency of BENCH_MAX_CONCURRENCY, 'x'-delimited as
# InferenceX's server.sh takes it, default 4x8; under results/, or results/<job id>/ with
# IX_RESULTS_BY_JOB set), then publishes its rc (IX_BENCH_RC, default 0) as the marker.
set -u
rank=$SLURM_PROCID
marker=".bench_done.$SLURM_JOB_ID"
exec >"slurm_job-${SLURM_JOB_ID}_rank_${rank}.log" 2>&1
echo "rank $rank on $(hostname): serving $IX_MODEL"
for i in $(seq 1 "${IX_LOG_LINES:-20}"); do echo "rank $rank: engine step $i"; sleep 0.1; done
if [ "$rank" = 0 ]; then
    results=results${IX_RESULTS_BY_JOB:+/$SLURM_JOB_ID}
    mkdir -p "$results"
    IFS='x' read -r -a concurrencies <<<"${BENCH_MAX_CONCURRENCY:-4x8}"
    echo "rank 0: benchmarking concurrencies ${concurrencies[*]}"
    rc=${IX_BENCH_RC:-0}
    for c in "${concurrencies[@]}"; do
        case $c in
        '' | *[!0-9]*) echo "rank 0: BENCH_MAX_CONCURRENCY has '$c', not a number"; rc=2; break ;;
        esac
        sed "s/\"max_concurrency\": 4/\"max_concurrency\": $c/" \
            "$LAUNCHER_DIR/result.json" >"$results/ix_c${c}.json.tmp"
        mv "$results/ix_c${c}.json.tmp" "$results/ix_c${c}.json"
    done
    echo "rank 0: benchmark finished with rc $rc"
    printf '%d\n' "$rc" >"$marker.tmp" && mv "$marker.tmp" "$marker"
    exit "$rc"
fi
for _ in $(seq 1 600); do
    if [ -f "$marker" ]; then
        rc=$(cat "$marker")
        echo "rank $rank: the coordinator says rc $rc"
        exit "$rc"
    fi
    sleep 0.2
done
echo "rank $rank: no marker after 120 s"
exit 1
