#!/usr/bin/env bash
# Waits up to $1 seconds for the pipeline, then hands results and caches back via $OUT.
set -u
end=$(( $(date +%s) + ${1:-540} ))
while [ ! -f /tmp/res/DONE ] && [ "$(date +%s)" -lt "$end" ]; do
  pgrep -f "bench/gpu/(pipeline|two-gpus).sh" > /dev/null || break   # finished or died: report now
  sleep 5
done
tail -n 2 /tmp/res/*.log /tmp/res/*.txt 2>/dev/null | tail -n 90
cat /tmp/res/pipeline.log
tar czf "$OUT/res.tar.gz" -C /tmp res
[ "${CACHES:-0}" = 1 ] && tar cf - -C "${CACHE_DIR:-/tmp/kcache}" . | xz -T0 -6 > "$OUT/caches.tar.xz" && ls -la "$OUT"
exit 0
