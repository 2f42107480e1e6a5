#!/bin/sh
# Entry point of the GPU workload image: prints, again every REPORT_INTERVAL seconds, what the
# runtime gave this container (environment, NVIDIA device nodes and whether opening them passes
# the device cgroup, driver files and mounts, device metadata files and whether writing them
# fails), so tests read it from the container log.
# Line format: "fgr <seq> <kind> <value>", between "fgr <seq> begin" and "fgr <seq> end".
seq=0
while :; do
  seq=$((seq + 1))
  echo "fgr $seq begin"
  echo "fgr $seq name ${REPORT_NAME:-$(hostname)}"
  env | sort | while IFS= read -r line; do echo "fgr $seq env $line"; done
  for dev in /dev/nvidia* /dev/nvidia-caps/*; do
    [ -c "$dev" ] || continue
    # With the device cgroup open, a node without a loaded driver answers ENXIO;
    # a device the cgroup denies answers EPERM.
    err=$(head -c 1 "$dev" 2>&1 >/dev/null | sed 's/.*: //')
    echo "fgr $seq dev $dev $(stat -c '%t:%T' "$dev") ${err:-opened}"
  done
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/bin /usr/local/nvidia/lib64; do
    for f in "$dir"/libnvidia* "$dir"/libcuda* "$dir"/nvidia-*; do
      [ -e "$f" ] && echo "fgr $seq file $f"
    done
  done
  # Device metadata (KEP-5304): each file on one line, and what appending to it answers.
  find /var/run/kubernetes.io/dra-device-attributes -name '*-metadata.json' 2>/dev/null | sort |
    while IFS= read -r f; do
      echo "fgr $seq meta $f $(tr -d '\n' < "$f" | tr -s ' ')"
      err=$( (: >> "$f") 2>&1 | sed 's/.*: //')
      echo "fgr $seq metawrite $f ${err:-written}"
    done
  grep -E 'nvidia|cuda|mps' /proc/self/mountinfo | while read -r _ _ _ _ point _; do
    echo "fgr $seq mount $point"
  done
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1 | while IFS= read -r line; do echo "fgr $seq nvml $line"; done
  fi
  echo "fgr $seq end"
  [ "${REPORT_ONCE:-}" = 1 ] && exit 0
  sleep "${REPORT_INTERVAL:-5}"
done
