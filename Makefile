# The two commands of the README. Each sets up what it needs from nothing (tools/ws.sh).
.PHONY: demo test build setup bench clean

# The shipped policy on the MuJoCo ALOHA (installs requirements-mujoco.txt first);
# ROBOT=sim: the random-weight DROID-shaped simulated robot.
demo:
	tools/ws.sh demo $(if $(ROBOT),--robot $(ROBOT))

test:
	tools/ws.sh test

build:
	tools/ws.sh build

setup:
	tools/ws.sh setup

bench:
	tools/ws.sh bench $(ARGS)

clean:
	rm -rf build install log
