#!/usr/bin/env bash
# Runs a long device job across several device-tool calls (each at most 10 minutes; the
# machine stays warm between back-to-back calls, its /tmp with it):
#   bash benchmarks/device_background.sh start STEP...   # h200_session.sh STEPs, detached
#   bash benchmarks/device_background.sh poll [SECONDS]  # wait (default 540 s) or until
#                                                        # done; copy new results to $OUT
# Results go to $DEVICE_JOB (default /tmp/device_job: session.log, STEP.log, output
# folders); poll copies the CSVs, logs and PNGs (not checkpoints) that are new or changed
# since an earlier poll sent them into $OUT, at most 8 (the tool's limit), and prints the
# session log's tail.
set -u
JOB=${DEVICE_JOB:-/tmp/device_job}
case ${1:-} in
  start)
    shift
    if [ -e $JOB/driver.log ]; then echo "a job is already running here"; exit 0; fi
    mkdir -p $JOB
    (OUT=$JOB setsid bash benchmarks/h200_session.sh "$@" > $JOB/driver.log 2>&1 < /dev/null
     echo "exit $?" >> $JOB/driver.log; touch $JOB/DONE) > /dev/null 2>&1 &
    echo "started: $*" ;;
  poll)
    [ -e $JOB/driver.log ] || { echo "no job on this machine (a fresh one?)"; exit 1; }
    end=$((SECONDS + ${2:-540}))
    while [ ! -e $JOB/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done
    # The device tool returns at most 8 files a call: send the files not yet sent in
    # their present version (.sent lists path and mtime of each one sent), CSVs first,
    # then the session log, other logs, the rest, PNGs; what does not fit goes next poll.
    touch $JOB/.sent
    (cd $JOB && find . -type f \( -name '*.csv' -o -name '*.log' -o -name '*.png' \
      -o -name '*.json' -o -name '*.txt' \) -size -4M -printf '%T@ %p\n' \
      | grep -vxF -f .sent \
      | awk '{r = /\.csv$/ ? 0 : /session\.log$/ ? 1 : /\.log$/ ? 2 : /\.png$/ ? 4 : 3;
              print r "\t" $0}' | sort -k1,1n -k2 | cut -f2 > .unsent)
    head -n 8 $JOB/.unsent > $JOB/.sending
    (cd $JOB && while IFS= read -r line; do  # "MTIME PATH"; marked sent once copied
       cp --parents -- "${line#* }" "${OUT:?}" && printf '%s\n' "$line" >> .sent
     done < .sending)
    left=$(( $(wc -l < $JOB/.unsent) - $(wc -l < $JOB/.sending) ))
    [ $left -gt 0 ] && echo "$left changed files left for the next poll"
    [ -e $JOB/DONE ] && echo "DONE" || echo "still running"
    tail -n 30 $JOB/session.log 2>/dev/null || tail -n 5 $JOB/driver.log ;;
  *) echo "usage: $0 start STEP... | poll [SECONDS]"; exit 2 ;;
esac
