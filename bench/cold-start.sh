#!/usr/bin/env bash
# On a GPU machine: kiln bench's first step with empty kernel caches (kiln's and the driver's), for ResNet-50 and ResNet-18 bf16 channels-last and ResNet-18 fp32, with cubecl's compilation log timed line by line (what each kind of kernel costs, in cold-start-kernels.txt), then ResNet-18 again with only the autotune results kept and with only the compiled kernels kept.
set -u
cd "$(dirname "$0")/.."
source bench/lib.sh
W=/tmp/cold; mkdir -p $W
# cubecl reads cubecl.toml from the working directory; kiln sets the caches itself.
cat > $W/cubecl.toml <<EOF
[compilation.logger]
level = "basic"
file = "$W/compile.log"
[autotune.logger]
level = "minimal"
file = "$W/autotune.log"
EOF
R50=(--model resnet50 --image-size 224 --batch 128 --steps 10 --warmup 3 --precision bf16 --channels-last)
R18=(--model resnet18 --image-size 32 --batch 256 --steps 20 --warmup 5 --precision bf16 --channels-last)
F32=(--model resnet18 --image-size 32 --batch 256 --steps 20 --warmup 5 --precision fp32)
# name, kiln's cache dir, the driver's cache dir, kiln bench's arguments.
cold() {
  local name=$1 cache=$2 driver=$3; shift 3
  [ "$(left)" -gt 60 ] || { log "$name skipped"; return; }
  (
    cd $W && rm -f compile.log autotune.log && touch compile.log autotune.log
    sh -c 'echo $$ > tail.pid; exec tail -n0 -F compile.log' 2> /dev/null | while IFS= read -r l; do echo "$(date +%s.%N) $l"; done > "$RES/$name-compile.ts" &
    KILN_CACHE_DIR=$cache CUDA_CACHE_PATH=$driver timeout "$(limit)" "$K" bench --json "$@" > "$RES/$name.json" 2> "$RES/$name.err"
    echo "exit $?" >> "$RES/$name.err"
    sleep 1; kill "$(cat tail.pid)"
    cp autotune.log "$RES/$name-autotune.log"
  )
  log "$name: $(tail -n1 "$RES/$name.err"), $(grep -c . "$RES/$name-compile.ts") kernels compiled, first step $(python3 -c "import json;print(round(json.load(open('$RES/$name.json'))['first_step_s'],1))" 2> /dev/null) s"
}
cold r50 $W/c50 $W/d50 "${R50[@]}"
cold r18 $W/c18 $W/d18 "${R18[@]}"
cold f32 $W/c32 $W/d32 "${F32[@]}"
cp -r $W/c18 $W/c18-tuned; find $W/c18-tuned -path '*ptx*' -type f -delete
cold r18-autotune-kept $W/c18-tuned $W/d18-2 "${R18[@]}"
cp -r $W/c18 $W/c18-ptx; find $W/c18-ptx -path '*autotune*' -type f -delete
cold r18-kernels-kept $W/c18-ptx $W/d18 "${R18[@]}"
# Seconds from each compilation to the next, summed by kernel name.
python3 - "$RES" > "$RES/cold-start-kernels.txt" <<'EOF'
import collections, glob, sys
for path in sorted(glob.glob(sys.argv[1] + "/*-compile.ts")):
    rows = [l.rstrip("\n").split(" ", 1) for l in open(path) if " " in l]
    by = collections.defaultdict(lambda: [0, 0.0])
    for (t, name), (t_next, _) in zip(rows, rows[1:]):
        k = by[name.split("::")[-1]]
        k[0] += 1
        k[1] += float(t_next) - float(t)
    print(path.split("/")[-1], len(rows), "kernels")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"  {n:4d} {s:6.1f} s  {name}")
EOF
cat "$RES/cold-start-kernels.txt" >> "$RES/log.txt"
[ -n "${KEEP:-}" ] || finish
