"""Simulated robots and the trained-policy loop: the synthetic robot, the MuJoCo ALOHA, the
controllers' rules, scripted demonstrations, training, evaluation and `make demo`."""
