"""How long a step takes: the latency model, a fitted step-time profile, the record tap's trace and the replay of a recorded run. Pure."""
