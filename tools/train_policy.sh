#!/bin/bash
# Remakes the shipped transfer-cube policy (models/aloha_sim_transfer_cube) from nothing:
# the scripted demonstrations, then the stages of oxygen-train, each starting from the last
# (docs/training.md says why each is there). About 3 hours on a 2-core CPU.
#   tools/train_policy.sh OUT      (after `source install/setup.bash`)
# The policy is OUT/runL/checkpoint; each stage resumes if run again (--resume).
set -euo pipefail
out=${1:?usage: tools/train_policy.sh OUT}
mkdir -p "$out"
cd "$out"
share=$(ros2 pkg prefix oxygen_ros)/share/oxygen_ros
demos() { [ -f "$1/summary.json" ] || ros2 run oxygen_ros oxygen_demos --episodes "$2" --seed "$3" --jobs 2 --out "$1"; }
train() {
  local run=$1; shift
  if [ -f "$run/state.json" ]; then
    ros2 run oxygen_ros oxygen_train --out "$run" --resume "$@"
  else
    ros2 run oxygen_ros oxygen_train --out "$run" "$@"
  fi
}
# 300 episodes, seeds 1000..1299; training holds out the last 5 of the last directory.
demos demosA 100 1000
demos demosB 200 1100
# 1. The first stage (the whole top view, 95 episodes), 4000 steps; then on to step 6000
#    of a 10000-step schedule.
train runS --data demosA --steps 4000
train runA --data demosA --start-from runS/checkpoint --steps 10000 --stop-at 6000
# 2. The crop of the workspace on 295 episodes, every frame drawn evenly, 2000 steps.
train runC --data demosA demosB --recipe "$share/config/train_transfer_cube_crop_even.yaml" \
  --steps 2000 --init-from runA/checkpoint
# 3. The crop with the reach sampled more often, 4000 steps.
train runD --data demosA demosB --recipe "$share/config/train_transfer_cube_crop.yaml" \
  --steps 4000 --init-from runC/checkpoint
# 4. The same, on from step 4000 to the end of a 10000-step schedule (the learning rate back
#    up to 3.5e-4 and down to 5e-5 again; AdamW's moments afresh).
train runE --data demosA demosB --recipe "$share/config/train_transfer_cube_crop.yaml" \
  --steps 10000 --start-from runD/checkpoint
# 5. The language stage: the policy's own closed loop on 100 training seeds (failures
#    included), its narration targets and answers from the scene; the readout alone trains,
#    so every action stays what runE's were.
[ -f rollouts/episode_99.hdf5 ] || ros2 run oxygen_ros oxygen_eval --env aloha-transfer-cube \
  --direct --episodes 100 --seed 1000 --checkpoint runE/checkpoint --record rollouts --no-video \
  --out rollouts_report
train runL --data demosA rollouts --recipe "$share/config/train_transfer_cube_language.yaml" \
  --init-from runE/checkpoint
echo "the policy: $out/runL/checkpoint"
