#!/usr/bin/env bash
# Code A/B through the server on a GPU machine: for each spec, a fresh `rtc-agent serve` of one version of
# rtc_agent/ and its loads, by studies/device_processes.sh part 1 (TRACE=1, KILL=0), one tar.gz each under $OUT.
# Usage (repo root, wheels installed as .whl/INSTALL.txt says):
#   SPECS="v|CALLERS[|SERVE,ARGS] ..." bash studies/device_ab.sh [WAV]
# v: `new` is the tree as sent; any other v runs .whl/ab_<v>/rtc_agent, made here beforehand with
#   mkdir -p .whl/ab_old && git archive <rev> rtc_agent | tar -x -C .whl/ab_old
# CALLERS and SERVE,ARGS as device_processes.sh's CALLERS and SERVE_ARGS, commas for spaces: "old|1,24,24,24"
# "new|1,16,16|--quantize,int4". LIMIT: seconds per server and its loads (default 400; a server cut off at the
# limit brings back its files without the tar: at most 8 files come back from a run).
# The loads as one table, with the traces' bursts: python3 -m studies.ab_table <files_at>/*.tar.gz
set -u
wav=${1:-.whl/thanks.wav}
n=0
rm -rf .whl/ab_new && mkdir -p .whl/ab_new && cp -r rtc_agent .whl/ab_new/
for spec in $SPECS; do
    IFS='|' read -r v callers args <<< "$spec"
    rm -rf rtc_agent && cp -r ".whl/ab_$v/rtc_agent" rtc_agent && find rtc_agent -name __pycache__ -prune -exec rm -rf {} +
    echo "=== $v: $callers ${args:-} ($(date +%T))"
    SERVE_ARGS="${args//,/ }" TRACE=1 KILL=0 CALLERS="${callers//,/ }" OUT="$OUT/$v$((++n))" \
        timeout "${LIMIT:-400}" bash studies/device_processes.sh 1 "$wav"
done
rm -rf rtc_agent && cp -r .whl/ab_new/rtc_agent rtc_agent
