#!/usr/bin/env bash
# `kiln sweep --launcher slurm` against a real, single-node Slurm cluster that this
# script starts in a temporary folder and stops at the end. Needs Debian's
# packages (`apt-get install slurmctld slurmd slurm-client munge`), root (slurmd
# runs the jobs), and a release build (`cargo build --release`, or KILN=path).
#
#   1. a 4-trial CPU sweep as one job array, trial 3 failing (batch larger than the
#      data): 3 finished, 1 failed, results gathered as for local sweeps;
#   2. --resume submits only the failed trial again;
#   3. a long trial cancelled mid-run (scancel: Slurm's SIGTERM reaches kiln, which
#      checkpoints), then --resume: the trial continues from its checkpoint;
#   4. a multi-process run as one job of two tasks (`kiln launch --srun` in the batch
#      script): each task reads its rank from Slurm, rank 1 fails in step 10, the
#      step ends on both, and a second srun step resumes both from the checkpoint and
#      finishes with the result of the same run on this machine (`kiln launch
#      --nproc 2`).
set -euo pipefail
cd "$(dirname "$0")/../.."
KILN=$(realpath "${KILN:-target/release/kiln}")
for tool in munged slurmctld slurmd sbatch squeue scancel; do
  command -v "$tool" > /dev/null || { echo "slurm test: $tool not found; apt-get install slurmctld slurmd slurm-client munge" >&2; exit 2; }
done
D=$(mktemp -d /tmp/kiln-slurm.XXXXXX)
HOST=$(hostname -s)
mkdir -p "$D/state" "$D/spool" "$D/munge"
stop() {
  scancel --me 2> /dev/null || true
  for p in slurmd slurmctld munged; do
    [ -f "$D/$p.pid" ] && kill "$(cat "$D/$p.pid")" 2> /dev/null || true
  done
  sleep 1
}
trap stop EXIT
fail() { echo "slurm test FAILED: $*" >&2; echo "--- slurmctld log" >&2; tail -n 20 "$D/slurmctld.log" >&2 || true; exit 1; }

dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$D/munge/munge.key"
munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/munge.sock" \
  --pid-file="$D/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/seed"
cat > "$D/slurm.conf" <<CONF
ClusterName=kilntest
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=30
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$D/slurm.conf
slurmctld
slurmd
for _ in $(seq 30); do sinfo -h -o %T 2> /dev/null | grep -q idle && break; sleep 1; done
sinfo -h -o %T | grep -q idle || fail "the node did not come up"
echo "slurm test: cluster up in $D"

# 1. Four trials, one failing, as one array, waited for.
cat > "$D/grid.toml" <<TOML
base = "$PWD/configs/debug.toml"
gpus_per_trial = 0
max_restarts = 0
set = ["train.epochs=1"]
[grid]
"train.batch_size" = [16, 32, 64, 100000]
TOML
set +e
"$KILN" sweep --config "$D/grid.toml" --output "$D/sweeps" --launcher slurm --time 10:00 > "$D/1.out" 2> "$D/1.err"
code=$?
set -e
cat "$D/1.err" "$D/1.out"
[ $code = 1 ] || fail "step 1 exit $code, expected 1 (one trial failed)"
SWEEP=$(ls -d "$D"/sweeps/grid-*/)
grep -q "submitted 4 trial(s) (0-3) as Slurm job array" "$D/1.err" || fail "no submission line"
grep -q "^#SBATCH --time=10:00" "$SWEEP/slurm/submit-1.sh" || fail "the time limit is not in the batch script"
grep -q "trial 3 failed (exit 2)" "$D/1.err" || fail "trial 3 should fail with exit 2"
[ "$(grep -c ',finished,0,' "$SWEEP/results.csv")" = 3 ] || fail "3 finished trials expected in results.csv"
grep -q "$HOST (job" "$SWEEP/results.csv" || fail "results.csv should name the node and job"
[ -f "$SWEEP/best.toml" ] || fail "no best.toml"

# 2. Resume: only the failed trial goes back to Slurm.
set +e
"$KILN" sweep --resume "$SWEEP" --launcher slurm > "$D/2.out" 2> "$D/2.err"
code=$?
set -e
cat "$D/2.err"
[ $code = 1 ] || fail "step 2 exit $code, expected 1"
grep -q "trial 0 finished earlier, skipped" "$D/2.err" || fail "trial 0 should be skipped"
grep -q "submitted 1 trial(s) (3)" "$D/2.err" || fail "only trial 3 should be submitted again"

# 3. A long trial cancelled after its first checkpoint, then resumed.
cat > "$D/long.toml" <<TOML
base = "$PWD/configs/debug.toml"
gpus_per_trial = 0
set = ["train.epochs=40", "checkpoint.every_steps=4"]
[grid]
"optim.lr" = [0.05]
TOML
"$KILN" sweep --config "$D/long.toml" --output "$D/sweeps" --launcher slurm --no-wait 2> "$D/3.err"
LONG=$(ls -d "$D"/sweeps/long-*/)
JOB=$(grep -o "job array [0-9]*" "$D/3.err" | grep -o "[0-9]*")
for _ in $(seq 120); do ls "$LONG"/trial-000/*/checkpoints/latest > /dev/null 2>&1 && break; sleep 1; done
ls "$LONG"/trial-000/*/checkpoints/latest > /dev/null 2>&1 || fail "no checkpoint within 120 s"
sleep 2
scancel "$JOB"
for _ in $(seq 60); do [ -f "$LONG/trial-000/slurm.json" ] && break; sleep 1; done
cat "$LONG/trial-000/slurm.json"; echo
grep -q '"exit_code":130' "$LONG/trial-000/slurm.json" || fail "the cancelled trial should checkpoint and exit 130"
"$KILN" sweep --resume "$LONG" --launcher slurm > "$D/4.out" 2> "$D/4.err" || fail "the resumed sweep should finish: $(cat "$D/4.err")"
cat "$D/4.err"
grep -q "trial 0 finished" "$D/4.err" || fail "the resumed trial should finish"
grep -q "kiln: resuming from" "$LONG/trial-000/log.txt" || fail "the trial's log should show it resumed from its checkpoint"

# 4. Two tasks of one job, one GPU-less rank each; rank 1 fails, both restart.
MP=(--config "$PWD/configs/debug.toml" --set checkpoint.every_steps=4)
FAULT=(--set faults.inject=error --set faults.device=1 --set faults.step=10)
"$KILN" launch --nproc 2 "${MP[@]}" --output "$D/mp-local" > /dev/null 2> "$D/5.err" || fail "the local two-process run: $(cat "$D/5.err")"
sbatch --wait --ntasks=2 --time=10:00 --output="$D/mp.out" --wrap \
  "$KILN launch --srun ${MP[*]} ${FAULT[*]} --output $D/mp" > /dev/null || fail "the two-task job failed: $(cat "$D/mp.out")"
cat "$D/mp.out"
grep -q "rank 1 of 2 (local rank 1 of 2), started by Slurm (srun)" "$D/mp.out" || fail "rank 1 should read its rank from Slurm"
grep -q "left the run during step 10" "$D/mp.out" || fail "rank 0 should see rank 1 leave in step 10"
grep -q "restart 1 of 3" "$D/mp.out" || fail "the job should run the step again"
loss() { grep -o '"final_test_loss": [0-9.e-]*' "$1"/*/summary.json; }
[ "$(loss "$D/mp")" = "$(loss "$D/mp-local")" ] || fail "the restarted Slurm run ($(loss "$D/mp")) should end as the local run ($(loss "$D/mp-local"))"
echo "slurm test: passed"
