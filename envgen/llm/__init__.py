"""The language-model interface: the prompt, the tolerant answer parser, the reward (a TRL reward function) and the
outcome rates every caller counts with."""
