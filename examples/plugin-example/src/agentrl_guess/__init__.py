"""agentrl-guess: an example third-party agentrl plugin (env `guess_number`, tool `midpoint`)."""
