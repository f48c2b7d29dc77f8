# The two commands of the README. Each sets up what it needs from nothing (tools/ws.sh).
.PHONY: demo test build setup bench clean

# ROBOT=aloha_mujoco: the MuJoCo ALOHA (installs requirements-mujoco.txt first), evaluated.
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
